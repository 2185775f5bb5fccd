"""The run's Prefect events, built from the ranks' records and sent off the stream loop.

Four events, each about a resource that names the run (Prefect's resource-id form):

- ``stoker.checkpoint.committed`` about ``stoker.checkpoint.<run>.<step>`` (labels: the run,
  the step, the checkpoint URI, the commit manifest's sha256, the flow run and deployment);
  the evaluate-checkpoint automation that ``stoker deploy`` creates runs on it;
- ``stoker.run.step`` about ``stoker.run.<run>``: heartbeats, at most one per
  ``events.step_interval_seconds`` (step, last loss, recent median step seconds); the
  per-launch stalled-run automation expects them;
- ``stoker.run.stalled`` when stoker's own hang watchdog killed the gang;
- ``stoker.run.failed`` with the launch's classified end (reason, transient, attempt), and,
  for a flow run that failed anywhere else (the data stage, the tokenizer, the resume search,
  a refused lease), from the pipeline's on_failure hook (``orchestration.prefect_events``): once per
  failure.

Every event relates the run (``stoker.run.<run>``), and the flow run and deployment in
Prefect's own form (``prefect.flow-run.<id>``, ``prefect.deployment.<id>``), so an
automation's flow-run action finds the flow run from the event alone.

This module is plain Python (no Prefect): the function that emits one event is given
(``orchestration.prefect_events`` gives ``prefect.events.emit_event``). The stream loop only puts a
small record on a bounded queue (``EventSender.call``); one thread of its own makes the calls
(Prefect's own EventsWorker then sends them over its websocket). A full queue drops the event
and counts it; a failing call is logged once and counted; nothing here ever raises into the
caller or waits for the server.
"""

from __future__ import annotations

import contextvars
import queue
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from stoker.contracts import events
from stoker.failures import describe

CHECKPOINT_COMMITTED = "stoker.checkpoint.committed"
RUN_STEP = "stoker.run.step"
RUN_STALLED = "stoker.run.stalled"
RUN_FAILED = "stoker.run.failed"

# labels the automations read (and templates name): keep them stable
RUN_LABEL = "stoker.run.name"
FLOW_RUN_LABEL = "stoker.flow-run.id"
URI_LABEL = "stoker.checkpoint.uri"
MANIFEST_LABEL = "stoker.checkpoint.manifest-sha256"
EVALUATED_IN_RUN_LABEL = "stoker.eval.in-run"  # "true": the run evaluates it itself

MAX_PENDING = 256  # calls waiting for the sender thread; more are dropped (and counted)
RECENT_STEPS = 20  # step times the median is taken over


def run_resource_id(run: str) -> str:
    return f"stoker.run.{run}"


def checkpoint_resource_id(run: str, step: int) -> str:
    return f"stoker.checkpoint.{run}.{step}"


@dataclass(frozen=True)
class RunContext:
    """Who emits: the stoker run, and the Prefect flow run and deployment it runs in (None
    outside a flow run, or for a run started without a deployment)."""

    run: str
    flow_run_id: str | None = None
    flow_run_name: str | None = None
    deployment_id: str | None = None
    deployment_name: str | None = None
    attempt: int = 1

    def labels(self) -> dict[str, str]:
        out = {RUN_LABEL: self.run, "stoker.attempt": str(self.attempt)}
        if self.flow_run_id:
            out[FLOW_RUN_LABEL] = self.flow_run_id
        if self.deployment_id:
            out["stoker.deployment.id"] = self.deployment_id
        if self.deployment_name:
            out["stoker.deployment.name"] = self.deployment_name
        return out

    def run_resource(self) -> dict[str, str]:
        return {"prefect.resource.id": run_resource_id(self.run), "prefect.resource.name": self.run, **self.labels()}

    def related(self, with_run: bool = True) -> list[dict[str, str]]:
        out = []
        if with_run:
            out.append({"prefect.resource.id": run_resource_id(self.run), "prefect.resource.role": "stoker-run"})
        for kind, role, ident, name in (
            ("flow-run", "flow-run", self.flow_run_id, self.flow_run_name),
            ("deployment", "deployment", self.deployment_id, self.deployment_name),
        ):
            if ident:  # Prefect's own resource ids, so the UI links them
                resource = {"prefect.resource.id": f"prefect.{kind}.{ident}", "prefect.resource.role": role}
                if name:
                    resource["prefect.resource.name"] = name
                out.append(resource)
        return out


