"""Loading the Prefect block named in ``storage.credentials_block`` (the orchestrator side:
Prefect lives here, not in storage/)."""

from __future__ import annotations

import json

from stoker.config import StorageConfig
from stoker.failures import ConfigError
from stoker.storage import credentials
from stoker.storage.credentials import StoreCredentials

FIELD = "storage.credentials_block"
SECRET_SHAPE = '{"aws_access_key_id": "...", "aws_secret_access_key": "..."}'


def _problem(what: str, fix: str) -> ConfigError:
    return ConfigError([f"{FIELD}: {what}; {fix}."])


def load_block_credentials(name: str) -> StoreCredentials:
    """The credentials in the Prefect block `name` ('NAME' is a Secret block,
    'TYPE/NAME' any block type, e.g. 'aws-credentials/NAME'). One ConfigError naming the
    field and the fix when it is missing or holds something else; no value is ever shown."""
    from prefect.blocks.core import Block

    slug = name if "/" in name else f"secret/{name}"
    try:
        block = Block.load(slug)
    except ValueError as err:  # no such document, or a block type this install lacks
        text = str(err)
        if "aws-credentials" in slug and "aws-credentials" in text and "find" not in text.lower():
            raise _problem(
                f"{slug!r} needs the prefect-aws package", "pip install prefect-aws, or use a Secret block"
            ) from None
        raise _problem(
            f"no Prefect block {slug!r} on this Prefect server",
            "create it, e.g. prefect.blocks.system.Secret(value="
            + SECRET_SHAPE
            + f").save({name.rsplit('/', 1)[-1]!r}), or fix the name",
        ) from None
    values = _aws_values(block)
    if values is None:
        raise _problem(
            f"block {slug!r} does not hold AWS credentials",
            "store " + SECRET_SHAPE + " in a Secret block, or use an AwsCredentials block",
        )
    return StoreCredentials(*values, source=f"Prefect block {slug!r}")


def _plain(value) -> str | None:
    if value is None:
        return None
    getter = getattr(value, "get_secret_value", None)
    return str(getter() if getter else value) or None


def _aws_values(block) -> tuple[str, str, str | None] | None:
    if hasattr(block, "aws_access_key_id") and hasattr(block, "aws_secret_access_key"):
        payload = {
            "aws_access_key_id": block.aws_access_key_id,
            "aws_secret_access_key": block.aws_secret_access_key,
            "aws_session_token": getattr(block, "aws_session_token", None),
        }
    elif hasattr(block, "get"):  # a Secret block: a JSON object, or a JSON string of one
        payload = block.get()
        if isinstance(payload, str):
            try:
                payload = json.loads(payload)
            except ValueError:
                return None
    else:
        return None
    if not isinstance(payload, dict):
        return None
    key_id, secret = _plain(payload.get("aws_access_key_id")), _plain(payload.get("aws_secret_access_key"))
    if not key_id or not secret:
        return None
    return key_id, secret, _plain(payload.get("aws_session_token"))


def use_credentials_block(name: str | None) -> None:
    """Load the block `name` (if any) and open S3 with it from now on in this process;
    without one, the environment's credentials are used."""
    credentials.use(load_block_credentials(name) if name else None)


def use_store_credentials(storage: StorageConfig) -> None:
    """use_credentials_block for the block the config names."""
    use_credentials_block(storage.credentials_block)
