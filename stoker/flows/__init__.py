"""The flows: the DAG (pipeline), evaluating a checkpoint, the CLI.

However stoker is entered (the CLI, a notebook's ``from flows.pipeline import ...``, a
deployment's worker), this package is imported before Prefect is: it sets the settings that
keep Prefect quiet and offline (no telemetry), unless the user set them, and it keeps the
user's own mistakes to one line in the Prefect log. A project error (``StokerError``: a bad
config field, bad data, a failed training) is logged as its message, and the flow run fails
with the state message ``stoker: <the same line>``; a traceback is kept for bugs only. The
embedded Prefect server it may start ends with the process that started it
(``flows.server_lifeline``).
"""

from __future__ import annotations

import functools
import logging
import os

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LOG_PRINTS": "true",
}
for _key, _value in PREFECT_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

from stoker.flows import server_lifeline  # noqa: E402  (the embedded server ends with its starter)

server_lifeline.install()


class _ProjectErrorsWithoutTraceback(logging.Filter):
    """Drops the traceback of a record about a project error (the message stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from stoker.failures import StokerError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, StokerError):
            record.exc_info, record.exc_text = None, None
        return True


_FILTER = _ProjectErrorsWithoutTraceback()
for _name in ("prefect.task_runs", "prefect.flow_runs"):
    if _FILTER not in logging.getLogger(_name).filters:
        logging.getLogger(_name).addFilter(_FILTER)


def fails_in_one_line(fn):
    """For a flow function: a project error ends the flow run Failed with the message
    ``stoker: <error>`` (the line the CLI prints); calling the flow still raises the error."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from prefect.states import Failed

        from stoker.failures import StokerError, error_line

        try:
            return fn(*args, **kwargs)
        except StokerError as err:
            return Failed(message=error_line(err), data=err)

    return wrapper
