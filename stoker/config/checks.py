"""What several sections check of a value, as strings (no filesystem, no network): that
options hold no credentials (``_no_credentials``, told with ``CREDENTIALS_FIX``), and that a
URL has a form that can work (``_url_problem``)."""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

from stoker.fields import _rule

# option names that hold credentials (fsspec/s3fs/gcsfs/adlfs spellings); matched case-blind,
# at any depth, plus any name containing one of the words
_SECRET_NAMES = {
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "session_token",
    "access_key",
    "secret_key",
    "client_secret",
    "account_key",
    "sas_token",
    "connection_string",
    "credentials",
    "private_key",
}
_SECRET_WORDS = ("secret", "password", "token", "credential", "private_key")
CREDENTIALS_FIX = (
    "credentials never go in the config (it is written to the store and to "
    "Prefect): give them to the environment (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials), where s3fs, "
    "the ranks and the evaluations find them, or name a Prefect Secret or "
    "AwsCredentials block in storage.credentials_block"
)


def _secret_paths(value: Any, path: str = "") -> list[str]:
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            name = str(k).lower()
            here = f"{path}.{k}" if path else str(k)
            if name in _SECRET_NAMES or any(w in name for w in _SECRET_WORDS):
                found.append(here)
            else:
                found += _secret_paths(v, here)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _secret_paths(v, f"{path}[{i}]")
    return found


def _no_credentials(options: dict[str, Any]) -> dict[str, Any]:
    found = _secret_paths(options)
    if found:
        raise PydanticCustomError(
            "secret_in_config", f"holds credentials ({', '.join(found)})", {"fix": CREDENTIALS_FIX}
        )
    return options


_OBJECT_STORES = ("s3", "gs", "gcs", "az", "abfs", "abfss", "r2")


def _url_problem(value: str, what: str) -> PydanticCustomError | None:
    """A URL whose form cannot work: an object-store URL without a bucket, an unknown-looking
    scheme spelled without '//' ... (a string test, no network)."""
    scheme, sep, rest = value.strip().partition("://")
    if not sep:
        return None
    if not scheme or not scheme.replace("+", "").replace("-", "").isalnum():
        return _rule("has no valid URL scheme", f"write {what} as scheme://..., e.g. s3://bucket/prefix")
    if scheme.lower() in _OBJECT_STORES and not rest.split("/", 1)[0]:
        return _rule("names no bucket", f"write {scheme}://<bucket>/<prefix>, e.g. {scheme}://my-bucket/stoker")
    if scheme.lower() in ("http", "https") and not rest.split("/", 1)[0]:
        return _rule("names no host", "write https://host/path")
    return None
