"""The hang watchdog with real torchrun ranks (gloo on CPU): a rank that stops stepping is
found, the whole gang is killed, the failure is transient, and a retry resumes and finishes."""

import os
import signal
import subprocess
import sys
import time

from stoker.launch.base import GangResult, classify_end
from stoker.launch.env import child_env
from stoker.launch.gang import GANG_ENV, GRACE_SECONDS, RANK_STOP_MARGIN_SECONDS, gang_pids, kill_gang, run_gang
from stoker.launch.torchrun import free_port, torchrun_commands
from stoker.storage.checkpoints import find_latest_valid
from tests.conftest import ROOT, GangWatch, prepare_shards, read_proc, wait_for_none


def _launch(cfg, config_url, shard_key, resume_key, env, watch) -> GangResult:
    """run_gang as launch_training calls it; every line and metric also records the
    processes of the run."""
    cmds = torchrun_commands(cfg, config_url, shard_key, resume_key, free_port())
    return run_gang(
        cmds,
        env,
        cfg.launch.nproc_per_node,
        on_line=watch.record,
        on_event=watch.record,
        timeout=240,
        hang_timeout=cfg.launch.hang_timeout_seconds,
    )


def test_hung_rank_is_killed_with_its_gang_and_the_retry_resumes(tiny_config, tmp_path):
    cfg = tiny_config(
        run_name="hang",
        train={"max_steps": 6},
        checkpoint={"interval_steps": 2},
        eval={"interval_steps": 100},
        launch={"hang_timeout_seconds": 8},
    )
    store, shards = prepare_shards(cfg)
    store.write_bytes("runs/hang/config.json", cfg.to_json().encode())
    config_url = store.url("runs/hang/config.json")
    env = {**child_env(cfg), "STOKER_FAULT": "hang:rank=1:step=3", "STOKER_FAULT_ONCE": str(tmp_path / "fault-fired")}

    watch = GangWatch(config_url)
    hung = _launch(cfg, config_url, shards.key, None, env, watch)
    assert hung.reason == "hang", "\n".join(hung.tail)
    assert (tmp_path / "fault-fired").exists()  # rank 1 did stop stepping
    err = classify_end(hung)
    assert err.transient and err.reason == "hang"
    assert "last step seen: step 2" in str(err)  # rank 1 froze before step 3

    # the whole gang is gone: agent and ranks (each rank is a session of its own)
    ranks = [
        p for p in watch.seen.values() if "torch.distributed.run" not in p.cmdline and "training.train" in p.cmdline
    ]
    assert len(ranks) == 2 and all(pid in watch.seen for pid in hung.pids)
    assert watch.gone_within() == []
    assert wait_for_none(lambda: gang_pids(hung.gang_id)) == []

    # the retry (same environment; the fault fires once) resumes from the newest valid
    # checkpoint and runs to the end
    choice = find_latest_valid(store, "hang")
    assert choice.checkpoint is not None and choice.checkpoint.step == 2
    watch = GangWatch(config_url)
    retry = _launch(cfg, config_url, shards.key, choice.checkpoint.key, env, watch)
    assert retry.reason == "completed", "\n".join(retry.tail)
    seen = {e.kind: e for e in retry.events}
    assert seen["resumed"].step == 2 and seen["done"].step == 6
    assert watch.gone_within() == []


