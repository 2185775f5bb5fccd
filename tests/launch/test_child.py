"""launch.child: one Python module in a process of its own, a gang of one. Real processes: a
module that starts a grandchild in a session of its own (out of the child's process group)."""

import os
import signal
import threading
import time

import pytest

from stoker.launch.child import Child
from stoker.launch.gang import GANG_ENV
from stoker.process import lifeline
from tests.conftest import read_proc, wait_for_none

MODULE = """
import os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(grandchild.pid, flush=True)
print("started", file=sys.stderr, flush=True)
time.sleep(float(sys.argv[1]))
print("done", flush=True)
"""


@pytest.fixture
def module_env(tmp_path):
    (tmp_path / "stoker_child_probe.py").write_text(MODULE)
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def _pids_of(child: Child, out: str) -> list[int]:
    return [child.pid] + [int(line) for line in out.split() if line.isdigit()]


def _alive(pids):
    return lambda: [p for p in pids if read_proc(p)]


def test_a_child_that_ends_gives_its_exit_code_and_both_outputs_apart(module_env):
    child = Child("stoker_child_probe", ["0"], module_env)
    ended = child.run(timeout=60)
    assert ended.returncode == 0 and not ended.timed_out and not ended.killed
    assert ended.out.split()[-1] == "done" and ended.err.strip() == "started"
    assert child.env[GANG_ENV] == child.gang_id and child.env[lifeline.LAUNCHER_ENV] == lifeline.token()
    assert not wait_for_none(_alive(_pids_of(child, ended.out)))  # what it left behind is killed too


def test_a_child_past_its_time_limit_is_killed_with_what_it_started(module_env):
    child = Child("stoker_child_probe", ["120"], module_env)
    t0 = time.monotonic()
    ended = child.run(timeout=3)
    assert ended.timed_out and ended.returncode == -signal.SIGKILL and time.monotonic() - t0 < 30
    assert not wait_for_none(_alive(_pids_of(child, ended.out)))


def test_a_child_killed_from_another_thread_says_so(module_env):
    child = Child("stoker_child_probe", ["120"], module_env)
    with child:
        threading.Timer(2.0, child.kill).start()
        ended = child.wait(timeout=60)
    assert ended.killed and not ended.timed_out and ended.returncode == -signal.SIGKILL
    assert ended.stop_signal is None  # a SIGKILL is no one's SIGINT or SIGTERM


def test_an_exception_in_the_waiting_thread_kills_the_child(module_env):
    child = Child("stoker_child_probe", ["120"], module_env)
    with pytest.raises(KeyboardInterrupt):
        with child:
            time.sleep(1.0)
            raise KeyboardInterrupt  # Ctrl-C, or a SIGTERM handler's exception
    assert child.proc.returncode == -signal.SIGKILL
    assert not wait_for_none(_alive([child.pid]))


def test_a_child_ended_by_sigterm_is_told_apart_as_a_stop(module_env):
    child = Child("stoker_child_probe", ["120"], module_env)
    with child:
        threading.Timer(2.0, os.killpg, (child.pid, signal.SIGTERM)).start()
        ended = child.wait(timeout=60)
    assert ended.stop_signal == "SIGTERM" and not ended.killed
