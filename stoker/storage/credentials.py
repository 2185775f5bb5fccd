"""Object-store credentials held in memory for this process, never written anywhere.

Credentials come from the environment or an AWS profile (s3fs and botocore find those
themselves), or from a Prefect block named in the config (``storage.credentials_block``),
which the flow's first task loads and hands to :func:`use`. From then on every ``Store`` and
source URL of this process opens S3 with them, and :func:`apply_to_env` gives the processes it
starts (ranks, evaluations) the standard ``AWS_*`` variables, as AWS tools expect. Nothing
here has a repr, str or pickle that shows a value.
"""

from __future__ import annotations

import threading

_ENV_NAMES = {
    "access_key_id": "AWS_ACCESS_KEY_ID",
    "secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "session_token": "AWS_SESSION_TOKEN",
}
S3_PROTOCOLS = ("s3://", "s3a://")


class StoreCredentials:
    """An AWS-style key pair (and session token); shows no value."""

    __slots__ = ("_values", "source")

    def __init__(self, access_key_id: str, secret_access_key: str, session_token: str | None = None, source: str = ""):
        self._values = {
            "access_key_id": access_key_id,
            "secret_access_key": secret_access_key,
            "session_token": session_token or None,
        }
        self.source = source  # where they came from, e.g. "Prefect block 'secret/s3-writer'"

    def __repr__(self) -> str:
        return f"StoreCredentials(from {self.source or 'code'}, values hidden)"

    __str__ = __repr__

    def __reduce__(self):  # never pickled into a result, a cache or a parameter
        raise TypeError("StoreCredentials are not serializable")

    def fsspec_options(self) -> dict[str, str]:
        out = {"key": self._values["access_key_id"], "secret": self._values["secret_access_key"]}
        if self._values["session_token"]:
            out["token"] = self._values["session_token"]
        return out

    def env(self) -> dict[str, str]:
        return {_ENV_NAMES[k]: v for k, v in self._values.items() if v}


_lock = threading.Lock()
_current: StoreCredentials | None = None


def use(credentials: StoreCredentials | None) -> None:
    """Open S3 with these from now on in this process (None: back to the environment)."""
    global _current
    with _lock:
        _current = credentials


def current() -> StoreCredentials | None:
    return _current


def options_for(url: str, options: dict) -> dict:
    """fsspec options for opening `url`: the given ones, plus the credentials in use when it
    is an S3 URL and the options name none."""
    creds = _current
    if creds is None or not url.startswith(S3_PROTOCOLS) or {"key", "secret", "anon"} & set(options):
        return options
    return {**options, **creds.fsspec_options()}


def apply_to_env(env: dict[str, str]) -> dict[str, str]:
    """A child process's environment with the credentials in use as AWS_* variables
    (replacing any inherited ones, which belong to another identity)."""
    creds = _current
    if creds is None:
        return env
    out = {k: v for k, v in env.items() if k not in _ENV_NAMES.values() and k != "AWS_PROFILE"}
    out.update(creds.env())
    return out
