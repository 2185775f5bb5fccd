"""Prefect's side of the run's events (``observe.prefect_events`` builds them): the emitter,
the per-launch stalled-run automation, the evaluate-checkpoint automation that
``stoker deploy`` keeps, and the pipeline's on_failure hook (``flow_run_failed``: the
``stoker.run.failed`` of a flow run that failed outside a launch; a launch's failure, already
sent by its LaunchEvents, is not sent twice).

``prefect.events.emit_event`` (Prefect 3.8.8) validates the event and puts it on the
EventsWorker's queue (``put_nowait``; unbounded unless PREFECT_EVENTS_WORKER_MAX_QUEUE_SIZE),
and the worker sends it from Prefect's global event loop. It can still wait: its first call
starts the worker on that loop (and, with no PREFECT_API_URL, an ephemeral server), and it
raises EventTooLarge. So stoker calls it only from its own sender thread
(``observe.prefect_events.EventSender``), and catches everything.

Hung vs slow. Each launch, once its recent step time is known, creates an automation with a
proactive trigger: after a ``stoker.run.step`` of this run, flow run and attempt, expect the
next within the stall window (``events.stall_*``); when none comes, the automation marks the
flow run Running/"Stalled" (or cancels it, ``events.stall_action``). The trigger's bucket is
removed when it fires and a new one opens at the next heartbeat, so a stall is marked once and
a run that steps again is watched again. With 'mark', a second automation takes the mark back:
after the flow run's ``prefect.flow-run.Stalled`` event, the run's next heartbeat sets it
Running; and a launch that starts stepping in a flow run still marked Stalled (by its failed
predecessor) sets it Running itself. The launch deletes its automations on every exit path;
those left by a launcher that was killed are deleted by the next launch of the run.
"""

from __future__ import annotations

import hashlib
import threading
from datetime import timedelta

from stoker.config import RunConfig
from stoker.failures import StokerError, TrainingFailed, describe, is_transient
from stoker.observe import prefect_events as pe
from stoker.storage.checkpoints import COMMIT_FILE
from stoker.storage.store import Store, join

STALL_AUTOMATION_PREFIX = "stoker-stalled:"
STALLED_STATE_NAME = "Stalled"
RESUMED_SUFFIX = ":resumed"  # the name of the automation that takes a Stalled mark back
EVALUATE_AUTOMATION = "stoker-evaluate-committed-checkpoints"
EVALUATE_DEPLOYMENT = "evaluate-checkpoint/evaluate-checkpoint"
CLOSE_SECONDS = 5.0
REPEAT_SECONDS = (
    3.0,
)  # after the automation's first heartbeat, while no step follows  # what a launch's end waits, at most, for its last events to be handed over


def emit(**kwargs) -> None:
    """``prefect.events.emit_event``; raises what it raises (the sender thread catches it)."""
    from prefect.events import emit_event

    emit_event(**kwargs)


def run_context(run: str, attempt: int) -> pe.RunContext:
    """The flow run and deployment this launch runs in (no API call: the run context)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    flow_run = ctx.flow_run if ctx is not None else None
    if flow_run is None:
        return pe.RunContext(run=run, attempt=attempt)
    deployment_id = str(flow_run.deployment_id) if flow_run.deployment_id else None
    return pe.RunContext(
        run=run,
        flow_run_id=str(flow_run.id),
        flow_run_name=flow_run.name,
        deployment_id=deployment_id,
        attempt=attempt,
    )


def manifest_reader(store: Store):
    """sha256 of a committed checkpoint's commit manifest (read on the sender thread)."""

    def read(key: str) -> str:
        return hashlib.sha256(store.read_bytes(join(key, COMMIT_FILE))).hexdigest()

    return read


def stall_window_seconds(config: RunConfig, median_step_seconds: float) -> float:
    ev = config.events
    return max(ev.stall_min_seconds, ev.stall_factor * median_step_seconds) + ev.step_interval_seconds


def stall_automation_name(ctx: pe.RunContext) -> str:
    return f"{STALL_AUTOMATION_PREFIX}{ctx.run}:{ctx.flow_run_id}:{ctx.attempt}"


