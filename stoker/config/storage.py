"""The storage section (``StorageConfig``): the object-store root (``default_root``: the
embedded default), its fsspec options and the Prefect block of its credentials."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from stoker.config.checks import _no_credentials, _url_problem
from stoker.fields import NonBlank, _rule, _Section


def default_root() -> str:
    """The embedded default object store: a local folder, overridable with STOKER_ROOT."""
    env = os.environ.get("STOKER_ROOT")
    if env:
        return env
    return "file://" + str(Path.cwd() / "stoker-data")


_BLOCK_NAME = re.compile(r"^(?:[a-z0-9][a-z0-9-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")


class StorageConfig(_Section):
    root: NonBlank = Field(
        default_factory=default_root,
        description="Object-store root URL: file:///abs/path, s3://bucket/prefix, or any fsspec "
        "URL. Defaults to ./stoker-data (or $STOKER_ROOT).",
        json_schema_extra={"fix": "use file:///abs/path or s3://bucket/prefix"},
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options (e.g. {'endpoint_url': ...} for S3). Never "
        "credentials: they come from the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
        "or AWS_PROFILE), and a config holding any is refused.",
    )

    credentials_block: str | None = Field(
        None,
        description="Name of a Prefect block holding the S3 credentials of the store and of S3 "
        "sources: a Secret block whose value is a JSON object with aws_access_key_id and "
        "aws_secret_access_key (and aws_session_token), e.g. 'stoker-s3', or an AwsCredentials "
        "block of prefect-aws as 'aws-credentials/NAME'. Loaded on the host that runs the flow; "
        "the ranks and evaluations get them as AWS_* variables. Empty: the environment or "
        "AWS_PROFILE.",
        json_schema_extra={
            "fix": "give a block name such as 'stoker-s3' or 'aws-credentials/stoker-s3', or leave it empty"
        },
    )

    @field_validator("storage_options")
    @classmethod
    def _without_credentials(cls, options: dict[str, Any]) -> dict[str, Any]:
        return _no_credentials(options)

    @field_validator("credentials_block")
    @classmethod
    def _block_name(cls, name: str | None) -> str | None:
        if name is not None and not name.strip():
            return None
        if name is not None and not _BLOCK_NAME.match(name.strip()):
            raise _rule(
                "is not a Prefect block name",
                "give NAME (a Secret block) or BLOCK-TYPE/NAME, e.g. 'aws-credentials/stoker-s3'",
            )
        return name.strip() if name else None

    @field_validator("root")
    @classmethod
    def _absolute(cls, root: str) -> str:
        if "://" not in root and not os.path.isabs(root):  # a string test, no filesystem access
            raise _rule(
                "is relative", "give an absolute path or a URL such as file:///data/stoker or s3://bucket/prefix"
            )
        problem = _url_problem(root, "the root")
        if problem is not None:
            raise problem
        if root.startswith("file://") and not root[len("file://") :].startswith("/"):
            raise _rule("is a relative file:// URL", "write file:///absolute/path (three slashes)")
        return root
