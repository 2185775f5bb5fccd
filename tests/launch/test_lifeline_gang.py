"""A torchrun gang outlives neither its launcher nor its launch folder: the launching process
and the agent SIGKILLed together (no parent-death signal can help the ranks then: their
parent, the agent, is gone too), the ranks notice through the launcher's token and stop as a
cancel stops them; and a launch interrupted in Python removes its folder."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stoker.config import load_config
from stoker.launch import make_launcher
from stoker.storage.checkpoints import find_latest_valid
from tests.conftest import ROOT, gang_members, live_processes, prepare_shards, read_proc, tiny_dict, wait_for_none
from tests.launch.conftest import NETNS_GROUP

LAUNCHER = """
import sys
from stoker.config import RunConfig
from stoker.launch import make_launcher
cfg = RunConfig.model_validate_json(open(sys.argv[1]).read())
launcher = make_launcher(cfg, sys.argv[2], sys.argv[3], None)
launcher.run(lambda line: print(line, flush=True), lambda event: None)
"""


def _environ(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode(errors="replace").split("=", 1) for item in f.read().split(b"\0") if b"=" in item)


@pytest.mark.e2e
def test_ranks_stop_as_on_a_cancel_when_their_launcher_and_agent_are_sigkilled(tmp_path):
    root = "file://" + str(tmp_path / "store")
    cfg = load_config(
        tiny_dict(
            root,
            run_name="lifeline",
            train={"max_steps": 100_000},
            checkpoint={"interval_steps": 10},
            eval={"per_checkpoint_enabled": False, "interval_steps": 100_000},
        )
    )
    store, shards = prepare_shards(cfg)
    store.write_bytes("runs/lifeline/config.json", cfg.to_json().encode())
    (tmp_path / "config.json").write_text(cfg.to_json())
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCHER,
            str(tmp_path / "config.json"),
            store.url("runs/lifeline/config.json"),
            shards.key,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "lo"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (find_latest_valid(store, "lifeline").checkpoint and len(ranks) == 2):
            assert time.monotonic() < deadline and launcher.poll() is None, (tmp_path / "launcher.log").read_text()[
                -3000:
            ]
            ranks = [
                p.pid
                for p in live_processes().values()
                if "training.train" in p.cmdline
                and "torch.distributed.run" not in p.cmdline
                and p.cmdline.endswith(shards.key)
                and read_proc(p.ppid)
                and "torch.distributed.run" in read_proc(p.ppid).cmdline
            ]
            time.sleep(0.5)
        agent = read_proc(ranks[0]).ppid
        gang_id = _environ(ranks[0])["STOKER_GANG_ID"]
        os.kill(launcher.pid, signal.SIGKILL)
        os.kill(agent, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 90  # they stop within ~30 s; generous for a loaded host
        while gang_members(gang_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert gang_members(gang_id) == [], (tmp_path / "launcher.log").read_text()[-3000:]
        records = [json.loads(line) for line in store.read_bytes("runs/lifeline/metrics.jsonl").splitlines()]
        assert [r for r in records if r["event"] == "stopped"], records[-5:]  # the cancel's path
    finally:
        for pid in [launcher.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def test_a_launch_interrupted_in_python_removes_its_folder_and_its_gang(tmp_path):
    cfg = load_config(tiny_dict("file://" + str(tmp_path / "store"), run_name="interrupted"))
    launcher = make_launcher(cfg, "file:///nowhere/config.json", "no-shards", None)
    assert os.path.isdir(launcher.work_dir)

    def interrupt(line):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launcher.run(interrupt, lambda event: None)
    assert not os.path.exists(launcher.work_dir)
    assert wait_for_none(lambda: gang_members(launcher.gang.gang_id)) == []


def test_a_new_launch_removes_the_folders_of_launchers_that_died_without_removing_them(tmp_path, monkeypatch):
    from stoker.launch.gang import make_work_dir
    from stoker.process import lifeline

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, owner in (
        ("stoker-launch-dead", lifeline.token(dead.pid)),
        ("stoker-launch-live", lifeline.token()),
        ("stoker-launch-elsewhere", "another-boot/pid:[1]/1/5"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "launcher").write_text(owner.replace("/None", "/1"))
    (tmp_path / "stoker-launch-untokened").mkdir()
    made = make_work_dir("stoker-launch-")
    left = sorted(p.name for p in tmp_path.glob("stoker-launch-*"))
    assert left == sorted(
        ["stoker-launch-live", "stoker-launch-elsewhere", "stoker-launch-untokened", os.path.basename(made)]
    )


@pytest.mark.e2e
@pytest.mark.xdist_group(NETNS_GROUP)  # on the worker that has the netns cluster (tests/launch/conftest.py)
def test_agents_in_network_namespaces_and_their_ranks_end_with_a_sigkilled_launcher(cluster, tmp_path):
    """Two nodes, each `ip netns exec <ns> torchrun ...` (a network namespace of its own, the
    same kernel and /proc), placed by launch.nodes: the launcher SIGKILLed, both agents get
    the parent-death signal through `ip netns exec` (it execs), the ranks see the launcher's
    token gone; the ranks stop as on a cancel."""
    cfg, url = cluster.config("mn-orphans", nproc=1, max_steps=100_000, nodes_in_config=True)
    (tmp_path / "config.json").write_text(cfg.to_json())
    log = open(tmp_path / "launcher.log", "w")
    helper = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "config.json"), url, cluster.shard_key],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    gang_id = None
    try:
        deadline = time.monotonic() + 300
        while find_latest_valid(cluster.store, "mn-orphans").checkpoint is None:
            assert time.monotonic() < deadline and helper.poll() is None, (tmp_path / "launcher.log").read_text()[
                -3000:
            ]
            time.sleep(0.5)
        agents = [p for p in live_processes().values() if p.ppid == helper.pid]
        gang_id = _environ(agents[0].pid)["STOKER_GANG_ID"]
        assert len(agents) == 2 and len(gang_members(gang_id)) == 4  # 2 agents, 1 rank each
        helper.kill()
        helper.wait()
        deadline = time.monotonic() + 90
        while gang_members(gang_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert gang_members(gang_id) == [], (tmp_path / "launcher.log").read_text()[-3000:]
        records = [json.loads(line) for line in cluster.store.read_bytes("runs/mn-orphans/metrics.jsonl").splitlines()]
        assert [r for r in records if r["event"] == "stopped"], records[-5:]
    finally:
        for pid in [helper.pid, *(gang_members(gang_id) if gang_id else [])]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