def resume_automation(ctx: pe.RunContext):
    """The per-launch automation that takes the mark back (events.stall_action 'mark'): once
    its flow run entered Stalled, the next step heartbeat of the run sets it Running again.
    One trigger sees both events: the flow run's own state event (``prefect.flow-run.Stalled``,
    Prefect's, about ``prefect.flow-run.<id>``) opens it, the heartbeat (about
    ``stoker.run.<run>``, relating the flow run, whence the action's flow run) fires it; the
    firing closes it until the next Stalled."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    return AutomationCore(
        name=stall_automation_name(ctx) + RESUMED_SUFFIX,
        description=f"Marks flow run {ctx.flow_run_name or ctx.flow_run_id} Running again when its heartbeats "
        "resume after it was marked Stalled (created and deleted by its launch_training task).",
        trigger=EventTrigger(
            after={f"prefect.flow-run.{STALLED_STATE_NAME}"},
            expect={pe.RUN_STEP},
            match={"prefect.resource.id": [f"prefect.flow-run.{ctx.flow_run_id}", pe.run_resource_id(ctx.run)]},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),  # however long the stall lasted
        ),
        # not forced, as the mark: an ended flow run stays ended
        actions=[
            ChangeFlowRunState(
                state=StateType.RUNNING, message=f"stoker: training steps of run {ctx.run} are reported again"
            )
        ],
    )


def stall_automation(ctx: pe.RunContext, window_seconds: float, action: str):
    """The per-launch automation (an AutomationCore, not yet created)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    why = (
        f"stoker: no training step of run {ctx.run} reported for {window_seconds:.0f}s "
        "(events.stall_*): hung or very slow"
    )
    if action == "cancel":
        act = ChangeFlowRunState(state=StateType.CANCELLING, message=why + "; cancelled (events.stall_action)")
    else:
        # a Running state of its own name: the UI shows it, the run goes on. Not forced: a
        # flow run that has ended (its launcher killed before it removed this) stays ended
        act = ChangeFlowRunState(state=StateType.RUNNING, name=STALLED_STATE_NAME, message=why)
    return AutomationCore(
        name=stall_automation_name(ctx),
        description=f"Marks flow run {ctx.flow_run_name or ctx.flow_run_id} stalled when its heartbeats stop "
        "(created and deleted by its launch_training task).",
        trigger=EventTrigger(
            after={pe.RUN_STEP},
            expect={pe.RUN_STEP},
            match={
                "prefect.resource.id": pe.run_resource_id(ctx.run),
                pe.FLOW_RUN_LABEL: ctx.flow_run_id,
                "stoker.attempt": str(ctx.attempt),
            },
            # per resource (one here, by the match): buckets open only at a heartbeat, which the
            # firing then names (the flow run comes from it); without for_each a proactive
            # trigger keeps an empty bucket from its start, and fires with no event to act on
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=window_seconds),
        ),
        actions=[act],
    )


class StallWatch:
    """The per-launch automations (the mark, and with 'mark' the one that takes it back):
    `create` (on the sender thread) and `delete` (at the end)."""

    def __init__(self, ctx: pe.RunContext, logger):
        self.ctx, self.logger = ctx, logger
        self.automation_ids: list = []
        self.window_seconds: float | None = None

    def create(self, window_seconds: float, action: str) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            for old in client.read_automations():  # left by a killed launch of this run
                if old.name.startswith(f"{STALL_AUTOMATION_PREFIX}{self.ctx.run}:"):
                    client.delete_automation(old.id)
            self.automation_ids.append(client.create_automation(stall_automation(self.ctx, window_seconds, action)))
            if action != "cancel":
                self.automation_ids.append(client.create_automation(resume_automation(self.ctx)))
                self._unmark(client)
        self.window_seconds = window_seconds
        self.logger.info(
            "stalled-run automation %s: the flow run is %s when no step is reported for %.0fs",
            stall_automation_name(self.ctx),
            "cancelled" if action == "cancel" else f"marked {STALLED_STATE_NAME!r} (Running again at the next step)",
            window_seconds,
        )

    def _unmark(self, client) -> None:
        """A Stalled mark an earlier launch of this flow run left (it failed while stalled and
        this retry steps): taken back now, since this launch's steps are known to go on."""
        from prefect.states import Running

        state = client.read_flow_run(self.ctx.flow_run_id).state
        if state is not None and state.is_running() and state.name == STALLED_STATE_NAME:
            client.set_flow_run_state(
                self.ctx.flow_run_id,
                Running(message=f"stoker: launch {self.ctx.attempt} of run {self.ctx.run} is stepping"),
            )

    def delete(self) -> None:
        from prefect.client.orchestration import get_client

        if not self.automation_ids:
            return
        with get_client(sync_client=True) as client:
            while self.automation_ids:
                client.delete_automation(self.automation_ids.pop())