def test_watchdog_arms_after_start_up_fires_on_silence_and_is_off_at_zero():
    # a silent start-up longer than the hang limit, then steps: not a hang (armed late)
    script = (
        "import time; from stoker.contracts import events as E; time.sleep(3); "
        "print(E.Eval(step=0, val_loss=5.0, val_ppl=148.0).encode(), flush=True); "
        "[print(E.Step(step=s).encode(), flush=True) for s in range(1,6)]"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = run_gang([[sys.executable, "-c", script]], env, 1, lambda s: None, lambda m: None, timeout=60, hang_timeout=2)
    assert res.reason == "completed" and res.last_step == 5
    # a gang that reports once and then goes silent: a hang; with 0 the watchdog is off
    silent = (
        "import time; from stoker.contracts import events as E; "
        "print(E.Eval(step=0, val_loss=5.0, val_ppl=148.0).encode(), flush=True); time.sleep(4)"
    )
    res = run_gang([[sys.executable, "-c", silent]], env, 1, lambda s: None, lambda m: None, timeout=60, hang_timeout=1)
    assert res.reason == "hang" and res.last_step is None
    assert "last step seen: none yet" in str(classify_end(res))
    res = run_gang([[sys.executable, "-c", silent]], env, 1, lambda s: None, lambda m: None, timeout=60, hang_timeout=0)
    assert res.reason == "completed"


def test_a_start_up_that_never_reports_is_killed_and_retried():
    """A gang whose rank 0 never reports (a rendezvous that never completes): with
    startup_timeout the gang is killed and the failure is transient; a start-up that reports
    in time is not affected, and the hang watchdog still arms only at the first report."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    stuck = "import time; time.sleep(60)"
    res = run_gang(
        [[sys.executable, "-c", stuck]],
        env,
        1,
        lambda s: None,
        lambda m: None,
        timeout=60,
        hang_timeout=1,
        startup_timeout=2,
    )
    assert res.reason == "startup"  # not "timeout": the start-up limit fired
    err = classify_end(res)
    assert err.transient and err.reason == "startup" and "launch.startup_timeout_seconds" in str(err)
    slow = (
        "import time; from stoker.contracts import events as E; time.sleep(2); "
        "print(E.Eval(step=0, val_loss=5.0, val_ppl=148.0).encode(), flush=True); "
        "[print(E.Step(step=s).encode(), flush=True) for s in range(1,4)]"
    )
    res = run_gang(
        [[sys.executable, "-c", slow]],
        env,
        1,
        lambda s: None,
        lambda m: None,
        timeout=60,
        hang_timeout=1,
        startup_timeout=20,
    )
    assert res.reason == "completed" and res.last_step == 3


def test_classify_end_of_a_hang_is_transient_and_names_the_last_step():
    err = classify_end(GangResult([-9, -9], "hang", 30.0, last_step=41, hang_timeout=20))
    assert err.transient and err.reason == "hang"
    assert "no step finished for 20s" in str(err) and "last step seen: step 41" in str(err)


def test_child_env_keeps_the_ranks_stop_budget_inside_the_launcher_grace(tiny_config, monkeypatch):
    assert GRACE_SECONDS + 5 < 30  # SIGTERM grace plus the SIGKILL wait fit Prefect's 30 s
    cfg = tiny_config()
    monkeypatch.delenv("STOKER_STOP_GRACE_SECONDS", raising=False)
    assert float(child_env(cfg)["STOKER_STOP_GRACE_SECONDS"]) == GRACE_SECONDS - RANK_STOP_MARGIN_SECONDS
    monkeypatch.setenv("STOKER_STOP_GRACE_SECONDS", "600")
    assert float(child_env(cfg)["STOKER_STOP_GRACE_SECONDS"]) < GRACE_SECONDS
    monkeypatch.setenv("STOKER_STOP_GRACE_SECONDS", "3")
    assert float(child_env(cfg)["STOKER_STOP_GRACE_SECONDS"]) == 3
    assert GANG_ENV not in child_env(cfg)  # each launch gets its own id, in run_gang


def test_kill_gang_finds_ranks_in_their_own_sessions_after_the_agent_died(tmp_path):
    """torchrun starts each rank with start_new_session=True: the agent's process group does
    not hold it, and once the agent is gone it is reparented. The gang id finds it."""
    pidfile = tmp_path / "rank.pid"
    code = (
        f"import subprocess,time; p=subprocess.Popen(['sleep','300'], start_new_session=True); "
        f"open({str(pidfile)!r},'w').write(str(p.pid)); time.sleep(300)"
    )
    env = {**os.environ, GANG_ENV: "test-gang-" + tmp_path.name}
    agent = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline, "the agent did not start its rank"
        time.sleep(0.05)
    rank = read_proc(int(pidfile.read_text()))
    assert rank is not None and rank.sid == rank.pid  # a session of its own
    os.kill(agent.pid, signal.SIGKILL)  # the agent dies first; the rank is orphaned
    agent.wait()
    assert gang_pids(env[GANG_ENV]) == [rank.pid]
    kill_gang([agent], grace=2, gang_id=env[GANG_ENV])

    def still_the_rank():
        now = read_proc(rank.pid)  # None when gone or a zombie; another start: a reused pid
        return [now] if now is not None and now.start == rank.start else []

    assert wait_for_none(still_the_rank) == []
    assert wait_for_none(lambda: gang_pids(env[GANG_ENV])) == []
