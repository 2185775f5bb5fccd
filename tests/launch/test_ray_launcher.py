"""The Ray launcher (launch.launcher: ray) on a real Ray cluster of two nodes, each in a network
namespace of its own (tests.raycluster, the session's `ray_cluster`): the driver connects with
Ray Client from this namespace (or, where a test says so, runs on the head node and joins by
GCS address or 'auto'), one worker runs on each node, checkpoints go to S3 (moto on the
bridge address) through the commit protocol. Compared, bit for bit, with the local (torchrun)
launcher's run of the same world size."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from stoker.config import load_config
from stoker.contracts import events
from stoker.launch import make_launcher
from stoker.launch.ray import RayLauncher
from stoker.storage.checkpoints import find_latest_valid, list_checkpoints
from stoker.storage.store import Store
from tests.conftest import (
    ROOT,
    assert_a_stop_left_a_resume_point,
    assert_bitwise_equal,
    event_losses,
    newest_weights,
    prepare_shards,
    run_collecting,
    tiny_dict,
)
from tests.raycluster import TRAIN_ENV

MAX_STEPS, INTERVAL = 8, 4
RAY_PROCESSES = ("RayTrainWorker", "TrainController")


class Runs:
    def __init__(self, cluster, root: str, options: dict, shard_key: str, cache: str):
        self.cluster, self.root, self.options = cluster, root, options
        self.shard_key, self.cache = shard_key, cache

    @property
    def store(self) -> Store:
        return Store(self.root, self.options)

    def config(self, run: str, launcher: str, max_restarts: int = 0, address: str | None = None, **launch):
        """(config, its URL in the store): world size 2 either way (Ray: one worker per node).
        `address`: ray.address (default: the cluster's Ray Client address)."""
        shape = {"num_nodes": 2, "nproc_per_node": 1} if launcher == "ray" else {"num_nodes": 1, "nproc_per_node": 2}
        cfg = load_config(
            tiny_dict(
                self.root,
                run_name=run,
                train={"max_steps": MAX_STEPS},
                checkpoint={"interval_steps": INTERVAL},
                eval={"per_checkpoint_enabled": False},
                storage={"root": self.root, "storage_options": self.options},
                ray={"address": address or self.cluster.client_address},
                launch={"launcher": launcher, "timeout_seconds": 300, "max_restarts": max_restarts, **shape, **launch},
            )
        )
        key = f"runs/{run}/config.json"
        self.store.write_bytes(key, cfg.to_json().encode())
        return cfg, self.store.url(key)

    def launch(
        self,
        cfg,
        url: str,
        resume_key: str | None = None,
        env: dict | None = None,
        on_event=None,
        on_node: int | None = None,
    ):
        """(launcher, GangResult, events, lines) of one launch attempt. `on_node`: the driver
        runs on that node of the cluster (in its namespace, with its environment), as a flow run
        on a cluster machine would, instead of in this namespace."""
        launcher = self.launcher(cfg, url, resume_key, env, on_node)
        return (launcher, *run_collecting(launcher, on_event))

    def launcher(self, cfg, url: str, resume_key=None, env: dict | None = None, on_node: int | None = None):
        launcher = make_launcher(cfg, url, self.shard_key, resume_key)
        if on_node is not None:
            node_env = self.cluster.node_env(on_node)
            mine = {k: v for k, v in node_env.items() if os.environ.get(k) != v}  # the node's own
            launcher.gang.cmds = [[*self.cluster.exec_prefix(on_node), *cmd] for cmd in launcher.gang.cmds]
            launcher.gang.envs = [{**e, **mine} for e in launcher.gang.envs]
        if env:
            launcher.gang.envs = [{**e, **env} for e in launcher.gang.envs]
        return launcher

    def completed(self, cfg, url: str, **kw):
        _, result, seen, lines = self.launch(cfg, url, **kw)
        assert result.reason == "completed", "\n".join(lines[-60:])
        return seen, lines

    def final_weights(self, run: str) -> dict[str, torch.Tensor]:
        return newest_weights(self.store, run, MAX_STEPS, self.cache)


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    root, options = ray_cluster.bucket()
    cfg = load_config(tiny_dict(root, storage={"root": root, "storage_options": options}))
    _, shards = prepare_shards(cfg)
    return Runs(ray_cluster.cluster, root, options, shards.key, str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def local_run(runs):
    """The local launcher's run (torchrun, 1 node x 2 ranks): (losses, final weights)."""
    cfg, url = runs.config("local-2", "local")
    seen, _ = runs.completed(cfg, url)
    return event_losses(seen), runs.final_weights("local-2")


def _no_ray_workers_left(cluster, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        left = {p: cluster.worker_pids(p) for p in RAY_PROCESSES}
        if not any(left.values()):
            return
        assert time.monotonic() < deadline, f"Ray processes left: {left}"
        time.sleep(0.5)


@pytest.mark.e2e
def test_a_ray_run_on_two_nodes_equals_the_local_launchers_run(runs, local_run):
    local_losses, local_weights = local_run
    cfg, url = runs.config("ray-2", "ray")
    seen, lines = runs.completed(cfg, url)
    # events and lines reach the launcher as torchrun's do: rank-prefixed, once each
    assert sorted(event_losses(seen)) == list(range(1, MAX_STEPS + 1))
    assert len([e for e in seen if isinstance(e, events.Train)]) == MAX_STEPS
    assert [e.step for e in seen if isinstance(e, events.CheckpointCommitted)] == [INTERVAL, MAX_STEPS]
    assert any(line.startswith("[rank 1] ") for line in lines), lines[-30:]
    assert_bitwise_equal(local_weights, runs.final_weights("ray-2"))
    assert event_losses(seen) == local_losses
    # one worker on each node: each node's own cache holds the shards its rank loaded
    for cache in runs.cluster.caches:
        assert os.path.isfile(os.path.join(cache, runs.shard_key, "manifest.json")), cache
    _no_ray_workers_left(runs.cluster)


@pytest.mark.e2e
def test_a_killed_worker_is_recovered_by_ray_and_the_run_ends_bitwise(runs, local_run, tmp_path):
    """Node 1's worker freezes before step 6 (checkpoint 4 committed), then is SIGKILLed from
    outside; Ray (FailureConfig: launch.max_restarts) restarts the worker group, which resumes
    from checkpoint 4 by itself, in the same launch."""
    local_losses, local_weights = local_run
    cfg, url = runs.config("ray-killed", "ray", max_restarts=1)
    freeze = {"STOKER_FAULT": "hang:rank=1:step=6", "STOKER_FAULT_ONCE": str(tmp_path / "fired")}
    killed: list[int] = []

    def kill_node_1_worker(seen):
        committed = any(isinstance(e, events.CheckpointCommitted) and e.step == INTERVAL for e in seen)
        if not killed and committed and any(isinstance(e, events.Train) and e.step == 5 for e in seen):
            time.sleep(1.0)  # rank 1 is frozen, rank 0 waits in step 6's all-reduce
            pids = runs.cluster.worker_pids("RayTrainWorker").get(1, [])
            assert pids, "no Ray worker on node 1"
            for pid in pids:
                os.kill(pid, 9)
            killed.extend(pids)

    launcher, result, seen, lines = runs.launch(cfg, url, env=freeze, on_event=kill_node_1_worker)
    assert killed, "the worker was never killed:\n" + "\n".join(lines[-40:])
    assert result.reason == "completed", "\n".join(lines[-60:])
    assert [e.step for e in seen if isinstance(e, events.Resumed)] == [INTERVAL]
    losses = event_losses(seen)  # steps 5 and on twice: the last report of each counts
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert losses == local_losses
    assert_bitwise_equal(local_weights, runs.final_weights("ray-killed"))
    _no_ray_workers_left(runs.cluster)


@pytest.mark.e2e
def test_stopping_the_launch_stops_the_ray_job_with_a_checkpoint_and_leaves_no_worker(runs):
    """What a Prefect cancel does to a launch (launcher.stop: SIGTERM to the driver, then the
    kill): the workers stop at a step boundary, write a stop checkpoint, and Ray ends them.
    The driver runs on the head node and joins by the GCS HOST:PORT (no Ray Client: the stop
    through Ray Client is the SIGKILLed launcher's test, and the Prefect cancel's)."""
    cfg, url = runs.config("ray-stopped", "ray", max_restarts=2, address=runs.cluster.gcs_address)
    cfg.train.max_steps = 400
    runs.store.write_bytes("runs/ray-stopped/config.json", cfg.to_json().encode())
    launcher = runs.launcher(cfg, url, on_node=0)
    seen, lines, out = [], [], {}
    started = threading.Event()

    def on_event(e):
        seen.append(e)
        if isinstance(e, events.Train) and e.step >= 2:
            started.set()

    worker = threading.Thread(target=lambda: out.setdefault("result", launcher.run(lines.append, on_event)))
    worker.start()
    assert started.wait(240), "\n".join(lines[-40:])
    t0 = time.monotonic()
    launcher.stop()
    worker.join(60)
    assert not worker.is_alive()
    seconds = time.monotonic() - t0
    stopped = [e for e in seen if isinstance(e, events.Stopped)]
    assert stopped and stopped[0].saved, "\n".join(lines[-40:])
    assert list_checkpoints(runs.store, "ray-stopped")[0].step == stopped[0].step
    assert out["result"].reason != "completed"
    assert seconds < 25, f"the stop took {seconds:.1f}s"
    print(f"Ray launch stopped {seconds:.1f}s after the stop, checkpoint at step {stopped[0].step}")
    _no_ray_workers_left(runs.cluster, seconds=30)


@pytest.mark.e2e
def test_a_permanent_failure_is_not_retried_by_ray_with_the_driver_on_a_node_by_auto(runs, tmp_path):
    """The driver runs on the head node with ray.address 'auto' (no Ray Client): it finds the
    cluster that node runs, and both nodes' workers train until the injected bug."""
    cfg, url = runs.config("ray-bug", "ray", max_restarts=1, address="auto")
    bug = {"STOKER_FAULT": "raise:rank=1:step=3"}  # no ONCE file: it would fire on every try
    launcher, result, seen, lines = runs.launch(cfg, url, env=bug, on_node=0)
    assert any("Ray: 2 worker(s) on 2 CPU(s), 2 node(s)" in line for line in lines), lines[-30:]
    assert result.reason == "failed"
    error = launcher.classify_end(result)
    assert error is not None and not error.transient, error
    assert "injected fault" in str(error)
    # Ray restarted the group (max_failures 1), and the restarted workers ended at once
    assert max(event_losses(seen)) == 2
    _no_ray_workers_left(runs.cluster)


@pytest.mark.e2e
@pytest.mark.ray_instance  # with the Ray cluster's tests: one Ray on this machine at a time
def test_a_local_ray_is_started_when_no_address_is_given(tmp_path):
    """ray.address empty: the driver starts a Ray of its own for the launch and stops it. Run
    in a fresh network namespace where loopback is the only address (a local Ray also binds
    this machine's outward address otherwise). One worker: the subject is the Ray the driver
    starts, not the world size (two workers are the cluster tests')."""
    script = tmp_path / "local_ray.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {ROOT!r})
from tests.conftest import tiny_dict, prepare_shards
from stoker.config import load_config
from stoker.launch import make_launcher
cfg = load_config(tiny_dict("file://{tmp_path}/store", run_name="local-ray",
                            launch={{"launcher": "ray", "num_nodes": 1, "nproc_per_node": 1}}))
store, shards = prepare_shards(cfg)
store.write_bytes("runs/local-ray/config.json", cfg.to_json().encode())
launcher = make_launcher(cfg, store.url("runs/local-ray/config.json"), shards.key, None)
print("DESCRIPTION", launcher.description)
import threading, time
nice, done = set(), threading.Event()
def watch():  # the niceness the training workers run at
    while not done.wait(0.3):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                title = open(f"/proc/{{pid}}/cmdline", "rb").read()
                if b"RayTrainWorker" in title:
                    nice.add(os.getpriority(os.PRIO_PROCESS, int(pid)))
            except OSError:
                pass
threading.Thread(target=watch, daemon=True).start()
result = launcher.run(print, lambda e: print("EVENT", type(e).__name__))
done.set()
print("REASON", result.reason)
print("NICE", sorted(nice))
""")
    ns = f"stoker-lo-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, str(script)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", **TRAIN_ENV},
        )
    finally:
        subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert "REASON completed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "a local Ray on 127.0.0.1" in out.stdout
    assert out.stdout.count("EVENT Train") == 8 and "EVENT Done" in out.stdout
    # the local Ray's workers are this job's own work: nice 0 like torchrun's ranks, not Ray's 15
    assert "NICE [0]" in out.stdout, out.stdout[-2000:]


def test_the_ray_launcher_without_ray_is_one_config_error(monkeypatch, tmp_path):
    import importlib.util

    from stoker.failures import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict("file://" + str(tmp_path), launch={"launcher": "ray"}, data={"engine": "ray"}))
    assert err.value.problems == [
        "launch.launcher: 'ray' needs Ray, which is not installed here; pip install 'stoker[ray]', or use 'local'.",
        "data.engine: 'ray' needs Ray, which is not installed here; pip install 'stoker[ray]', or use 'local'.",
    ]


def test_the_launcher_is_chosen_by_the_config(tiny_config):
    cfg = tiny_config(launch={"launcher": "ray"}, ray={"address": "ray://10.0.0.1:10001"})
    launcher = make_launcher(cfg, "file:///s/runs/r/config.json", "shards/k", "runs/r/checkpoints/step-00000004")
    try:
        assert isinstance(launcher, RayLauncher)
        assert launcher.cmd[1:4] == ["-m", "stoker.training.ray_main", "--config"]
        assert launcher.cmd[-2:] == ["--resume-from", "runs/r/checkpoints/step-00000004"]
        assert "ray://10.0.0.1:10001" in launcher.description
    finally:
        import shutil

        shutil.rmtree(launcher.work_dir, ignore_errors=True)


def test_an_unreachable_cluster_is_said_as_such(tiny_config, tmp_path):
    """ray.address naming a port where no Ray listens: the driver fails at once and the launch's
    error names ray.address, not a lost rank."""
    cfg = tiny_config(launch={"launcher": "ray"}, ray={"address": "127.0.0.1:9"})
    config = tmp_path / "config.json"
    config.write_text(cfg.to_json())
    launcher = make_launcher(cfg, f"file://{config}", "shards/k", None)
    result, _, lines = run_collecting(launcher)
    error = launcher.classify_end(result)
    assert error is not None and str(error).startswith("the launch failed: ConnectionError: ray.address: "), (
        error,
        lines[-10:],
    )


LAUNCHER = """
import sys
from stoker.config import RunConfig
from stoker.launch import make_launcher
cfg = RunConfig.model_validate_json(open(sys.argv[1]).read())
make_launcher(cfg, sys.argv[2], sys.argv[3], None).run(lambda line: print(line, flush=True),
                                                       lambda event: None)
"""


@pytest.mark.e2e
def test_a_sigkilled_launcher_stops_the_ray_job_with_a_checkpoint_and_leaves_no_worker(runs, tmp_path):
    """The process running the Ray launcher SIGKILLed (the OOM killer): its driver gets the
    parent-death SIGTERM, relays the stop to the workers, which write a stop checkpoint, and
    Ray ends them. Before, the driver and its workers trained on with nobody listening."""
    import signal

    cfg, url = runs.config("ray-orphan", "ray")
    cfg.train.max_steps = 100_000
    runs.store.write_bytes("runs/ray-orphan/config.json", cfg.to_json().encode())
    (tmp_path / "config.json").write_text(cfg.to_json())
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        helper = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(tmp_path / "config.json"), url, runs.shard_key],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while find_latest_valid(runs.store, "ray-orphan").checkpoint is None:  # mid-training
            assert time.monotonic() < deadline and helper.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        helper.kill()
        helper.wait()
        _no_ray_workers_left(runs.cluster, seconds=150)  # the driver ends the job 45 s after the stop at most
        # the workers stopped at a step boundary and left a checkpoint to resume from (as a
        # cancel's, in tests/flows/test_cancel.py). The stop comes right after the first commit
        # here: on a loaded machine that commit took 6.7 s once, and the estimate (its time x
        # 1.5 + 1 s) no longer fit into the ranks' 12 s, so they kept the committed one
        assert_a_stop_left_a_resume_point(runs.store, "ray-orphan")
    finally:
        for pid in [helper.pid, *_drivers_of("runs/ray-orphan/config.json")]:  # a failed test's
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _drivers_of(marker: str) -> list[int]:
    from tests.conftest import live_processes

    return [p.pid for p in live_processes().values() if "training.ray_main" in p.cmdline and marker in p.cmdline]
