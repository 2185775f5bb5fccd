"""Nothing outlives its orchestrator: the CLI and its flow process SIGKILLed mid-training (the
OOM killer, a lost VM), the ranks and agents of the gang (in sessions of their own) and the
embedded Prefect server go within a bound, and a rerun resumes from the newest valid
checkpoint; a script that started the temporary server, SIGTERMed, leaves neither the server
nor a launch folder."""

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from stoker.process import lifeline
from stoker.storage.checkpoints import find_latest_valid
from stoker.storage.store import Store
from tests.conftest import ROOT, gang_members, live_processes, read_proc, seeded_prefect_home

pytestmark = pytest.mark.e2e

GONE_WITHIN_SECONDS = 90  # generous: the ranks stop within ~30 s even on a loaded host
# the agent once its ranks are gone: its lifeline's bound (process.lifeline.end_supervisor), and
# a margin for its watcher's polls on a busy host
AGENT_AFTER_RANKS_SECONDS = lifeline.SUPERVISOR_END_SECONDS + 15
TINY = [
    "data.max_bytes=300000",
    "data.val_fraction=0.1",
    "tokenizer.vocab_size=384",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.warmup_steps=2",
    "train.log_interval=1",
    "checkpoint.interval_steps=10",
    "eval.per_checkpoint_enabled=false",
    "eval.num_batches=2",
    "launch.max_attempts=1",
]


def _env(tmp_path) -> dict:
    env = {
        **os.environ,
        "STOKER_ROOT": str(tmp_path / "store"),
        "GLOO_SOCKET_IFNAME": "lo",
        "PREFECT_HOME": seeded_prefect_home(tmp_path / "prefect-home"),  # its database migrated already
        "PYTHONPATH": ROOT,
        "TMPDIR": str(tmp_path / "tmp"),
    }
    env.pop("PREFECT_API_URL", None)
    os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


def _cli(run: str, max_steps: int) -> list[str]:
    # a constant learning rate: the rerun ends the run early, which a cosine schedule refuses
    sets = [*TINY, f"run_name={run}", f"train.max_steps={max_steps}", "train.lr_schedule=constant"]
    return [sys.executable, "-m", "stoker.cli", "run", *[a for s in sets for a in ("--set", s)]]


def _gang_of(procs) -> str | None:
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                for item in f.read().split(b"\0"):
                    if item.startswith(b"STOKER_GANG_ID="):
                        return item.split(b"=", 1)[1].decode()
        except OSError:
            continue
    return None