@dataclass(frozen=True)
class EventSpec:
    """One event, as ``prefect.events.emit_event`` takes it."""

    event: str
    resource: dict[str, str]
    related: list[dict[str, str]]
    payload: dict

    def kwargs(self) -> dict:
        return {"event": self.event, "resource": self.resource, "related": self.related, "payload": self.payload}


def checkpoint_committed(
    ctx: RunContext, e: events.CheckpointCommitted, manifest_sha256: str | None, evaluated_in_run: bool
) -> EventSpec:
    resource = {
        "prefect.resource.id": checkpoint_resource_id(ctx.run, e.step),
        "prefect.resource.name": f"{ctx.run} step {e.step}",
        **ctx.labels(),
        "stoker.checkpoint.step": str(e.step),
        URI_LABEL: e.uri,
        "stoker.checkpoint.key": e.key,
        EVALUATED_IN_RUN_LABEL: "true" if evaluated_in_run else "false",
    }
    if manifest_sha256:
        resource[MANIFEST_LABEL] = manifest_sha256
    payload = {
        "step": e.step,
        "uri": e.uri,
        "bytes": e.bytes,
        "stage_seconds": e.stage_seconds,
        "upload_seconds": e.upload_seconds,
        "commit_seconds": e.commit_seconds,
    }
    return EventSpec(CHECKPOINT_COMMITTED, resource, ctx.related(), payload)


def step_heartbeat(ctx: RunContext, step: int, loss: float | None, step_seconds: float | None) -> EventSpec:
    payload = {"step": step, "loss": loss, "step_seconds": step_seconds}
    return EventSpec(RUN_STEP, ctx.run_resource(), ctx.related(with_run=False), payload)


def stalled(ctx: RunContext, last_step: int | None, seconds: float, message: str) -> EventSpec:
    payload = {"last_step": last_step, "seconds_without_step": seconds, "message": message}
    return EventSpec(RUN_STALLED, ctx.run_resource(), ctx.related(with_run=False), payload)


def failed(ctx: RunContext, reason: str, transient: bool, message: str, last_step: int | None) -> EventSpec:
    resource = {
        **ctx.run_resource(),
        "stoker.failure.reason": reason,
        "stoker.failure.transient": str(transient).lower(),
    }
    payload = {"reason": reason, "transient": transient, "message": message[:2000], "last_step": last_step}
    return EventSpec(RUN_FAILED, resource, ctx.related(with_run=False), payload)


