"""Prefect API calls made while the ranks train, made best-effort and off the stream loop.

The launcher's stream loop reads every rank's line and feeds the watchdog; it must never
wait for the Prefect server. A progress bar or a checkpoint table is only worth its newest
value, so each is kept under a key: the newest call per key waits in a small bounded map and
one worker thread makes it. While the server is away (an outage of minutes, a restart) a
failed call is kept and tried again every `retry_seconds`; a newer value for its key replaces
it, so what the UI missed is caught up with one call per key when the server returns. Logs
need nothing of this: Prefect's APILogHandler already queues them for a worker of its own.

Each call runs in a copy of the caller's context (made when it is queued), so an artifact is
still linked to the task run and flow run that made it.

The thread never outlives its use: once close() has given up, or the main thread has ended
(the interpreter is shutting down), no further call is started.

The artifacts go straight to the REST API (`create_artifact`, `update_artifact`). Prefect's
own helpers emit a client-side ``prefect.artifact.*`` event after the call, and that waits
on Prefect's events worker: after a server outage it was seen to hang for minutes, holding
back every newer value (the progress bar stuck at 12% at the end of a run) and, at exit,
printing tracebacks. The UI reads the artifact, not its event.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import OrderedDict
from typing import Callable

from stoker.failures import describe

MAX_PENDING = 32  # keys; more than this and the oldest is dropped (never reached by stoker's few)
RETRY_SECONDS = 5.0
# what close() waits, at most, for the last values (the 100% and the final checkpoint table) to
# go out: longer than a Prefect server takes to come back (30-45 s on 2 cores)
FLUSH_SECONDS = 120.0
CLOSE_RETRY_SECONDS = 1.0  # while closing, a failed call is tried again this often
THREAD_NAME = "stoker-prefect-publisher"


def _exiting() -> bool:
    return not threading.main_thread().is_alive()


def _artifact_api(method: str, path: str, body: dict) -> dict:
    from prefect.client.orchestration import get_client

    response = get_client(sync_client=True).request(method, path, json=body)
    response.raise_for_status()
    return response.json() if response.content else {}


def create_artifact(kind: str, key: str, description: str, data) -> str:
    """A `kind` ('progress', 'table') artifact of the task run and flow run this runs in
    (the caller's context, as `latest` keeps it); its id. No event is emitted."""
    import json
    import math

    from prefect.utilities.context import get_task_and_flow_run_ids

    if kind == "table":  # as Prefect's TableArtifact: JSON, a non-finite number as null
        data = json.dumps(
            [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()} for row in data]
        )
    task_run_id, flow_run_id = get_task_and_flow_run_ids()
    body = {"type": kind, "key": key, "description": description, "data": data}
    body.update({k: str(v) for k, v in (("task_run_id", task_run_id), ("flow_run_id", flow_run_id)) if v})
    return _artifact_api("POST", "/artifacts/", body)["id"]


def update_artifact(artifact_id: str, data) -> None:
    """Replace an artifact's data (a progress artifact's percentage). No event is emitted."""
    _artifact_api("PATCH", f"/artifacts/{artifact_id}", {"data": data})


class BestEffortPublisher:
    """Newest call per key, made on a thread of its own; never raises into the caller."""

    def __init__(self, logger, retry_seconds: float = RETRY_SECONDS, max_pending: int = MAX_PENDING):
        self.logger, self.retry_seconds, self.max_pending = logger, retry_seconds, max_pending
        self._pending: OrderedDict[str, tuple[Callable[[], object], contextvars.Context]] = OrderedDict()
        self._cond = threading.Condition()
        self._closing = False
        self._flushing = False  # close() is waiting for the last values
        self._abandoned = False  # close() gave up: no call is started any more
        self._busy: str | None = None  # the key of the call in flight
        self.failures = 0  # calls that failed (and were kept to try again)
        self._outage_since: float | None = None
        self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def latest(self, key: str, call: Callable[[], object]) -> None:
        """Make `call` soon, unless a newer call for `key` comes first. Returns at once."""
        ctx = contextvars.copy_context()
        with self._cond:
            self._pending.pop(key, None)
            self._pending[key] = (call, ctx)
            while len(self._pending) > self.max_pending:  # bounded: the oldest key gives way
                self._pending.popitem(last=False)
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending or self._abandoned or _exiting():
                    return
                key, (call, ctx) = self._pending.popitem(last=False)
                self._busy = key
            ok = self._try(key, call, ctx)
            with self._cond:
                self._busy = None
                if not ok:
                    self._pending.setdefault(key, (call, ctx))  # unless a newer value came
                    self._pending.move_to_end(key, last=False)
                    self._cond.notify_all()
                    if not self._closing:
                        wait = min(self.retry_seconds, CLOSE_RETRY_SECONDS) if self._flushing else self.retry_seconds
                        self._cond.wait(wait)
                    elif self._pending:
                        return  # closing with the server away: close() says what was left
                else:
                    self._cond.notify_all()

    def _try(self, key: str, call: Callable[[], object], ctx: contextvars.Context) -> bool:
        try:
            ctx.run(call)
        except Exception as err:  # the server is away or refused: the run goes on regardless
            self.failures += 1
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                self.logger.warning(
                    "Prefect API call for %s failed (%s); training goes on, and the "
                    "UI is brought up to date when the server answers again",
                    key,
                    describe(err),
                )
            return False
        if self._outage_since is not None:
            self.logger.info(
                "Prefect API answers again after %.0fs; the UI is brought up to date",
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None
        return True

    def close(self, timeout: float = FLUSH_SECONDS) -> list[str]:
        """Send what is pending (up to `timeout`, trying a failed call again every
        CLOSE_RETRY_SECONDS), stop the thread; the keys left unsent, named in the log."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing = True
            self._cond.notify_all()  # a worker waiting to retry tries at once
            if self._outage_since is not None and (self._pending or self._busy):
                self.logger.warning(
                    "Prefect API away: waiting up to %.0fs for it to take the run's last values (%s)",
                    timeout,
                    ", ".join(([self._busy] if self._busy else []) + [k for k in self._pending if k != self._busy]),
                )
            while (self._pending or self._busy) and time.monotonic() < deadline:
                self._cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        with self._cond:
            self._abandoned = True  # a call still in flight is the last one made
            left = ([self._busy] if self._busy else []) + [k for k in self._pending if k != self._busy]
        if left:
            self.logger.warning(
                "Prefect API still unreachable after %.0fs: gave up; not sent to the UI: %s", timeout, ", ".join(left)
            )
        return left
