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
        from stoker.core.failures import StokerError

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

        from stoker.core.failures import StokerError, error_line

        try:
            return fn(*args, **kwargs)
        except StokerError as err:
            return Failed(message=error_line(err), data=err)

    return wrapper


def results_of(futures: list) -> list:
    """The results of submitted task runs, in order, once every one has ended: the first
    failure is raised only then, so no task of the flow is left running when it fails."""
    from prefect.futures import wait

    wait(futures)
    return [f.result() for f in futures]


def tag_flow_run(*tags: str) -> None:
    """Add tags to the current flow run (a run started from a deployment or a notebook gets
    its stoker tags alike, so the UI can filter a run's flow runs)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run.id)
        merged = sorted(set(current.tags or []) | set(tags))
        if merged != sorted(current.tags or []):
            client.update_flow_run(flow_run.id, tags=merged)


def flow_runs_tagged(tag: str) -> int:
    """How many flow runs carry this tag (0 when the server cannot say)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    try:
        with get_client(sync_client=True) as client:
            return client.count_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
    except Exception:  # a name is not worth failing a run for
        return 0


# ---- flow runs whose process died (a notebook kernel restarted, a SIGKILL) ---------------
# Prefect marks such a run Crashed only when a runner or worker watched its process; a flow
# called in a notebook or a Python script has no one watching, and stays Running forever.
# So each stoker flow run carries its owner (host, pid, process start time) as tags, and
# the next stoker flow started on that host marks the runs of dead owners Crashed.
OWNER_HOST_TAG = "stoker-host:"
OWNER_PID_TAG = "stoker-pid:"


def _process_start(pid: int) -> str | None:
    """The process's start time (clock ticks after boot; tells a reused pid apart), '' where
    /proc is not there, None when the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
            return ""
        except ProcessLookupError:
            return None
        except PermissionError:
            return ""


def owner_tags() -> list[str]:
    import socket

    return [OWNER_HOST_TAG + socket.gethostname(), f"{OWNER_PID_TAG}{os.getpid()}:{_process_start(os.getpid()) or ''}"]


def _owner_alive(tags: list[str]) -> bool:
    owner = next((t[len(OWNER_PID_TAG) :] for t in tags if t.startswith(OWNER_PID_TAG)), None)
    if owner is None:
        return True  # not ours to judge
    pid, _, started = owner.partition(":")
    now = _process_start(int(pid))
    return now is not None and (not started or not now or now == started)


def sweep_dead_flow_runs(client, keep: object = None) -> list[str]:
    """Mark Crashed every Running or Pending flow run that a stoker process on this host
    started and whose process is gone; returns their names. `keep`: the current run's id."""
    import socket

    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[OWNER_HOST_TAG + socket.gethostname()]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])),
        )
    )
    swept = []
    for run in runs:
        if str(run.id) == str(keep) or _owner_alive(run.tags or []):
            continue
        client.set_flow_run_state(
            run.id,
            Crashed(
                message=(
                    "stoker: the process that ran this flow run ended without reporting (a notebook kernel "
                    "restarted, the process was killed); found by the next stoker flow on this host"
                )
            ),
            force=True,
        )
        swept.append(run.name)
    return swept


def claim_flow_run() -> None:
    """Tag the current flow run with its owner process, and mark Crashed the runs of owners on
    this host that died. Best-effort: the server being away never stops a run here."""
    import logging

    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    log = logging.getLogger("stoker.flows")
    try:
        tag_flow_run(*owner_tags())
        with get_client(sync_client=True) as client:
            for name in sweep_dead_flow_runs(client, keep=flow_run.id):
                log.warning("flow run %r was left Running by a process that is gone; marked Crashed", name)
    except Exception as err:  # bookkeeping of other runs never fails this one
        log.warning("could not check for flow runs left Running by dead processes: %s", err)
