"""The automations stoker makes, as specs (the real server runs them in
tests/flows/test_events_e2e.py), and the events section's validation."""

import pytest

from stoker.config import ConfigError, load_config
from stoker.observe import prefect_events as pe
from stoker.orchestration import prefect_events as tpe
from tests.conftest import tiny_dict

CTX = pe.RunContext(run="r1", flow_run_id="11111111-2222-3333-4444-555555555555", attempt=3)


def test_the_stall_window_is_the_factor_of_the_median_step_floored_plus_the_heartbeat_period(tmp_path):
    cfg = load_config(tiny_dict(f"file://{tmp_path}", events={"stall_factor": 10, "stall_min_seconds": 30}))
    assert tpe.stall_window_seconds(cfg, 0.5) == 30 + 10  # the floor, plus the default 10 s period
    assert tpe.stall_window_seconds(cfg, 6.0) == 60 + 10


@pytest.mark.parametrize("action", ["mark", "cancel"])
def test_the_stalled_run_automation_expects_this_launchs_heartbeats_and_marks_or_cancels(action):
    spec = tpe.stall_automation(CTX, 42.0, action)
    t = spec.trigger
    assert t.posture == "Proactive" and t.after == t.expect == {pe.RUN_STEP} and t.threshold == 1
    assert t.within.total_seconds() == 42.0 and t.for_each == {"prefect.resource.id"}
    assert t.match.model_dump() == {
        "prefect.resource.id": "stoker.run.r1",
        pe.FLOW_RUN_LABEL: CTX.flow_run_id,
        "stoker.attempt": "3",
    }
    (act,) = spec.actions
    assert act.type == "change-flow-run-state"
    if action == "mark":
        # not forced: an ended flow run (its launcher killed before removing this) stays ended
        assert (act.state.value, act.name, act.force) == ("RUNNING", tpe.STALLED_STATE_NAME, False)
    else:
        assert act.state.value == "CANCELLING" and "cancelled" in act.message
    assert spec.name.startswith(f"{tpe.STALL_AUTOMATION_PREFIX}r1:")


def test_the_resume_automation_sets_running_at_the_first_heartbeat_after_the_flow_run_went_stalled():
    spec = tpe.resume_automation(CTX)
    t = spec.trigger
    assert t.posture == "Reactive" and t.threshold == 1 and t.within.total_seconds() == 0
    assert t.after == {"prefect.flow-run.Stalled"} and t.expect == {pe.RUN_STEP}
    # one trigger sees the flow run's own state event and the run's heartbeats
    assert t.match.model_dump() == {"prefect.resource.id": [f"prefect.flow-run.{CTX.flow_run_id}", "stoker.run.r1"]}
    (act,) = spec.actions
    assert act.type == "change-flow-run-state" and (act.state.value, act.name, act.force) == ("RUNNING", None, False)
    assert spec.name == tpe.stall_automation_name(CTX) + tpe.RESUMED_SUFFIX
    assert spec.name.startswith(f"{tpe.STALL_AUTOMATION_PREFIX}r1:")  # removed with the stall one


@pytest.mark.e2e
def test_a_launch_that_steps_takes_back_a_stalled_mark_left_by_its_predecessor(prefect_server):
    """A retry of a launch that failed while marked Stalled: the flow run is Running again when
    the new launch's automations are made; 'cancel' makes no resume automation."""
    import logging
    import uuid

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    @flow
    def stand_in():
        pass

    log = logging.getLogger("test")
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(stand_in, state=Running())
        client.set_flow_run_state(flow_run.id, Running(name=tpe.STALLED_STATE_NAME))
        ctx = pe.RunContext(run="mark-" + uuid.uuid4().hex[:6], flow_run_id=str(flow_run.id), attempt=2)
        watch = tpe.StallWatch(ctx, log)
        watch.create(20.0, "mark")
        state = client.read_flow_run(flow_run.id).state
        assert state.is_running() and state.name == "Running" and "launch 2" in state.message
        mine = [a.name for a in client.read_automations() if a.name.startswith(tpe.stall_automation_name(ctx))]
        assert sorted(mine) == [tpe.stall_automation_name(ctx), tpe.stall_automation_name(ctx) + tpe.RESUMED_SUFFIX]
        watch.delete()
        assert not [a for a in client.read_automations() if a.name.startswith(tpe.stall_automation_name(ctx))]
        cancelling = tpe.StallWatch(ctx, log)
        cancelling.create(20.0, "cancel")
        assert len(cancelling.automation_ids) == 1
        cancelling.delete()


def test_the_evaluate_automation_runs_the_deployment_on_the_events_checkpoint_uri():
    import uuid

    deployment = uuid.uuid4()
    spec = tpe.evaluate_automation(deployment)
    assert spec.trigger.expect == {pe.CHECKPOINT_COMMITTED} and spec.trigger.posture == "Reactive"
    assert spec.trigger.match.model_dump() == {
        "prefect.resource.id": "stoker.checkpoint.*",
        pe.EVALUATED_IN_RUN_LABEL: "false",
    }
    (act,) = spec.actions
    assert act.type == "run-deployment" and act.deployment_id == deployment
    assert act.parameters == {"checkpoint_uri": "{{ event.resource['stoker.checkpoint.uri'] }}"}


