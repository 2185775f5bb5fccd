"""process.quick_exit: a process ends without the interpreter's teardown, but after what a normal
exit does that anyone sees: its non-daemon threads finish, its atexit handlers run, its buffered
stdout reaches the pipe, and its exit code is the one asked for; `python -m
stoker.process.quick_exit <module>` runs a module as `python -m` would, keeps its exit codes and
ends so however the module ends."""

import os
import signal
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from stoker.process.quick_exit import quick_exit

    def late():
        time.sleep(0.3)
        open(sys.argv[1], "w").write("written")

    threading.Thread(target=late).start()  # not a daemon: waited for
    atexit.register(lambda: print("atexit ran", end=""))
    print("buffered ", end="")  # no newline, stdout a pipe: still in the buffer
    quick_exit(3)
    """
)


def _run(args, tmp_path):
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)])},
    )


def test_a_quick_exit_keeps_threads_atexit_output_and_the_code(tmp_path):
    out = _run(["-c", CHILD, str(tmp_path / "late.txt")], tmp_path)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "buffered atexit ran"
    assert (tmp_path / "late.txt").read_text() == "written"


def test_the_runner_keeps_a_modules_exit_codes_and_tracebacks(tmp_path):
    (tmp_path / "ok_mod.py").write_text("print('ran as', __name__)\n")
    (tmp_path / "exit_mod.py").write_text("import sys\nsys.exit(4)\n")
    (tmp_path / "said_mod.py").write_text("import sys\nsys.exit('a reason')\n")
    (tmp_path / "raise_mod.py").write_text("raise RuntimeError('boom')\n")
    runner = ["-m", "stoker.process.quick_exit"]

    ok = _run([*runner, "ok_mod", "--flag"], tmp_path)
    assert (ok.returncode, ok.stdout) == (0, "ran as __main__\n")
    assert _run([*runner, "exit_mod"], tmp_path).returncode == 4
    said = _run([*runner, "said_mod"], tmp_path)  # Python's own way: the reason on stderr, 1
    assert said.returncode == 1 and said.stderr.strip() == "a reason"
    raised = _run([*runner, "raise_mod"], tmp_path)
    assert raised.returncode == 1 and "RuntimeError: boom" in raised.stderr and "Traceback" in raised.stderr


def test_the_runner_ends_within_its_deadline_with_a_thread_that_never_ends_on_a_busy_host(tmp_path):
    """A torchrun agent's way out: a non-daemon thread blocked for good (on a dead peer, say)
    kept `python -m stoker.process.quick_exit torch.distributed.run` alive for minutes after its
    ranks and its parent were gone. The runner waits AGENT_JOIN_S for it, in all, names it on
    stderr and ends, with both cores held busy beside it, each time (without the deadline the
    run hangs and _run's timeout fails the test)."""
    (tmp_path / "stuck_mod.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, name='stuck-peer').start()\n"
    )
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for _ in range(2):
            out = _run(["-m", "stoker.process.quick_exit", "stuck_mod"], tmp_path)
            assert out.returncode == 0 and "left 1 thread(s) still running" in out.stderr, out.stderr
            assert "stuck-peer" in out.stderr
    finally:
        for p in busy:
            p.kill()
            p.wait()


SIGNALLED_MOD = """
import signal, threading, time
class SignalException(Exception):  # as torchrun's agent turns SIGTERM into an exception
    pass
def raise_it(signum, frame):
    raise SignalException(f"got signal {signum}")
signal.signal(signal.SIGTERM, raise_it)
threading.Thread(target=threading.Event().wait, name="stuck-tailer").start()
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_the_runner_ends_when_a_signal_raises_out_of_the_module_past_a_thread_that_never_ends(tmp_path):
    """torchrun's agent, SIGTERMed (its launcher SIGKILLed), leaves by an exception: the runner
    once gave that one Python's own exit, which joins every thread without a deadline and tears
    torch down (10-17 s on a loaded host). It now ends as on a return: the traceback on stderr,
    exit code 1, the thread left after AGENT_JOIN_S; with both cores held busy beside it."""
    (tmp_path / "signalled_mod.py").write_text(SIGNALLED_MOD)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    agent = subprocess.Popen(
        [sys.executable, "-m", "stoker.process.quick_exit", "signalled_mod"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)])},
    )
    try:
        assert agent.stdout.readline() == "ready\n"
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=60)  # without the deadline: never
        assert agent.returncode == 1 and "SignalException: got signal 15" in err and "Traceback" in err, err
        assert "left 1 thread(s) still running" in err and "stuck-tailer" in err, err
    finally:
        agent.kill()
        for p in busy:
            p.kill()
            p.wait()
