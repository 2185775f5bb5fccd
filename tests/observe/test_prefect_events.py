"""The run's Prefect events: built from the ranks' records, heartbeats at a bounded rate, sent
off the caller's thread so that neither a failing nor a hanging emitter (nor a Prefect server
that is away) can hold up or fail the stream loop."""

import threading
import time

from stoker.contracts import events
from stoker.observe import prefect_events as pe


class Log:
    def __init__(self):
        self.warnings: list[str] = []

    def warning(self, msg, *args):
        self.warnings.append(msg % args)

    def info(self, msg, *args):
        pass


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


CTX = pe.RunContext(
    run="r1",
    flow_run_id="11111111-2222-3333-4444-555555555555",
    flow_run_name="r1",
    deployment_id="66666666-7777-8888-9999-000000000000",
    deployment_name="train-pipeline/train-adhoc",
    attempt=2,
)


def _collecting(step_interval: float = 10.0, **kw):
    sent: list[dict] = []
    sender = pe.EventSender(Log())
    clock = Clock()
    run = pe.RunEvents(CTX, lambda **e: sent.append(e), sender, step_interval, clock=clock, **kw)
    return run, sender, clock, sent


def test_heartbeats_go_out_at_most_once_per_interval_whatever_the_step_rate():
    run, sender, clock, sent = _collecting(step_interval=10.0)
    for step in range(1, 1001):  # 1000 steps of 0.1 s: 100 s
        clock.now = step * 0.1
        run(events.Step(step=step))
    assert sender.close(5)
    beats = [e for e in sent if e["event"] == pe.RUN_STEP]
    assert len(beats) == 10  # at 0.1 s, then every 10 s: 10.1, 20.1 ... 90.1
    assert [b["payload"]["step"] for b in beats] == [1, 101, 201, 301, 401, 501, 601, 701, 801, 901]
    # a slow run (one step per 30 s) beats at every step
    run, sender, clock, sent = _collecting(step_interval=10.0)
    for step in range(1, 5):
        clock.now = step * 30.0
        run(events.Step(step=step))
    assert sender.close(5)
    assert [e["payload"]["step"] for e in sent] == [1, 2, 3, 4]


def test_a_heartbeat_carries_the_step_the_last_loss_and_the_recent_median_step_time():
    told = []
    run, sender, clock, sent = _collecting(step_interval=1.0, on_step_time=told.append)
    for step, (loss, seconds) in enumerate([(5.0, 0.2), (4.0, 0.4), (3.0, 0.3), (2.5, 0.9)], start=1):
        clock.now = float(step * 2)
        run(events.Train(step=step, loss=loss, lr=1e-3, step_seconds=seconds, tokens_seen=step * 100))
    assert sender.close(5)
    assert told == [0.3]  # once, at the third report: median of 0.2, 0.4, 0.3
    last = sent[-1]
    assert last["event"] == pe.RUN_STEP
    assert last["payload"] == {"step": 4, "loss": 2.5, "step_seconds": 0.35}
    assert last["resource"]["prefect.resource.id"] == "stoker.run.r1"
    assert last["resource"][pe.FLOW_RUN_LABEL] == CTX.flow_run_id and last["resource"]["stoker.attempt"] == "2"
    related = {r["prefect.resource.id"]: r["prefect.resource.role"] for r in last["related"]}
    assert related == {
        f"prefect.flow-run.{CTX.flow_run_id}": "flow-run",
        f"prefect.deployment.{CTX.deployment_id}": "deployment",
    }