def test_a_bad_events_field_is_one_error_naming_it_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict(f"file://{tmp_path}", events={"stall_min_seconds": 5, "stall_action": "kill"}))
    text = str(err.value)
    assert "events.stall_min_seconds" in text and "at least 10 seconds" in text
    assert "events.stall_action" in text


def test_events_are_no_part_of_the_runs_identity(tmp_path):
    a = load_config(tiny_dict(f"file://{tmp_path}"))
    b = load_config(tiny_dict(f"file://{tmp_path}", events={"enabled": False, "step_interval_seconds": 3}))
    assert a.resolved_run_name() == b.resolved_run_name()


# ---- stoker.run.failed of the flow run, with the Prefect test server -----------------------
def _server_events(event: str, run: str) -> list[dict]:
    """The test server's events of that name about the stoker run (as stored, oldest first)."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    body = {"filter": {"event": {"name": [event]}, "any_resource": {"labels": {pe.RUN_LABEL: [run]}}}, "limit": 50}
    page = httpx.post(PREFECT_API_URL.value() + "/events/filter", json=body, timeout=30).json()
    return sorted(page["events"], key=lambda e: e["occurred"])


def _all_sent(run: str) -> None:
    """Hand over every event of this process, then wait until the server has stored a last
    one, sent after them: what was sent before it is stored by then too."""
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    from tests.conftest import wait_for

    emit_event("stoker.test.sentinel", resource={"prefect.resource.id": f"stoker.run.{run}", pe.RUN_LABEL: run})
    EventsWorker.drain_all(timeout=30)
    wait_for("the last event to be stored", lambda: _server_events("stoker.test.sentinel", run), 60)


@pytest.fixture
def fresh_events_worker(prefect_server):
    """Prefect's EventsWorker is one per process and keeps the server it first met: a new one,
    bound to the test server."""
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=30)


@pytest.mark.e2e
def test_a_pipeline_that_fails_in_its_data_stage_sends_run_failed_once_with_the_reason(fresh_events_worker, tmp_path):
    import uuid

    from stoker.flows.pipeline import train_pipeline

    run = "data-fails-" + uuid.uuid4().hex[:6]
    bad = tmp_path / "corpus.txt"
    bad.write_bytes(b"text, then bytes that are not UTF-8: \xff\xfe\x80")
    cfg = load_config(tiny_dict(f"file://{tmp_path}/store", run_name=run, data={"source": str(bad)}))
    state = train_pipeline(cfg, return_state=True)
    assert state.is_failed() and "not UTF-8" in state.message
    _all_sent(run)
    (failed,) = _server_events(pe.RUN_FAILED, run)  # one, from the flow run's failure hook
    assert failed["payload"]["reason"] == "DataError" and failed["payload"]["transient"] is False
    assert "not UTF-8" in failed["payload"]["message"]
    assert failed["resource"]["prefect.resource.id"] == f"stoker.run.{run}"
    assert failed["resource"]["stoker.failure.reason"] == "DataError"
    flow_run_id = str(state.state_details.flow_run_id)
    assert failed["resource"][pe.FLOW_RUN_LABEL] == flow_run_id
    assert f"prefect.flow-run.{flow_run_id}" in {r["prefect.resource.id"] for r in failed["related"]}


@pytest.mark.e2e
def test_a_failed_launch_sends_run_failed_once_not_again_from_the_flow_run(fresh_events_worker, tmp_path):
    """The launch's own event (LaunchEvents.ended, as launch_training calls it) and the same
    failure reaching the flow run: one stoker.run.failed."""
    import logging
    import uuid

    from prefect import flow, task

    from stoker.config import RunConfig
    from stoker.failures import TrainingFailed
    from stoker.storage.store import Store

    run = "launch-fails-" + uuid.uuid4().hex[:6]
    cfg = load_config(tiny_dict(f"file://{tmp_path}/store", run_name=run))

    @task(retries=0, persist_result=False)
    def launch(config: RunConfig):
        launch_events = tpe.LaunchEvents(config, 1, Store(config.storage.root), logging.getLogger("test"))
        failure = TrainingFailed("rank 1 was lost", transient=True, reason="lost-rank")
        launch_events.ended(failure)
        raise failure

    @flow(on_failure=[tpe.flow_run_failed])
    def pipeline(config: RunConfig):
        launch(config)

    assert pipeline(cfg, return_state=True).is_failed()
    _all_sent(run)
    (failed,) = _server_events(pe.RUN_FAILED, run)
    assert failed["payload"]["reason"] == "lost-rank" and failed["payload"]["transient"] is True
