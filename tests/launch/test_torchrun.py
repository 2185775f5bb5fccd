import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from stoker.config import load_config
from stoker.contracts import events
from stoker.launch import make_launcher
from stoker.launch.base import GangResult, classify_end
from stoker.launch.gang import kill_gang, run_gang
from stoker.launch.torchrun import AGENT, NodeSpec, TorchrunLauncher, read_error_files
from tests.conftest import prepare_shards, tiny_dict, wait_for_none

TRAIN = events.Train(step=1, loss=2.5, lr=1e-3, step_seconds=0.1, tokens_seen=64, time=1.0)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent has not reaped it yet
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_kill_gang_takes_the_agent_and_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (
        f"import subprocess,time; p=subprocess.Popen(['sleep','300']); "
        f"open({str(pidfile)!r},'w').write(str(p.pid)); time.sleep(300)"
    )
    agent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 20
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pidfile.read_text())
    kill_gang([agent], grace=2)
    assert wait_for_none(lambda: [p for p in (agent.pid, child) if _alive(p)]) == []


def test_run_gang_streams_rank_prefixed_lines_and_metrics():
    script = f"print('[default0]:hello'); print({'[default1]:' + TRAIN.encode()!r});print('plain agent line')"
    lines, metrics = [], []
    res = run_gang([[sys.executable, "-c", script]] * 2, dict(os.environ), 2, lines.append, metrics.append, timeout=30)
    assert res.reason == "completed" and res.returncodes == [0, 0]
    assert "[rank 0] hello" in lines and "[rank 2] hello" in lines and "[node 1] plain agent line" in lines
    assert metrics == [TRAIN] * 2


