"""Prefect events and automations with a real `prefect server start`: `stoker deploy` keeps the
evaluate-checkpoint automation (twice: idempotent); a run's real stoker.checkpoint.committed
event makes it run the evaluate-checkpoint deployment on that checkpoint, which a process worker
runs to Completed; a run whose rank stops stepping is marked Stalled by its launch's automation,
and Running again by the other one at its next heartbeat; the launch removes both when it ends."""

import os
import subprocess
import sys
import uuid

import httpx
import pytest

from stoker.observe import prefect_events as pe
from stoker.tasks.prefect_events import (
    EVALUATE_AUTOMATION,
    RESUMED_SUFFIX,
    STALL_AUTOMATION_PREFIX,
    STALLED_STATE_NAME,
)
from tests.conftest import (
    ROOT,
    real_prefect_server,
    start_process,
    start_worker,
    stoker_deploy,
    stop_process,
    tiny_dict,
    tiny_sets,
    wait_for,
    wait_for_flow_run,
)

# one xdist group: the module's server is started once under `make test` too
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("events-server")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One real server for this module (its tests name their runs apart)."""
    with real_prefect_server(str(tmp_path_factory.mktemp("events-prefect"))) as env:
        yield env


def stoker_events(env: dict, prefix: str, run: str) -> list[dict]:
    """The server's events whose name starts with `prefix` and that name the stoker run."""
    body = {"filter": {"event": {"prefix": [prefix]}, "any_resource": {"labels": {pe.RUN_LABEL: [run]}}}, "limit": 50}
    page = httpx.post(env["PREFECT_API_URL"] + "/events/filter", json=body, timeout=30).json()
    return sorted(page["events"], key=lambda e: e["occurred"])