class EventSender:
    """Makes calls (an event's emission, an automation's creation) in order on one thread of
    its own, each in a copy of the caller's context (so Prefect relates the event to the task
    run that made it). ``call`` never waits and never raises."""

    def __init__(self, logger, max_pending: int = MAX_PENDING):
        self.logger = logger
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.dropped = 0  # calls not made: the queue was full
        self.failures = 0  # calls that raised
        self.sent = 0
        self._warned = False
        self._thread = threading.Thread(target=self._work, name="stoker-prefect-events", daemon=True)
        self._thread.start()

    def call(self, what: str, fn: Callable[[], object]) -> bool:
        """Queue `fn` (named `what` in a warning); False when it was dropped."""
        try:
            self._queue.put_nowait((what, fn, contextvars.copy_context()))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            what, fn, ctx = item
            try:
                ctx.run(fn)
                self.sent += 1
            except BaseException as err:  # noqa: BLE001 (an event is never worth a training run)
                self.failures += 1
                if not self._warned:
                    self._warned = True
                    self.logger.warning("Prefect event %s not sent (%s); training goes on", what, describe(err))
            finally:
                self._queue.task_done()

    def close(self, timeout: float = 10.0) -> bool:
        """Make what is queued (for `timeout` at most), then stop; True when all was made."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        drained = not self._queue.unfinished_tasks
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the daemon thread is left behind, stuck on a call that does not return
        return drained


class RunEvents:
    """The Prefect events of one launch, fed the launcher's records (the TrainingMonitor's
    sink). `emit(**kwargs)` sends one event (``prefect.events.emit_event``'s arguments);
    `manifest_sha256(key)` reads a committed checkpoint's manifest hash (called on the sender
    thread, never on the stream loop); `on_step_time(median)` is told once, the first time the
    recent step time is known (the launch creates its stalled-run automation then)."""

    def __init__(
        self,
        ctx: RunContext,
        emit: Callable[..., object],
        sender: EventSender,
        step_interval_seconds: float,
        evaluated_in_run: Callable[[int], bool] = lambda step: False,
        manifest_sha256: Callable[[str], str | None] | None = None,
        on_step_time: Callable[[float], None] | None = None,
        steps_before_step_time: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ctx, self.emit, self.sender = ctx, emit, sender
        self.step_interval_seconds = step_interval_seconds
        self.evaluated_in_run, self.manifest_sha256 = evaluated_in_run, manifest_sha256
        self.on_step_time, self.steps_before_step_time = on_step_time, steps_before_step_time
        self.clock = clock
        self.last_beat: float | None = None
        self.last_step: int | None = None
        self.last_loss: float | None = None
        self.step_seconds: deque[float] = deque(maxlen=RECENT_STEPS)
        self.heartbeats = 0

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.Step):
            self.step(event.step)
        elif isinstance(event, events.Train):
            self.last_loss = event.loss
            self.step_seconds.append(event.step_seconds)
            if self.on_step_time is not None and len(self.step_seconds) >= self.steps_before_step_time:
                tell, self.on_step_time = self.on_step_time, None
                tell(self.median_step_seconds())
            self.step(event.step)
        elif isinstance(event, events.CheckpointCommitted):
            self.checkpoint(event)

    def median_step_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    def step(self, step: int) -> None:
        """A finished step: a heartbeat if none went out in the last step_interval_seconds."""
        self.last_step = step
        now = self.clock()
        if self.last_beat is not None and now - self.last_beat < self.step_interval_seconds:
            return
        self.last_beat = now
        self.heartbeats += 1
        loss, seconds = self.last_loss, self.median_step_seconds()
        self._send(RUN_STEP, lambda: step_heartbeat(self.ctx, step, loss, seconds))

    def heartbeat_now(self) -> EventSpec | None:
        """A heartbeat of the last step seen, whatever the rate bound (None before any step):
        what opens the stalled-run trigger's window as soon as its automation exists, even
        when the ranks stopped before it did."""
        if self.last_step is None:
            return None
        return step_heartbeat(self.ctx, self.last_step, self.last_loss, self.median_step_seconds())

    def checkpoint(self, e: events.CheckpointCommitted) -> None:
        in_run = self.evaluated_in_run(e.step)

        def send() -> None:
            digest = None
            if self.manifest_sha256 is not None:
                try:
                    digest = self.manifest_sha256(e.key)
                except Exception:  # the event goes out without it
                    digest = None
            self.emit(**checkpoint_committed(self.ctx, e, digest, in_run).kwargs())

        self.sender.call(CHECKPOINT_COMMITTED, send)

    def stalled(self, seconds: float, message: str) -> None:
        last = self.last_step
        self._send(RUN_STALLED, lambda: stalled(self.ctx, last, seconds, message))

    def failed(self, reason: str, transient: bool, message: str) -> None:
        last = self.last_step
        self._send(RUN_FAILED, lambda: failed(self.ctx, reason, transient, message, last))

    def _send(self, name: str, build: Callable[[], EventSpec]) -> None:
        """The event is built on the sender thread too (its context may be completed there)."""
        self.sender.call(name, lambda: self.emit(**build().kwargs()))
