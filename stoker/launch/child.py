"""One Python module in a process of its own, started and ended as a launcher's gang is
(``launch.gang``): a gang of one, for an evaluation (``python -m stoker.training.evaluation_main``) or
an export (``python -m stoker.training.export``).

The process runs in a session of its own (a Ctrl-C at the terminal reaches only this side,
which then kills it), gets SIGTERM from the kernel when the thread that started it dies
(``process.lifeline.set_parent_death_signal``: `run` starts and waits on one thread), and carries
a gang id and this process's lifeline token (``gang.gang_env``). Its stdout (where it prints its
``contracts.events`` lines) and its stderr are collected apart. Its process group, and any process
carrying its gang id, is SIGKILLed on every way out of `wait` that leaves it running: its time
limit, an exception, KeyboardInterrupt, the exception of a SIGTERM handler (Prefect's cancel).
`kill` does the same from another thread (a run's stop ends its evaluations).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass

from stoker.launch.gang import KILL_WAIT_SECONDS, gang_env, gang_pids
from stoker.process import lifeline

# a process ended by one of these was stopped by someone who meant it
_STOP_SIGNALS = {-signal.SIGINT: "SIGINT (Ctrl-C)", -signal.SIGTERM: "SIGTERM"}


@dataclass
class ChildResult:
    """How the process ended, and what it printed."""

    returncode: int | None
    out: str
    err: str
    timed_out: bool = False  # killed at its time limit
    killed: bool = False  # killed by `Child.kill` (a stop from another thread)

    @property
    def stop_signal(self) -> str | None:
        """The stop that ended it (SIGINT or SIGTERM), or None. A Ctrl-C that reached it while
        Python was still starting counts: the interpreter then reports a fatal KeyboardInterrupt
        and exits 1 instead of dying by SIGINT."""
        if self.returncode == 1 and self.err.rstrip().endswith("KeyboardInterrupt"):
            return _STOP_SIGNALS[-signal.SIGINT]
        return _STOP_SIGNALS.get(self.returncode)


@dataclass
class Outcome:
    """What a one-process child said, read once: its result (the last event of the type it
    was started for), or why not. `why` is the failure it reported (its type and message), a
    time limit, or the tail of its standard error."""

    ended: ChildResult
    result: object | None
    failure: object | None  # its events.Failure, when it reported one
    why: str


def outcome(ended: ChildResult, result_type: type, timeout: float, err_words: int = 60) -> Outcome:
    """The outcome of a child started with `Child(...)` that prints `result_type` on success."""
    from stoker.contracts import events

    said = [e for e in map(events.decode, ended.out.splitlines()) if e is not None]
    done = [e for e in said if isinstance(e, result_type)]
    failure = next((e for e in said if isinstance(e, events.Failure)), None)
    result = done[-1] if ended.returncode == 0 and done else None
    if ended.timed_out:
        why = f"no answer within {timeout:.0f}s"
    elif failure is not None:
        why = f"{failure.type}: {failure.message}"
    else:
        why = " ".join(ended.err.split()[-err_words:])
    return Outcome(ended, result, failure, why)


class Child:
    """``python -m <module> <args...>`` with `env` (plus its gang id and lifeline token).
    `run(timeout)` starts it and waits; or `with Child(...) as child:` starts it, then
    `child.wait(timeout)` (the block's end kills what is left)."""

    def __init__(self, module: str, args: list[str], env: dict[str, str]):
        self.gang_id = uuid.uuid4().hex
        self.cmd = [sys.executable, "-m", module, *args]
        self.env = {**env, **gang_env(self.gang_id)}
        self.proc: subprocess.Popen | None = None
        self.killed = False
        self._out: list[str] = []
        self._err: list[str] = []
        self._pumps: list[threading.Thread] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> "Child":
        me = os.getpid()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: lifeline.start_child(parent=me),
        )
        self._pumps = [
            threading.Thread(target=_collect, args=(stream, lines), daemon=True)
            for stream, lines in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))
        ]
        for pump in self._pumps:
            pump.start()
        return self

    def wait(self, timeout: float) -> ChildResult:
        """Until it ends, or `timeout` seconds (then it is killed); on the thread that started
        it. What it started and left running is killed too: it holds the output pipes open."""
        assert self.proc is not None, "start() first"
        timed_out = False
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            self._end()
        for pump in self._pumps:  # the rest of its output (a pipe held open elsewhere: not all)
            pump.join(KILL_WAIT_SECONDS)
        return ChildResult(self.proc.returncode, "".join(self._out), "".join(self._err), timed_out, self.killed)

    def run(self, timeout: float) -> ChildResult:
        with self.start():
            return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL it (its process group and whatever carries its gang id), from any thread;
        its result then says `killed`."""
        self.killed = True
        self._kill()

    def __enter__(self) -> "Child":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self._end()

    def _end(self) -> None:
        """Nothing left running, its own process group or anything it started (idempotent)."""
        if self.proc is None:
            return
        self._kill()
        self.proc.wait()

    def _kill(self) -> None:
        if self.proc is None:
            return
        # its group only while it is not reaped: a reaped pid (and group id) may be reused
        group = [(os.killpg, self.proc.pid)] if self.proc.poll() is None else []
        for send, pid in group + [(os.kill, p) for p in gang_pids(self.gang_id)]:
            try:
                send(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _collect(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)
    stream.close()
