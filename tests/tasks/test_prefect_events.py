"""The automations stoker makes, as specs (the real server runs them in
tests/flows/test_events_e2e.py), and the events section's validation."""

import pytest

from stoker.core.config import ConfigError, load_config
from stoker.observe import prefect_events as pe
from stoker.tasks import prefect_events as tpe
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