def test_a_committed_checkpoint_names_run_step_uri_manifest_flow_run_and_deployment():
    run, sender, clock, sent = _collecting(
        evaluated_in_run=lambda step: step >= 8, manifest_sha256=lambda key: "ab" * 32 if key.endswith("4") else None
    )
    for step in (4, 8):
        run(
            events.CheckpointCommitted(
                step=step,
                key=f"runs/r1/checkpoints/step-{step:08d}",
                uri=f"file:///s/runs/r1/checkpoints/step-{step:08d}",
                bytes=1000,
                stage_seconds=0.1,
                upload_seconds=0.2,
                commit_seconds=0.01,
            )
        )
    assert sender.close(5)
    first, last = sent
    assert first["event"] == pe.CHECKPOINT_COMMITTED
    res = first["resource"]
    assert res["prefect.resource.id"] == "stoker.checkpoint.r1.4"
    assert res[pe.URI_LABEL] == "file:///s/runs/r1/checkpoints/step-00000004"
    assert res[pe.MANIFEST_LABEL] == "ab" * 32 and res["stoker.checkpoint.step"] == "4"
    assert res[pe.RUN_LABEL] == "r1" and res["stoker.deployment.name"] == "train-pipeline/train-adhoc"
    assert res[pe.EVALUATED_IN_RUN_LABEL] == "false" and last["resource"][pe.EVALUATED_IN_RUN_LABEL] == "true"
    assert pe.MANIFEST_LABEL not in last["resource"]  # unknown: left out, not made up
    roles = {r["prefect.resource.role"]: r["prefect.resource.id"] for r in first["related"]}
    assert roles == {
        "stoker-run": "stoker.run.r1",
        "flow-run": f"prefect.flow-run.{CTX.flow_run_id}",
        "deployment": f"prefect.deployment.{CTX.deployment_id}",
    }
    assert first["payload"]["bytes"] == 1000


def test_failed_and_stalled_carry_the_classified_reason_and_the_last_step():
    run, sender, clock, sent = _collecting()
    run(events.Step(step=41))
    run.stalled(300, "training hung: no step finished for 300s")
    run.failed("hang", True, "training hung: no step finished for 300s (last step seen: step 41)")
    assert sender.close(5)
    stalled, failed = sent[1], sent[2]
    assert stalled["event"] == pe.RUN_STALLED and stalled["payload"]["last_step"] == 41
    assert failed["event"] == pe.RUN_FAILED and failed["payload"]["reason"] == "hang"
    assert (
        failed["resource"]["stoker.failure.reason"] == "hang"
        and failed["resource"]["stoker.failure.transient"] == "true"
    )


def test_an_emitter_that_raises_or_hangs_never_reaches_the_caller():
    log = Log()
    sender = pe.EventSender(log)
    run = pe.RunEvents(CTX, lambda **e: (_ for _ in ()).throw(RuntimeError("server said no")), sender, 0.0)
    for step in range(50):
        run(events.Step(step=step))
    assert sender.close(5)
    assert sender.failures == 50 and len(log.warnings) == 1 and "server said no" in log.warnings[0]

    release = threading.Event()
    sender = pe.EventSender(Log(), max_pending=8)
    run = pe.RunEvents(CTX, lambda **e: release.wait(), sender, 0.0)
    t0 = time.perf_counter()
    for step in range(1000):
        run(events.Step(step=step))
    took = time.perf_counter() - t0
    assert sender.dropped >= 1000 - 8 - 1  # the queue stays bounded; the rest is dropped, counted
    assert not sender.close(0.2)  # close() gives up after its timeout; it never waits longer
    release.set()
    assert took < 5  # (generous) 1000 steps never waited for the hanging emitter


def test_prefect_emit_with_the_server_away_returns_at_once_and_raises_nothing(monkeypatch, tmp_path):
    """The real prefect.events.emit_event, with PREFECT_API_URL naming a port nobody listens on."""
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from stoker.orchestration.prefect_events import emit
    from tests.conftest import free_port

    log = Log()
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        sender = pe.EventSender(log)
        run = pe.RunEvents(CTX, emit, sender, 0.0)
        t0 = time.perf_counter()
        for step in range(200):
            run(events.Step(step=step))
        run.failed("error", False, "a bad config")
        took = time.perf_counter() - t0
        assert sender.close(30)
        EventsWorker.drain_all(timeout=2)  # it gives up on the dead server; do not wait for it
    assert took < 2, took
    assert sender.failures == 0 and sender.sent == 201  # handed to Prefect's worker, which drops them


def test_heartbeat_now_repeats_the_last_step_whatever_the_rate_bound():
    run, sender, clock, sent = _collecting(step_interval=1000.0)
    assert run.heartbeat_now() is None  # no step yet: nothing to say
    run(events.Train(step=7, loss=3.5, lr=1e-3, step_seconds=0.2, tokens_seen=700))
    run(events.Step(step=8))  # bounded: no event
    assert sender.close(5) and len(sent) == 1
    beat = run.heartbeat_now().kwargs()
    assert beat["event"] == pe.RUN_STEP and beat["payload"] == {"step": 8, "loss": 3.5, "step_seconds": 0.2}
