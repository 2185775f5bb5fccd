"""Cancelling a flow run through Prefect, the real way: the train_pipeline flow is served by a
runner (`flow.serve` in a subprocess, against the session's Prefect server), a flow run of it
trains on a real torchrun gang, the test asks the API to cancel it (as the UI or
`prefect flow-run cancel` do), and then checks that no process of the run is left, that the
run ends Cancelled, and that the newest checkpoint is valid."""

import os
import signal
import subprocess
import sys
import time

import pytest

from stoker.config import load_config
from stoker.storage.checkpoints import find_latest_valid
from stoker.storage.store import Store
from tests.conftest import (
    ROOT,
    GangWatch,
    assert_a_stop_left_a_resume_point,
    descendants,
    read_proc,
    stop_process,
    tiny_dict,
)

pytestmark = pytest.mark.e2e

# A deployment with an entrypoint, as `prefect deploy` makes: the runner starts each flow run
# as `python -m prefect.engine`, which imports stoker/flows/pipeline.py. (`train_pipeline.serve()`
# would instead cloudpickle the flow by value, and the nested prepare_data flow then cannot
# resolve its string annotations: "`Prepare_DataModel` is not fully defined".)
SERVE = (
    "import prefect; from stoker.flows.pipeline import train_pipeline; "
    "prefect.serve(train_pipeline.to_deployment(name='cancel-test'), "
    "print_starting_message=False, limit=1)"
)


def _wait(what, check, deadline_s, proc=None, log=None):
    """Poll `check` until it returns something truthy; the deadline only stops a hang."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the serving process exited ({proc.returncode}) while waiting for {what}:\n" + _tail(log))
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}:\n" + _tail(log))
        time.sleep(0.5)


class _Described:
    """What a wait is for, with what its last look found (read when the wait fails)."""

    def __init__(self, what: str, found):
        self.what, self.found = what, found

    def __str__(self) -> str:
        return f"{self.what} ({self.found()})"


def _tail(log) -> str:
    return log.read_text()[-6000:] if log is not None and log.exists() else ""


def _serve(log):
    """The deployment served by a runner in a subprocess against the session's server."""
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PYTHONPATH": ROOT,
    }
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", SERVE],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _deployment(client, server, log):
    def registered():
        try:
            return client.read_deployment_by_name("train-pipeline/cancel-test")
        except Exception:  # not registered yet
            return None

    return _wait("the deployment", registered, 180, server, log)


def _still_running(client, run_id, watch, log, ready):
    """A check for _wait: records the run's processes, fails if the flow run already ended
    (before the cancel), else says whether `ready()`."""

    def check():
        watch.record()
        state = client.read_flow_run(run_id).state
        if state is not None and state.is_final():
            pytest.fail(f"the flow run ended before the cancel: {state!r}\n" + _tail(log))
        return ready()

    return check


