import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from core import events
from launch.base import GangResult, classify
from launch.gang import kill_gang, run_gang
from launch.torchrun import NodeSpec, TorchrunLauncher

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
    code = (f"import subprocess,time; p=subprocess.Popen(['sleep','300']); "
            f"open({str(pidfile)!r},'w').write(str(p.pid)); time.sleep(300)")
    agent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 20
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pidfile.read_text())
    kill_gang([agent], grace=2)
    assert not _alive(agent.pid) and not _alive(child)


def test_run_gang_streams_rank_prefixed_lines_and_metrics():
    script = (f"print('[default0]:hello'); print({'[default1]:' + TRAIN.encode()!r});"
              "print('plain agent line')")
    lines, metrics = [], []
    res = run_gang([[sys.executable, "-c", script]] * 2, dict(os.environ), 2, lines.append,
                   metrics.append, timeout=30)
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
    bug = GangResult([1], "failed", 1.0, failures=[
        events.Failure(rank=1, type="DistBackendError", message="peer gone", transient=True),
        events.Failure(rank=0, type="ZeroDivisionError", message="boom", transient=False)])
    err = classify(bug)
    assert not err.transient and "ZeroDivisionError" in str(err)
    killed = GangResult([1], "failed", 1.0, lost_ranks=[1])  # its folder holds no error file
    assert classify(killed).transient
    assert classify(GangResult([-signal.SIGKILL], "failed", 1.0)).transient
    assert classify(GangResult([None], "timeout", 5.0)).transient
    assert not classify(GangResult([1], "failed", 1.0, tail=["Traceback", "KeyError: 'x'"])).transient


def test_node_specs_place_each_agent_and_say_which_node_hosts_the_rendezvous(tiny_config):
    cfg = tiny_config(launch={"num_nodes": 2, "nproc_per_node": 1, "rdzv_host": "198.51.100.10"})
    specs = [NodeSpec(prefix=("ip", "netns", "exec", f"n{i}"), address=f"198.51.100.1{i}",
                      env={"GLOO_SOCKET_IFNAME": f"veth{i}", "STOKER_CACHE": f"/cache/{i}"}) for i in range(2)]
    launcher = TorchrunLauncher(cfg, "file:///s/runs/r/config.json", "shards/k", None, nodes=specs, rdzv_port=29500)
    try:
        first, second = launcher.cmds
        assert first[:4] == ["ip", "netns", "exec", "n0"] and first[4:7] == [sys.executable, "-m", "torch.distributed.run"]
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