def _wait(what: str, check, seconds: float, log=None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
    pytest.fail(f"gave up waiting for {what}\n{tail}")


def _tree(pid: int) -> dict:
    """Every live process below `pid`, by pid."""
    procs = live_processes()
    out, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for p in procs.values():
            if p.ppid == parent and p.pid not in out:
                out[p.pid] = p
                todo.append(p.pid)
    return out


@contextmanager
def _busy_cores():
    """Two cores (the CI host's) held busy by loops of pure Python, for the block's length."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


def _kill_all(procs) -> None:
    live = live_processes()
    for p in procs:
        if p.pid in live and live[p.pid].start == p.start:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sigkilled_cli_and_flow_process_leave_no_rank_agent_or_server_and_a_rerun_resumes(tmp_path, session_server_env):
    env, log = _env(tmp_path), tmp_path / "cli.log"
    store = Store("file://" + str(tmp_path / "store"))
    with open(log, "w") as out:
        cli = subprocess.Popen(
            _cli("orphans", 100_000), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    seen: dict = {}
    try:

        def training_with_a_checkpoint():
            seen.update(_tree(cli.pid))
            ranks = [
                p
                for p in seen.values()
                if "training.train" in p.cmdline and "torch.distributed.run" not in p.cmdline and read_proc(p.pid)
            ]
            return len(ranks) == 2 and find_latest_valid(store, "orphans").checkpoint

        _wait("training with a committed checkpoint", training_with_a_checkpoint, 400, log)
        flow_process = [p for p in seen.values() if p.ppid == cli.pid and "stoker.cli" in p.cmdline]
        servers = [p for p in seen.values() if "uvicorn" in p.cmdline]
        gang = _gang_of(p for p in seen.values() if "training.train" in p.cmdline)
        assert len(flow_process) == 1 and len(servers) == 1 and gang, seen
        agents_and_ranks = gang_members(gang)
        assert len(agents_and_ranks) >= 3  # the agent and its 2 ranks

        # the orchestrator only, as the OOM killer would: not the ranks, not the server; on a
        # busy host (both cores held busy until the gang is gone: the agent once outlived its
        # ranks there by 45 s and more, 1 try in 3; it ends now within SUPERVISOR_END_SECONDS)
        agents = [p.pid for p in seen.values() if "torch.distributed.run" in p.cmdline]
        assert agents, seen
        with _busy_cores():
            os.kill(cli.pid, signal.SIGKILL)
            os.kill(flow_process[0].pid, signal.SIGKILL)
            cli.wait(timeout=30)
            t0 = time.monotonic()

            def ranks_ended():  # when every member but the agent has gone
                return None if set(gang_members(gang)) - set(agents) else time.monotonic()

            ranks_gone = _wait("the ranks to end", ranks_ended, GONE_WITHIN_SECONDS, log)
            _wait("the agent to end", lambda: not gang_members(gang), AGENT_AFTER_RANKS_SECONDS, log)
        print(f"ranks gone {ranks_gone - t0:.1f} s, the agent {time.monotonic() - ranks_gone:.1f} s later")
        _wait("the embedded server to end", lambda: read_proc(servers[0].pid) is None, 30, log)
        assert [p for p in seen.values() if read_proc(p.pid) is not None and read_proc(p.pid).start == p.start] == []

        # a rerun resumes from the newest valid checkpoint, and finishes two steps later (on the
        # session's Prefect server: a second temporary one is not the subject)
        newest = find_latest_valid(store, "orphans").checkpoint
        assert newest is not None and newest.step > 0
        rerun_env = {**env, "PREFECT_API_URL": session_server_env["PREFECT_API_URL"]}
        rerun = subprocess.run(
            _cli("orphans", newest.step + 2), cwd=ROOT, env=rerun_env, capture_output=True, text=True, timeout=400
        )
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        assert f"run orphans: step {newest.step} -> {newest.step + 2}" in rerun.stdout, rerun.stdout[-3000:]
        # the killed launch's folder went with the rerun (its launcher's token is dead)
        assert list((tmp_path / "tmp").glob("stoker-launch-*")) == []
    finally:
        try:
            os.killpg(cli.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_all(seen.values())  # only if the test failed: leave nothing running


SCRIPT = """
from stoker.cli import config_from_args
from stoker.flows.pipeline import train_pipeline
import sys
train_pipeline(config_from_args("tiny-cpu", sys.argv[1:]))
"""


def test_sigtermed_script_leaves_no_server_no_gang_and_no_launch_folder(tmp_path):
    """A script (no CLI supervisor) that started the temporary server, SIGTERMed mid-training:
    the ranks stop as on a cancel, the launch folder is removed, the server goes at once."""
    env, log = _env(tmp_path), tmp_path / "script.log"
    sets = [*TINY, "run_name=script", "train.max_steps=100000"]
    with open(log, "w") as out:
        script = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, *sets],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seen: dict = {}
    try:

        def training():
            seen.update(_tree(script.pid))
            return (
                any("training.train" in p.cmdline for p in seen.values())
                and (tmp_path / "store" / "runs" / "script" / "metrics.jsonl").exists()
            )

        _wait("training", training, 400, log)
        servers = [p for p in seen.values() if "uvicorn" in p.cmdline]
        assert len(servers) == 1 and list((tmp_path / "tmp").glob("stoker-launch-*")), seen
        script.send_signal(signal.SIGTERM)
        script.wait(timeout=120)
        _wait("the embedded server to end", lambda: read_proc(servers[0].pid) is None, 15, log)
        _wait(
            "every process of the run to end",
            lambda: all(read_proc(p.pid) is None or read_proc(p.pid).start != p.start for p in seen.values()),
            30,
            log,
        )
        assert list((tmp_path / "tmp").glob("stoker-launch-*")) == []
        records = [
            json.loads(line)
            for line in (tmp_path / "store" / "runs" / "script" / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r for r in records if r["event"] == "stopped"], records[-5:]  # the cancel's stop path
    finally:
        try:
            os.killpg(script.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_all(seen.values())
