"""The bookkeeping of stoker's flow runs on the Prefect server: their tags (the run, the recipe,
the launcher, the owner process), how many flow runs a run has had, the results of submitted
task runs, and the runs left Running by a dead process (marked Crashed by the next flow on
their host)."""

from __future__ import annotations

import os

from stoker.process import lifeline


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
    """The process's start time (clock ticks after boot; tells a reused pid apart: process.lifeline),
    '' where /proc is not there, None when the process is gone or a zombie."""
    if os.path.isdir("/proc/self"):
        started = lifeline.process_start(pid)
        return None if started is None else str(started)
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