class LaunchEvents:
    """The events of one launch attempt and its stalled-run automation. `sink` goes to the
    TrainingMonitor; `ended(exc)` on every exit path (None: completed)."""

    def __init__(self, config: RunConfig, attempt: int, store: Store, logger):
        self.config, self.logger = config, logger
        self.ctx = run_context(config.resolved_run_name(), attempt)
        self.sender = pe.EventSender(logger)
        self.watch = StallWatch(self.ctx, logger)
        max_steps = config.train.max_steps
        self.events = pe.RunEvents(
            self.ctx,
            emit,
            self.sender,
            config.events.step_interval_seconds,
            # the flow evaluates the last checkpoint itself; the others when per_checkpoint_enabled
            evaluated_in_run=lambda step: config.eval.per_checkpoint_enabled or step >= max_steps,
            manifest_sha256=manifest_reader(store),
            on_step_time=self._step_time_known if self.ctx.flow_run_id else None,
        )
        if self.ctx.deployment_id:  # its name is an API call: made on the sender thread, first
            self.sender.call("deployment name", self._name_deployment)

    def sink(self, event) -> None:
        self.events(event)

    def _name_deployment(self) -> None:
        from dataclasses import replace

        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            deployment = client.read_deployment(self.ctx.deployment_id)
            flow = client.read_flow(deployment.flow_id)
        self.ctx = replace(self.ctx, deployment_name=f"{flow.name}/{deployment.name}")
        self.events.ctx = self.watch.ctx = self.ctx

    def _step_time_known(self, median: float) -> None:
        window = stall_window_seconds(self.config, median)
        self.sender.call("stalled-run automation", lambda: self._watch(window))

    def _watch(self, window: float) -> None:
        """On the sender thread: create the automation, then send a heartbeat at once. The
        trigger's window opens at the first heartbeat the server's trigger service sees after it
        has loaded the automation: without this one, ranks that stopped while it was being
        created would never be marked. The server may take that heartbeat before it has loaded
        the automation (a busy SQLite server did, in tests), so while no step follows, the
        same heartbeat is repeated REPEAT_SECONDS later (the stall is then seen that late)."""
        self.watch.create(window, self.config.events.stall_action)
        self._beat_again(self.events.heartbeats, REPEAT_SECONDS)

    def _beat_again(self, heartbeats: int, later: tuple[float, ...]) -> None:
        if self.events.heartbeats != heartbeats:
            return  # steps go on: their own heartbeats open the window
        beat = self.events.heartbeat_now()
        if beat is not None:
            emit(**beat.kwargs())
        if later:
            timer = threading.Timer(
                later[0], lambda: self.sender.call("heartbeat", lambda: self._beat_again(heartbeats, later[1:]))
            )
            timer.daemon = True
            timer.start()

    def ended(self, exc: BaseException | None, timeout: float = CLOSE_SECONDS) -> None:
        """Say how the launch failed (if it did), remove the automation, hand over what is left
        (for `timeout` at most; an automation left behind is removed by the run's next launch)."""
        if isinstance(exc, TrainingFailed) and exc.reason == "hang":
            self.events.stalled(self.config.launch.hang_timeout_seconds, str(exc).split("\n", 1)[0])
        if isinstance(exc, Exception):
            self.events.failed(*classified(exc))
            mark_failure_sent(exc)  # the flow run's failure hook sends no second one for it
        self.sender.call("stalled-run automation removal", self.watch.delete)
        if not self.sender.close(timeout):
            self.logger.warning("Prefect events: the last events of the launch were not handed over in time")


def open_launch_events(config: RunConfig, attempt: int, store: Store, logger) -> LaunchEvents | None:
    return LaunchEvents(config, attempt, store, logger) if config.events.enabled else None


# ---- stoker.run.failed of the flow run (its on_failure hook) ------------------------------------
FAILURE_SENT = "_stoker_run_failed_sent"  # on an exception whose stoker.run.failed went out


