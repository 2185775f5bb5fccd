"""The re-exec supervisor of `stoker run` / `stoker evaluate`: the command runs the flow in a
child of its own process group, so a Ctrl-C or a SIGTERM stops it and everything it started,
with one line said."""

from __future__ import annotations

import os
import sys

INTERRUPTED = (
    "stoker: interrupted; the ranks were stopped (a checkpoint was written if it "
    "fitted) and the attempt recorded; run the same command again to resume from "
    "the newest valid checkpoint"
)


_CHILD_ENV = "STOKER_CLI_CHILD"


STOP_SECONDS = 28  # the child's grace after SIGTERM: the launcher needs 20 s + 5 s


def _end_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM a process group, then SIGKILL whatever is left of it after `grace` seconds."""
    import signal
    import time

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _supervise(argv: list[str]) -> int:
    """Run the command in a child process in its own session, and stop it the way a cancel
    does. Ctrl-C in a terminal signals the whole foreground process group, which would kill
    Prefect's embedded server (a child of the flow's process) at once: the flow run would stay
    Running forever and nothing could record the interrupted attempt. Here only this process
    gets the signal; it sends SIGTERM to the child, where Prefect turns it into a crash of the
    flow run (reported to the server, still up), the launcher stops the ranks (a checkpoint
    if it fits) and records the attempt; then it prints one line."""
    import signal
    import subprocess

    from stoker.process.lifeline import start_child

    me = os.getpid()
    # SIGKILLed (the OOM killer), this process cannot stop the child: the kernel sends it the
    # SIGTERM of a cancel instead (forked from the main thread, which lives as long as we do)
    child = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", *argv],
        env={**os.environ, _CHILD_ENV: "1"},
        start_new_session=True,
        preexec_fn=lambda: start_child(parent=me),
    )
    stopping = []

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    import time

    try:
        deadline = None
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stopping and deadline is None:
                    deadline = time.monotonic() + STOP_SECONDS
                if deadline is not None and time.monotonic() > deadline:  # past the grace
                    os.killpg(child.pid, signal.SIGKILL)
                    deadline = float("inf")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _end_group(child.pid)  # what the child left in its session: Prefect's embedded server
    if stopping:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    return code
