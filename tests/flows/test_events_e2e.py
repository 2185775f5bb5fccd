"""Prefect events and automations with a real `prefect server start`: a run whose rank stops
stepping is marked Stalled by its launch's automation, and Running again by the other one at its
next heartbeat; the launch removes both when it ends. (The evaluate-checkpoint automation that
`stoker deploy` keeps, and the one run of it on a committed checkpoint: test_deployments, on
that module's deployments and ad-hoc run.)"""

import os
import subprocess
import sys
import uuid

import httpx
import pytest

from stoker.observe import prefect_events as pe
from stoker.orchestration.prefect_events import RESUMED_SUFFIX, STALL_AUTOMATION_PREFIX, STALLED_STATE_NAME
from tests.conftest import ROOT, stoker_events, tiny_sets, wait_for

# the session's restartable server, shared with test_prefect_away (no deployments, no
# automations but the launch's own): one xdist group, so `make test` starts it once
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("prefect-away-server")]


@pytest.fixture
def server(restartable_prefect_server) -> dict:
    """The environment for processes that talk to the session's restartable server."""
    return restartable_prefect_server.env


def test_a_run_that_stops_stepping_is_marked_stalled_and_running_again_at_its_next_step(server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.objects import StateType
    from prefect.events import Event
    from prefect.settings import PREFECT_API_URL, temporary_settings

    run = "stall-" + uuid.uuid4().hex[:6]
    env = {
        **server,
        "STOKER_CACHE": str(tmp_path / "cache"),
        "STOKER_FAULT": "hang:rank=0:step=20",  # the rank sleeps before step 20
    }
    args = tiny_sets(
        train={"max_steps": 60, "log_interval": 1},
        checkpoint={"interval_steps": 10},
        eval={"interval_steps": 100},
        # waited out after the mark and the take-back (an 11 s window, then the server's next
        # proactive pass, every second on the test server: the mark came ~13 s after the last
        # step): 35 s leaves those 20 s more on a loaded machine
        # one rank: the heartbeats and the server's marks are the subject, not the gang (a hung
        # gang's watchdog kill: tests/launch/test_watchdog.py, the lifeline tests)
        launch={"hang_timeout_seconds": 35, "max_attempts": 1, "nproc_per_node": 1},
        events={"step_interval_seconds": 1, "stall_min_seconds": 10, "stall_factor": 2},
    )
    cmd = [sys.executable, "-m", "stoker.cli", "run", *args, "--set", f"run_name={run}"]
    cmd += ["--set", f"storage.root=file://{tmp_path}/store"]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        with temporary_settings({PREFECT_API_URL: server["PREFECT_API_URL"]}), get_client(sync_client=True) as client:

            def flow_run():
                runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run}"])))
                return runs[0] if runs else None

            def stall_automations():
                return [a for a in client.read_automations() if a.name.startswith(f"{STALL_AUTOMATION_PREFIX}{run}:")]

            # the mark, and the one that takes it back (made one after the other)
            found = wait_for(
                "the launch's stalled-run automations",
                lambda: (lambda a: a if len(a) == 2 else None)(stall_automations()),
                300,
                [log],
            )
            (trigger,) = [a.trigger for a in found if not a.name.endswith(RESUMED_SUFFIX)]
            assert trigger.posture == "Proactive" and trigger.expect == {pe.RUN_STEP}
            assert 10 <= trigger.within.total_seconds() <= 60  # max(10, 2 x median step) + 1

            def states():
                fr = flow_run()
                return sorted(client.read_flow_run_states(fr.id), key=lambda s: s.timestamp) if fr else []

            def stalled():
                return [s for s in states() if s.name == STALLED_STATE_NAME] or None

            marked = wait_for("the flow run to be marked Stalled", stalled, 180, [log])
            assert marked[0].type == StateType.RUNNING and "no training step" in marked[0].message

            # a heartbeat of the run after the mark (its last one again, as a rank that stepped
            # again would send it; posted to this server's events API): Running again
            beat = stoker_events(server, pe.RUN_STEP, run)[-1]
            again = Event(
                event=pe.RUN_STEP, resource=beat["resource"], related=beat["related"], payload=beat["payload"]
            )
            posted = httpx.post(server["PREFECT_API_URL"] + "/events", json=[again.model_dump(mode="json")], timeout=30)
            assert posted.status_code == 204, posted.text

            def running_again():
                after = [s for s in states() if s.timestamp > marked[0].timestamp]
                return [s for s in after if s.type == StateType.RUNNING and s.name == "Running"] or None

            (resumed, *_) = wait_for("the flow run to be Running again", running_again, 60, [log])
            assert "reported again" in resumed.message
            beat_at = beat["occurred"]
            print(f"last heartbeat {beat_at}; marked Stalled {marked[0].timestamp}; Running again {resumed.timestamp}")
            assert proc.wait(timeout=240) != 0  # then stoker's own watchdog kills the hung gang
            ended = flow_run()
            assert ended.state.type == StateType.FAILED, ended.state
            assert stall_automations() == []  # removed when the launch ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last_beat = stoker_events(server, pe.RUN_STEP, run)[-1]["payload"]
    assert last_beat["step"] < 20 and last_beat["step_seconds"] > 0
    # sent as the launch ended; the server stores events in batches
    (gone,) = wait_for("the stalled event", lambda: stoker_events(server, pe.RUN_STALLED, run), 60)
    assert gone["payload"]["last_step"] == 19
    (failed,) = wait_for("the failed event", lambda: stoker_events(server, pe.RUN_FAILED, run), 60)
    assert failed["payload"]["reason"] == "hang" and failed["payload"]["transient"] is True
    assert os.path.exists(log)