def classified(exc: BaseException) -> tuple[str, bool, str]:
    """(reason, transient, message) of a failure: a launch's own reason (error, lost-rank, hang,
    timeout...), else the exception's type; transient as failures.classify says. A project
    error's message is its own line (the flow run's state message); a bug's, its innermost cause."""
    if isinstance(exc, TrainingFailed):
        return exc.reason, exc.transient, str(exc)
    return type(exc).__name__, is_transient(exc), str(exc) if isinstance(exc, StokerError) else describe(exc)


def mark_failure_sent(exc: BaseException) -> None:
    try:
        setattr(exc, FAILURE_SENT, True)
    except Exception:  # an exception type without a __dict__: at worst, a second event
        pass


def _failure(state) -> BaseException | None:
    """The exception a failed state holds, if it can be had without the network."""
    if isinstance(state.data, BaseException):
        return state.data
    try:
        value = state.result(raise_on_failure=False)
    except Exception:
        return None
    return value if isinstance(value, BaseException) else None


def _run_of(flow_run) -> tuple[str, bool]:
    """(the stoker run's name, whether its events are on), from the flow run's config parameter;
    a config that does not validate still names its run_name (else the flow run's name)."""
    raw = (flow_run.parameters or {}).get("config")
    try:
        config = raw if isinstance(raw, RunConfig) else RunConfig.model_validate(raw or {})
        return config.resolved_run_name(), config.events.enabled
    except Exception:
        named = raw.get("run_name") if isinstance(raw, dict) else None
        return str(named or flow_run.name), True


def flow_run_failed(flow, flow_run, state) -> None:
    """train_pipeline's on_failure hook: ``stoker.run.failed`` with the classified reason, for
    any failure of the flow run (the data stage, the tokenizer, the resume search, a refused
    lease, a failed launch), once: a failure whose event a launch already sent (its exception
    is marked) is not sent again. Best-effort: never raises (Prefect would log it as an error)."""
    import logging

    try:
        exc = _failure(state)
        if exc is not None and getattr(exc, FAILURE_SENT, False):
            return
        run, enabled = _run_of(flow_run)
        if not enabled:
            return
        ctx = pe.RunContext(
            run=run,
            flow_run_id=str(flow_run.id),
            flow_run_name=flow_run.name,
            deployment_id=str(flow_run.deployment_id) if flow_run.deployment_id else None,
            attempt=flow_run.run_count or 1,
        )
        reason, transient, message = classified(exc) if exc is not None else ("error", False, state.message or "")
        emit(**pe.failed(ctx, reason, transient, message, None).kwargs())
        if exc is not None:
            mark_failure_sent(exc)
    except Exception as err:  # an event is never worth more than the failure it reports
        logging.getLogger("stoker.events").warning("Prefect event stoker.run.failed not sent (%s)", describe(err))


# ---- the evaluate-checkpoint automation (stoker deploy) ---------------------------------------
def evaluate_automation(deployment_id):
    """On each stoker.checkpoint.committed that the run does not evaluate itself (label
    stoker.eval.in-run "false": eval.per_checkpoint_enabled off, and not the last one), run the
    evaluate-checkpoint deployment on the event's checkpoint URI."""
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    return AutomationCore(
        name=EVALUATE_AUTOMATION,
        description="Evaluates every committed checkpoint that its run does not evaluate itself, "
        "with the evaluate-checkpoint deployment (created by stoker deploy).",
        trigger=EventTrigger(
            expect={pe.CHECKPOINT_COMMITTED},
            match={"prefect.resource.id": "stoker.checkpoint.*", pe.EVALUATED_IN_RUN_LABEL: "false"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            RunDeployment(
                source="selected",
                deployment_id=deployment_id,
                parameters={"checkpoint_uri": "{{ event.resource['" + pe.URI_LABEL + "'] }}"},
            )
        ],
    )


def ensure_evaluate_automation() -> str:
    """Create the evaluate-checkpoint automation, or update the one of that name; in words."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(EVALUATE_DEPLOYMENT)
        spec = evaluate_automation(deployment.id)
        found = client.read_automations_by_name(EVALUATE_AUTOMATION)
        for extra in found[1:]:  # one of the name
            client.delete_automation(extra.id)
        if found:
            client.update_automation(found[0].id, spec)
            return f"automation {EVALUATE_AUTOMATION!r}: already there (updated)"
        client.create_automation(spec)
        return f"automation {EVALUATE_AUTOMATION!r}: created"