def test_deploy_keeps_the_evaluate_automation_and_a_committed_checkpoint_is_evaluated_by_it(server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    store = tmp_path / "store"
    env = {**server, "STOKER_ROOT": str(store), "STOKER_CACHE": str(tmp_path / "cache")}
    for round_ in (1, 2):  # idempotent: the second finds the automation by its name
        said = "created" if round_ == 1 else "already there (updated)"
        out = stoker_deploy(env)
        assert f"automation {EVALUATE_AUTOMATION!r}: {said}" in out, out

    worker_log = tmp_path / "worker.log"
    worker = start_worker(env, worker_log)
    try:
        with temporary_settings({PREFECT_API_URL: server["PREFECT_API_URL"]}):
            with get_client(sync_client=True) as client:
                automations = client.read_automations_by_name(EVALUATE_AUTOMATION)
                assert len(automations) == 1
                evaluate = client.read_deployment_by_name("evaluate-checkpoint/evaluate-checkpoint")
                action = automations[0].actions[0]
                assert action.type == "run-deployment" and action.deployment_id == evaluate.id

            # a real run, from the ad-hoc deployment: checkpoints at steps 4 and 8; the run
            # evaluates step 8 itself (its last), the automation step 4
            run = "svc-" + uuid.uuid4().hex[:6]
            params = tiny_dict("file://" + str(store), run_name=run)
            train = run_deployment("train-pipeline/train-adhoc", parameters={"config": params}, timeout=0)
            with get_client(sync_client=True) as client:
                done = wait_for_flow_run(client, train.id, "the training run to finish", [worker_log])
                assert done.state.type == StateType.COMPLETED, done.state.message

                def evaluations():
                    runs = client.read_flow_runs(
                        deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["evaluate-checkpoint"]))
                    )
                    return runs if runs and all(r.state.is_final() for r in runs) else None

                runs = wait_for("the automation's evaluation to finish", evaluations, 300, [worker_log])
            assert len(runs) == 1, [(r.name, r.parameters) for r in runs]
            step4 = f"file://{store}/runs/{run}/checkpoints/step-00000004"
            assert runs[0].parameters == {"checkpoint_uri": step4}
            assert runs[0].state.type == StateType.COMPLETED, runs[0].state.message

        committed = wait_for(
            "both checkpoint events",
            lambda: (lambda es: es if len(es) == 2 else None)(stoker_events(server, pe.CHECKPOINT_COMMITTED, run)),
            60,
        )
        assert [e["resource"]["stoker.checkpoint.step"] for e in committed] == ["4", "8"]
        first = committed[0]
        assert first["resource"]["prefect.resource.id"] == f"stoker.checkpoint.{run}.4"
        assert first["resource"][pe.URI_LABEL] == step4 and len(first["resource"][pe.MANIFEST_LABEL]) == 64
        assert first["resource"]["stoker.deployment.id"] == str(done.deployment_id)
        related = {r["prefect.resource.id"] for r in first["related"]}
        assert {
            f"prefect.flow-run.{train.id}",
            f"prefect.deployment.{done.deployment_id}",
            f"stoker.run.{run}",
        } <= related
        assert stoker_events(server, pe.RUN_STEP, run), "no heartbeat"
        assert not stoker_events(server, pe.RUN_FAILED, run)

        # the same checkpoint's event a second time (a replayed event, a second trigger): the
        # automation runs the deployment again, and its evaluation is Cached (keyed by the
        # checkpoint's manifest): no second evaluation process, the same numbers
        # (posted to the server's events API: this process's EventsWorker may still be bound
        # to another server of the session)
        from prefect.events import Event

        again_event = Event(event=pe.CHECKPOINT_COMMITTED, resource=first["resource"], related=first["related"])
        posted = httpx.post(
            server["PREFECT_API_URL"] + "/events", json=[again_event.model_dump(mode="json")], timeout=30
        )
        assert posted.status_code == 204, posted.text
        with temporary_settings({PREFECT_API_URL: server["PREFECT_API_URL"]}):
            with get_client(sync_client=True) as client:
                again = wait_for(
                    "the second evaluation to finish",
                    lambda: (lambda rs: rs if len(rs) == 2 else None)(evaluations() or []),
                    300,
                    [worker_log],
                )
                second = max(again, key=lambda r: r.expected_start_time)
                assert second.id != runs[0].id and second.parameters == {"checkpoint_uri": step4}
                assert second.state.type == StateType.COMPLETED, second.state.message

                def task_states():  # task run states reach the database as events, a little later
                    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[second.id])))
                    states = {t.name.rsplit("-", 1)[0]: t.state for t in tasks if t.state is not None}
                    done = states.get("evaluate_checkpoint")
                    return states if done is not None and done.is_final() else None

                states = wait_for("the second evaluation's task runs", task_states, 60, [worker_log])
                assert states["evaluate_checkpoint"].name == "Cached", states
    finally:
        stop_process(worker)


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
        "STOKER_FAULT": "hang:rank=0:step=40",  # rank 0 sleeps before step 40; rank 1 waits on it
    }
    args = tiny_sets(
        train={"max_steps": 60, "log_interval": 1},
        checkpoint={"interval_steps": 20},
        eval={"interval_steps": 100},
        # waited out after the mark and the take-back (~11 s window, then the server's trigger
        # passes): 60 s leaves those half a minute more even on a loaded machine
        launch={"hang_timeout_seconds": 60, "max_attempts": 1},
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
    assert last_beat["step"] < 40 and last_beat["step_seconds"] > 0
    # sent as the launch ended; the server stores events in batches
    (gone,) = wait_for("the stalled event", lambda: stoker_events(server, pe.RUN_STALLED, run), 60)
    assert gone["payload"]["last_step"] == 39
    (failed,) = wait_for("the failed event", lambda: stoker_events(server, pe.RUN_FAILED, run), 60)
    assert failed["payload"]["reason"] == "hang" and failed["payload"]["transient"] is True
    assert os.path.exists(log)


def test_serve_points_the_evaluate_automation_at_the_served_deployment(server, tmp_path):
    """After `stoker deploy` (the first test), `stoker serve` takes the deployments over from
    the work pool (new ids) and updates the one automation to run the served evaluate-checkpoint."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env = {**server, "STOKER_ROOT": str(tmp_path / "store"), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        served = start_process([sys.executable, "-m", "stoker.cli", "serve"], env, out)
    try:
        with temporary_settings({PREFECT_API_URL: server["PREFECT_API_URL"]}), get_client(sync_client=True) as client:

            def served_evaluate():
                try:
                    d = client.read_deployment_by_name("evaluate-checkpoint/evaluate-checkpoint")
                except Exception:
                    return None
                return d if d.work_pool_name is None else None

            evaluate = wait_for("the served evaluate-checkpoint deployment", served_evaluate, 180, [log])
            automations = wait_for(
                "the automation on it",
                lambda: [
                    a
                    for a in client.read_automations_by_name(EVALUATE_AUTOMATION)
                    if a.actions[0].deployment_id == evaluate.id
                ],
                60,
                [log],
            )
            assert len(client.read_automations_by_name(EVALUATE_AUTOMATION)) == len(automations) == 1
    finally:
        stop_process(served)
