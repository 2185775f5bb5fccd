"""process.lifeline with real processes: tokens, the parent-death signal across a new session,
the heartbeat, and a module run under a lifeline (Prefect's embedded server is run so)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from stoker.process import lifeline
from tests.conftest import ROOT, read_proc


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if read_proc(pid) is None:
            return True
        time.sleep(0.1)
    return False


def test_a_token_tells_a_live_process_from_a_dead_one_and_a_reused_pid():
    child = subprocess.Popen(["sleep", "30"])
    try:
        token = lifeline.token(child.pid)
        assert lifeline.token_alive(token) is True
        where, _, start = token.rpartition("/")
        assert lifeline.token_alive(f"{where}/{int(start) + 1}") is False  # same pid, another process
        assert lifeline.token_alive("another-boot/pid:[1]/1/5") is None  # another machine: cannot tell
        assert not lifeline.token_gone(token)
        assert lifeline.token_gone(f"{where}/{int(start) + 1}")
        # gone only where this host can tell: never for another machine's, an empty or a bad token
        assert not any(lifeline.token_gone(t) for t in ("another-boot/pid:[1]/1/5", "", "junk"))
    finally:
        child.kill()
        child.wait()
    assert lifeline.token_alive(token) is False and lifeline.token_gone(token)


# the middle process starts a grandchild in a session of its own (as torchrun starts ranks),
# with the parent-death signal set, prints its pid and waits
MIDDLE = """
import os, subprocess, sys, time
from stoker.process import lifeline
me = os.getpid()
p = subprocess.Popen(["sleep", "60"], start_new_session=True,
                     preexec_fn=lambda: lifeline.set_parent_death_signal(parent=me))
print(p.pid, flush=True)
time.sleep(60)
"""


def test_the_parent_death_signal_reaches_a_child_in_a_session_of_its_own():
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    grandchild = int(middle.stdout.readline())
    try:
        assert read_proc(grandchild) is not None
        middle.kill()  # SIGKILL: no handler, no atexit
        middle.wait()
        assert _wait_gone(grandchild, 10), "the grandchild outlived its parent"
    finally:
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_heartbeat_counts_once_seen_and_goes_stale_when_it_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(lifeline, "HEARTBEAT_SECONDS", 0.1)
    path = str(tmp_path / "heartbeat")
    watch = lifeline.Lifeline(lambda reason: None, heartbeat=path, heartbeat_timeout=3.0)
    time.sleep(1.5)
    assert watch.check() is None  # never seen (another machine, no shared folder): no verdict
    beat = lifeline.Heartbeat(path).start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # beating: never stale, however long
        assert watch.check() is None
        time.sleep(0.2)
    beat.stop()
    deadline = time.monotonic() + 15
    while (reason := watch.check()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert reason and "heartbeat" in reason


@pytest.mark.parametrize("quiet", [False, True])
def test_a_module_run_under_a_lifeline_ends_with_the_process_it_names(quiet):
    starter = subprocess.Popen(["sleep", "60"])
    served = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stoker.process.lifeline",
            *(["--quiet"] if quiet else []),
            lifeline.token(starter.pid),
            "http.server",
            "0",
            "--bind",
            "127.0.0.1",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2)
        assert served.poll() is None  # runs while its starter lives
        starter.kill()
        starter.wait()
        served.wait(timeout=20)
        said = served.stderr.read()
        assert ("stopping: the launcher" in said) is not quiet, said
    finally:
        served.kill()
        starter.kill()


def test_a_child_starts_with_no_signal_blocked_whatever_its_forking_thread_blocks():
    """A thread that blocked SIGINT and SIGTERM (as a library may, around its own work) passes
    that mask to what it forks; lifeline.start_child, every stoker child's preexec_fn, clears it."""
    import signal
    import threading

    def masks(preexec):
        out = {}

        def fork_from_a_blocking_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            p = subprocess.Popen(["sleep", "30"], start_new_session=True, preexec_fn=preexec)
            with open(f"/proc/{p.pid}/status") as f:
                out.update(line.split(":\t") for line in f.read().splitlines() if line.startswith("SigBlk"))
            p.kill()
            p.wait()

        t = threading.Thread(target=fork_from_a_blocking_thread)
        t.start()
        t.join()
        return int(out["SigBlk"], 16)

    both = 1 << (signal.SIGINT - 1) | 1 << (signal.SIGTERM - 1)
    assert masks(None) & both == both  # what a plain Popen passes on
    me = os.getpid()
    assert masks(lambda: lifeline.start_child(parent=me)) == 0


def test_a_child_does_not_inherit_sigint_or_sigterm_ignored():
    """A process started as a shell's background job (`make test &`, `nohup stoker run &`)
    ignores SIGINT, and an ignored signal stays ignored across fork and exec: an evaluation
    started from it could not be ended by SIGINT while it waited on its config. start_child
    sets both stop signals back to their default action; other ignored signals stay as they
    are (SIGHUP under nohup)."""
    import signal

    def ignored(preexec) -> int:
        p = subprocess.Popen(["sleep", "30"], start_new_session=True, preexec_fn=preexec)
        try:
            with open(f"/proc/{p.pid}/status") as f:
                return int(next(line for line in f if line.startswith("SigIgn")).split(":\t")[1], 16)
        finally:
            p.kill()
            p.wait()

    bits = {sig: 1 << (sig - 1) for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)}
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in bits}
    try:
        plain = ignored(None)
        me = os.getpid()
        started = ignored(lambda: lifeline.start_child(parent=me))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert all(plain & bit for bit in bits.values()), hex(plain)  # what a plain Popen passes on
    assert not started & (bits[signal.SIGINT] | bits[signal.SIGTERM]), hex(started)
    assert started & bits[signal.SIGHUP], hex(started)


# a torchrun agent stuck where no signal reaches it, with one rank in a session of its own that
# stops as on a cancel (a marker, then exit) when SIGTERMed
STUCK_AGENT = """
import os, signal, subprocess, sys, threading
RANK = '''
import signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write("stopped")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(0.1)
'''
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, "-c", RANK, sys.argv[1]], start_new_session=True)
print(rank.pid, flush=True)
threading.Event().wait()
"""


def test_a_supervisor_whose_launcher_is_gone_stops_its_children_then_ends_whatever_it_waits_on(tmp_path):
    """The module runner that runs torchrun's agent watches the launcher its environment names:
    once that is gone, the agent's ranks are SIGTERMed (their stop checkpoint) and the agent
    ends SUPERVISOR_END_SECONDS after them, here with its main thread blocked for good."""
    (tmp_path / "stuck_agent.py").write_text(STUCK_AGENT)
    launcher = subprocess.Popen(["sleep", "60"])
    agent = subprocess.Popen(
        [sys.executable, "-m", "stoker.process.quick_exit", "stuck_agent", str(tmp_path / "stopped")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)]),
            lifeline.LAUNCHER_ENV: lifeline.token(launcher.pid),
        },
    )
    rank = int(agent.stdout.readline())
    try:
        time.sleep(1.5)
        assert agent.poll() is None and read_proc(rank) is not None  # both run while the launcher lives
        launcher.kill()
        launcher.wait()
        _, err = agent.communicate(timeout=lifeline.SUPERVISOR_END_SECONDS + 30)
        assert agent.returncode == 128 + signal.SIGTERM and "stopping: the launcher" in err, err
        assert _wait_gone(rank, 5) and (tmp_path / "stopped").read_text() == "stopped"
    finally:
        agent.kill()
        launcher.kill()
        try:
            os.kill(rank, signal.SIGKILL)
        except ProcessLookupError:
            pass