def test_one_dead_agent_stops_the_gang():
    fast_fail = [sys.executable, "-c", "import sys; sys.exit(3)"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    t0 = time.monotonic()
    res = run_gang([fast_fail, sleeper], dict(os.environ), 1, lambda s: None, lambda m: None, timeout=100)
    assert res.reason == "failed" and time.monotonic() - t0 < 60


def test_classification_rank_error_is_permanent_signal_is_transient():
    bug = GangResult(
        [1],
        "failed",
        1.0,
        failures=[
            events.Failure(rank=1, type="DistBackendError", message="peer gone", transient=True),
            events.Failure(rank=0, type="ZeroDivisionError", message="boom", transient=False),
        ],
    )
    err = classify_end(bug)
    assert not err.transient and "ZeroDivisionError" in str(err)
    killed = GangResult([1], "failed", 1.0, lost_ranks=[1])  # its folder holds no error file
    assert classify_end(killed).transient
    assert classify_end(GangResult([-signal.SIGKILL], "failed", 1.0)).transient
    assert classify_end(GangResult([None], "timeout", 5.0)).transient
    assert not classify_end(GangResult([1], "failed", 1.0, tail=["Traceback", "KeyError: 'x'"])).transient


def test_a_failure_for_good_is_the_reason_alone_in_one_line():
    """The `stoker:` line of a run that failed for good: the first rank's reason, once, in one
    line (the ranks' output, tracebacks and torchrun's dump stay in the log), not the restarted
    ranks' FailedBefore repeating it."""
    nested = "not restarted: rank 0 failed with NonFiniteError: non-finite loss at step 3"
    dump = [f"[rank1]: line {i}" for i in range(40)] + ["Root Cause (first observed failure):"]
    result = GangResult(
        [1, 1],
        "failed",
        1.0,
        tail=dump,
        failures=[
            events.Failure(rank=1, type="FailedBefore", message=nested, transient=False),
            events.Failure(
                rank=0, type="NonFiniteError", message="non-finite loss at step 3\n  details", transient=False
            ),
        ],
    )
    err = str(classify_end(result))
    assert "\n" not in err and "Root Cause" not in err and "FailedBefore" not in err
    assert err.startswith("rank 0 raised NonFiniteError: non-finite loss at step 3 (not retried")
    assert err.endswith("The ranks' whole output is in the log above (lines [rank N]).")
    bare = str(classify_end(GangResult([1], "failed", 1.0, tail=["Traceback", "KeyError: 'x'", ""])))
    assert bare.startswith("training exited with an error (not retried): its last line: KeyError: 'x'.")


def test_node_specs_place_each_agent_and_say_which_node_hosts_the_rendezvous(tiny_config):
    cfg = tiny_config(launch={"num_nodes": 2, "nproc_per_node": 1, "rdzv_host": "198.51.100.10"})
    specs = [
        NodeSpec(
            prefix=("ip", "netns", "exec", f"n{i}"),
            address=f"198.51.100.1{i}",
            env={"GLOO_SOCKET_IFNAME": f"veth{i}", "STOKER_CACHE": f"/cache/{i}"},
        )
        for i in range(2)
    ]
    launcher = TorchrunLauncher(cfg, "file:///s/runs/r/config.json", "shards/k", None, nodes=specs, rdzv_port=29500)
    try:
        first, second = launcher.cmds
        assert first[:4] == ["ip", "netns", "exec", "n0"] and tuple(first[4:8]) == AGENT
        for cmd, addr, host in ((first, "198.51.100.10", "true"), (second, "198.51.100.11", "false")):
            assert "--rdzv-endpoint=198.51.100.10:29500" in cmd
            assert f"--local-addr={addr}" in cmd and f"--rdzv-conf=is_host={host}" in cmd
        envs = launcher.gang.envs
        assert [e["GLOO_SOCKET_IFNAME"] for e in envs] == ["veth0", "veth1"]
        assert [e["STOKER_CACHE"] for e in envs] == ["/cache/0", "/cache/1"]
        assert all(e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" for e in envs)  # a store per round
        assert "ip netns" not in launcher.description  # the torchrun command, as every node runs it
    finally:
        shutil.rmtree(launcher.work_dir, ignore_errors=True)
    with pytest.raises(ValueError, match="give one per node"):
        TorchrunLauncher(cfg, "file:///s/runs/r/config.json", "shards/k", None, nodes=specs[:1])
    with pytest.raises(ValueError, match="not an address of this host"):  # no port can be chosen here
        TorchrunLauncher(cfg, "file:///s/runs/r/config.json", "shards/k", None, nodes=specs)


def test_launch_nodes_in_the_config_place_each_agent_through_make_launcher(tiny_config):
    """launch.nodes and launch.rdzv_port, as the flow gives them: make_launcher builds the same
    commands the NodeSpecs above do; the prefix is a list, exec'd as is."""
    nodes = [
        {
            "prefix": ["srun", "--nodes=1", "--ntasks=1", f"--nodelist=host{i}"],
            "address": f"198.51.100.1{i}",
            "env": {"NCCL_SOCKET_IFNAME": "eth1", "STOKER_CACHE": f"/cache/{i}"},
        }
        for i in range(2)
    ]
    cfg = tiny_config(
        launch={"num_nodes": 2, "nproc_per_node": 1, "rdzv_host": "198.51.100.11", "rdzv_port": 29400, "nodes": nodes}
    )
    launcher = make_launcher(cfg, "file:///s/runs/r/config.json", "shards/k", None)
    try:
        assert isinstance(launcher, TorchrunLauncher)
        for i, cmd in enumerate(launcher.cmds):
            assert cmd[:4] == nodes[i]["prefix"] and tuple(cmd[4:8]) == AGENT
            assert "--rdzv-endpoint=198.51.100.11:29400" in cmd and f"--local-addr=198.51.100.1{i}" in cmd
            assert f"--rdzv-conf=is_host={'true' if i == 1 else 'false'}" in cmd  # node 1 hosts it
        assert [e["STOKER_CACHE"] for e in launcher.gang.envs] == ["/cache/0", "/cache/1"]
        assert all(e["NCCL_SOCKET_IFNAME"] == "eth1" for e in launcher.gang.envs)
        assert all("STOKER_CPU_THREADS" not in e for e in launcher.gang.envs)  # their own cores
    finally:
        shutil.rmtree(launcher.work_dir, ignore_errors=True)


def test_agents_sharing_this_host_share_its_cores(tiny_config, monkeypatch):
    """2 simulated nodes x 1 rank take the threads 1 node x 2 ranks takes (a rank alone on its
    agent would take every core: 4 threads on 2 cores, 7-10x slower in bench_multinode)."""
    monkeypatch.delenv("STOKER_CPU_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    cfg = tiny_config(launch={"num_nodes": 2, "nproc_per_node": 1})
    launcher = TorchrunLauncher(cfg, "file:///s/runs/r/config.json", "shards/k", None)
    try:
        assert [e["STOKER_CPU_THREADS"] for e in launcher.gang.envs] == ["4", "4"]
    finally:
        shutil.rmtree(launcher.work_dir, ignore_errors=True)
    alone = TorchrunLauncher(
        tiny_config(launch={"num_nodes": 1, "nproc_per_node": 2}), "file:///s/runs/r/config.json", "shards/k", None
    )
    try:  # one agent: the ranks divide the cores among themselves (training.distributed)
        assert all("STOKER_CPU_THREADS" not in e for e in alone.gang.envs)
    finally:
        shutil.rmtree(alone.work_dir, ignore_errors=True)


def _rank_folder(log_dir, node: int, local_rank: int, rank: int | None, raised: bool = False):
    folder = log_dir / f"node-{node}" / "run_abc" / "attempt_0" / str(local_rank)
    folder.mkdir(parents=True)
    if rank is not None:
        (folder / events.RANK_FILE).write_text(
            json.dumps({"rank": rank, "group_rank": rank // 2, "local_rank": local_rank})
        )
    if raised:
        failure = events.Failure(rank=rank, type="DistBackendError", message="peer gone", transient=True)
        (folder / "error.json").write_text(
            json.dumps(
                {
                    "message": {
                        "message": "DistBackendError: peer gone",
                        "extraInfo": {events.ERROR_INFO_KEY: failure.to_dict()},
                    }
                }
            )
        )


def test_lost_ranks_are_the_ranks_own_numbers_not_the_launch_order(tmp_path):
    """c10d sorts the nodes by address: the node launched second can be group rank 0. Its
    ranks said so in their rank files; a rank folder without one falls back to the order."""
    _rank_folder(tmp_path, node=0, local_rank=0, rank=2)  # killed
    _rank_folder(tmp_path, node=0, local_rank=1, rank=3, raised=True)
    _rank_folder(tmp_path, node=1, local_rank=0, rank=0, raised=True)
    _rank_folder(tmp_path, node=1, local_rank=1, rank=1)  # killed
    failures, lost, agents = read_error_files(str(tmp_path), nproc_per_node=2)
    assert sorted(lost) == [1, 2] and sorted(f.rank for f in failures) == [0, 3] and agents == []
    _rank_folder(tmp_path, node=2, local_rank=0, rank=None)  # killed before it wrote its numbers
    assert sorted(read_error_files(str(tmp_path), nproc_per_node=2)[1]) == [1, 2, 4]


def test_a_killed_rank_is_reported_as_its_own_rank_when_c10d_orders_the_nodes_otherwise(tmp_path):
    """Two nodes on this host, placed by launch.nodes at 127.0.0.9 and 127.0.0.10: c10d sorts
    the addresses as strings, so node 1 (127.0.0.10) is group rank 0 and the rank of node 0 is
    global rank 1. That rank SIGKILLs itself; the launcher must name rank 1 as lost, where
    node x nproc + local rank says 0."""
    root = "file://" + str(tmp_path / "store")
    cfg = load_config(
        tiny_dict(
            root,
            run_name="order",
            train={"max_steps": 4},
            eval={"per_checkpoint_enabled": False, "interval_steps": 100},
            launch={
                "num_nodes": 2,
                "nproc_per_node": 1,
                "max_restarts": 0,
                "rdzv_host": "127.0.0.9",
                "nodes": [{"address": f"127.0.0.{a}", "env": {"GLOO_SOCKET_IFNAME": "lo"}} for a in (9, 10)],
            },
        )
    )
    store, shards = prepare_shards(cfg)
    store.write_bytes("runs/order/config.json", cfg.to_json().encode())
    env = {"STOKER_FAULT": "kill:rank=1:step=2", "STOKER_FAULT_ONCE": str(tmp_path / "fired")}
    launcher = make_launcher(cfg, store.url("runs/order/config.json"), shards.key, None)
    for e in launcher.gang.envs:
        e.update(env)
    lines: list[str] = []
    result = launcher.run(lines.append, lambda e: None)
    assert (tmp_path / "fired").exists(), "\n".join(lines[-40:])
    assert result.lost_ranks == [1], (result.lost_ranks, lines[-40:])
    assert [f.rank for f in result.failures] == [0]  # its peer saw the loss and said so
    # the live log names each line's rank as the rank said it (a Joined event), not by order
    assert "[rank 1] injected fault: kill at step 2 on rank 1" in lines, lines[-40:]
    assert launcher.classify_end(result).reason == "lost-rank"
