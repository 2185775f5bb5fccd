"""The run lease around a flow run: taken before any data is prepared or compute started,
renewed by a heartbeat thread of the flow's process, released on every end. The work lives in
stoker/storage/lease.py."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

from prefect import get_run_logger
from prefect.runtime import flow_run

from stoker.config import RunConfig
from stoker.storage.lease import RunLease, acquire_lease
from stoker.storage.store import Store
from stoker.tasks.policy import stoker_task

_HELD: dict[str, RunLease] = {}  # run name -> this process's lease (tasks share the process)
_ON_LOST: dict[str, list[Callable[[str], None]]] = {}
_LOCK = threading.Lock()


def take_lease(config: RunConfig, logger) -> RunLease:
    """Take (or re-take: the same flow run owns it) the run's lease, start its heartbeat and
    keep it for this process's tasks. LeaseHeld (permanent, one line) when another launch
    holds it."""
    run = config.resolved_run_name()
    flow_run_id = str(flow_run.id or "")
    lease = acquire_lease(
        Store.of(config.storage),
        run,
        flow_run_id=flow_run_id,
        ttl=config.launch.lease_seconds,
        takeover=config.launch.takeover,
    )
    with _LOCK:
        old = _HELD.pop(run, None)
        _HELD[run] = lease
        _ON_LOST.setdefault(run, [])
    if old is not None:
        old.stop_heartbeat()  # the re-take replaces it; its token is no longer in the store

    def lost(why: str) -> None:
        logger.error("run %s: %s; stopping this launch", run, why)
        for callback in list(_ON_LOST.get(run, [])):
            callback(why)

    lease.start_heartbeat(on_lost=lost, log=logger.warning)
    logger.info("run %s: lease taken (%s)", run, lease.record.describe())
    return lease


def held_lease(config: RunConfig, logger) -> RunLease:
    """This process's lease of the run, checked (LeaseLost when another launch took it); taken
    again when this process has none (a task retried in a new process, a call outside the flow)."""
    lease = _HELD.get(config.resolved_run_name())
    if lease is None or lease.lost:
        if lease is not None:
            lease.check()
        return take_lease(config, logger)
    return lease


@contextmanager
def on_lease_lost(config: RunConfig, callback: Callable[[str], None]):
    """Call `callback(why)` if the run's lease is lost while the block runs (stop the gang)."""
    callbacks = _ON_LOST.setdefault(config.resolved_run_name(), [])
    callbacks.append(callback)
    try:
        yield
    finally:
        callbacks.remove(callback)


def release_lease(config: RunConfig) -> None:
    """Stop the heartbeat and delete the lease if it is still ours (best effort: a lease left
    behind expires after launch.lease_seconds)."""
    run = config.resolved_run_name()
    with _LOCK:
        lease = _HELD.pop(run, None)
    if lease is not None:
        try:
            lease.release()
        except Exception as err:  # the store may be what failed; the lease expires anyway
            get_run_logger().warning(
                "run %s: the lease could not be released (%s); it expires in %ss", run, err, config.launch.lease_seconds
            )


@stoker_task(name="take_run_lease", retries=3)
def take_run_lease(config: RunConfig) -> str:
    """One writer per run: take the run's lease before any work, or fail (never retried)
    naming the launch that holds it and how to take over. Returns the lease's description.
    No task timeout (policy.stoker_task): a few store calls, each ended by the store client's
    own timeouts, and retried by this task."""
    return take_lease(config, get_run_logger()).record.describe()


@contextmanager
def run_lease(config: RunConfig):
    """Hold the run's lease for the block: taken first (a refusal stops the flow before any
    compute), released on every end."""
    take_run_lease(config)
    try:
        yield
    finally:
        release_lease(config)