def test_cancelled_flow_run_leaves_no_process_and_a_valid_checkpoint(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    root = "file://" + str(tmp_path / "store")
    cfg = load_config(
        tiny_dict(
            root,
            run_name="cancel",
            train={"max_steps": 100_000},
            # the cancel waits for a first committed checkpoint (mid-training): at step 20
            checkpoint={"interval_steps": 20},
            eval={"interval_steps": 100_000},
            launch={"timeout_seconds": 600},
        )
    )
    config_marker = f"{tmp_path}/store/runs/cancel/config.json"  # on every rank's command line
    store = Store(root)
    log = tmp_path / "serve.log"
    server = _serve(log)
    watch = GangWatch(config_marker)
    try:
        with get_client(sync_client=True) as client:
            dep = _deployment(client, server, log)
            run = client.create_flow_run_from_deployment(dep.id, parameters={"config": cfg.model_dump(mode="json")})

            # wait until the gang trains and has committed a checkpoint: mid-training
            def training():
                ranks = [
                    p
                    for p in watch.seen.values()
                    if "torch.distributed.run" not in p.cmdline and "training.train" in p.cmdline and read_proc(p.pid)
                ]
                seen["ranks"] = len(ranks)
                if len(ranks) != 2:
                    return None
                choice = find_latest_valid(store, "cancel")
                seen["skipped"] = [(ref.key, reason) for ref, reason in choice.skipped][:4]
                return choice.checkpoint

            seen: dict = {}  # what the last look found, for the message of a failed wait
            _wait(
                _Described("training with a committed checkpoint", lambda: f"last look: {seen}"),
                _still_running(client, run.id, watch, log, training),
                300,
                server,
                log,
            )
            agents = [p for p in watch.seen.values() if "torch.distributed.run" in p.cmdline]
            assert len(agents) == 1
            flow_run_proc = read_proc(agents[0].ppid)  # the runner's flow-run process
            assert flow_run_proc is not None and flow_run_proc.pid in descendants(server.pid)

            client.set_flow_run_state(run.id, Cancelling(message="cancel test"))

            # the runner SIGTERMs the flow-run process; the run ends once that process is gone
            def ended():
                watch.record()
                state = client.read_flow_run(run.id).state
                now = read_proc(flow_run_proc.pid)
                gone = now is None or now.start != flow_run_proc.start
                return state if state is not None and state.is_final() and gone else None

            final = _wait("the flow run to end", ended, 180, server, log)
            assert final.type == StateType.CANCELLED, f"{final!r}\n" + _tail(log)

        # nothing of the run is left: agents, ranks (each in a session of its own), their
        # children, anything naming the run's config
        assert len([p for p in watch.seen.values() if "training.train" in p.cmdline]) >= 3
        assert watch.gone_within() == []
        under_runner = [
            p for p in descendants(server.pid).values() if p.pid == flow_run_proc.pid or config_marker in p.cmdline
        ]
        assert under_runner == []

        # the ranks stopped at a step boundary, and left a checkpoint to resume from
        assert_a_stop_left_a_resume_point(store, "cancel")
    finally:
        stop_process(server)  # the runner shuts down on SIGTERM
        for proc in watch.leftovers():  # only if the test failed: leave nothing running
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_cancelling_a_flow_run_on_ray_stops_the_ray_job_and_leaves_no_worker(prefect_server, ray_cluster, tmp_path):
    """launch.launcher: ray, through the same served deployment: the cancel reaches the Ray
    driver (SIGTERM from the launcher's stop), the workers write a stop checkpoint, and no Ray
    Train worker or controller is left on either node of the cluster."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    root, options = ray_cluster.bucket()
    cfg = load_config(
        tiny_dict(
            root,
            run_name="cancel-ray",
            train={"max_steps": 100_000},
            # the cancel waits for a first committed checkpoint (mid-training): at step 4
            checkpoint={"interval_steps": 4},
            eval={"interval_steps": 100_000, "per_checkpoint_enabled": False},
            storage={"root": root, "storage_options": options},
            ray={"address": ray_cluster.cluster.client_address},
            launch={"launcher": "ray", "num_nodes": 2, "nproc_per_node": 1, "timeout_seconds": 600},
        )
    )
    store = Store(root, options)
    log = tmp_path / "serve.log"
    server = _serve(log)
    watch = GangWatch("training.ray_main")
    try:
        with get_client(sync_client=True) as client:
            dep = _deployment(client, server, log)
            run = client.create_flow_run_from_deployment(dep.id, parameters={"config": cfg.model_dump(mode="json")})

            def training():
                workers = ray_cluster.cluster.worker_pids("RayTrainWorker")
                return len(workers) == 2 and find_latest_valid(store, "cancel-ray").checkpoint

            _wait(
                "Ray workers on both nodes and a committed checkpoint",
                _still_running(client, run.id, watch, log, training),
                300,
                server,
                log,
            )
            client.set_flow_run_state(run.id, Cancelling(message="cancel test"))

            def ended():
                watch.record()
                state = client.read_flow_run(run.id).state
                return state if state is not None and state.is_final() else None

            final = _wait("the flow run to end", ended, 180, server, log)
            assert final.type == StateType.CANCELLED, f"{final!r}\n" + _tail(log)

        def nothing_left():
            return not any(ray_cluster.cluster.worker_pids(p) for p in ("RayTrainWorker", "TrainController"))

        _wait("the Ray workers to end", nothing_left, 120)
        assert any("training.ray_main" in p.cmdline for p in watch.seen.values())
        assert _wait("the driver to end", lambda: watch.leftovers() == [], 60)
        # a fresh listing cache: the one above predates the files
        assert_a_stop_left_a_resume_point(Store(root, options), "cancel-ray")
    finally:
        stop_process(server)
        for proc in watch.leftovers():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
