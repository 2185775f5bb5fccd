"""End a process that imported torch without the interpreter's teardown of its modules.

A Python process that imported torch spends half a CPU-second to a second in its own
finalization after its work is done: a rank's imports then Python's exit 4.74 CPU-s, then
``quick_exit`` 4.20 (``python -m benchmarks.bench_startup``, host_speed 0.48; 5.34 against 4.34
at 0.67). Every rank, torchrun agent, evaluation and export process pays it, and a run starts
many of them.

``quick_exit`` does what a normal exit does that anyone can see, in the same order, then ends
the process at once:

1. it waits for the non-daemon threads (an uploader finishing a checkpoint, say), for
   ``join_timeout`` seconds in all where one is given (the module runner below gives
   AGENT_JOIN_S: a torchrun agent whose ranks are gone has nothing worth waiting for, and a
   thread of it blocked on a dead peer kept it alive for minutes, its parent killed);
2. it runs the ``atexit`` handlers (``logging.shutdown``, ``weakref.finalize`` objects, Ray's and
   torch's own);
3. it flushes ``sys.stdout`` and ``sys.stderr``.

What it skips is the teardown of the modules and the objects still alive: a ``__del__`` of an
object reachable at exit does not run, and a file object still open is not flushed. So it is for
processes whose own code closes what it writes (every ``stoker`` process started with ``-m``
does: the store writes whole objects, the ranks report on stdout).

``python -m stoker.process.quick_exit <module> [args...]`` runs a module as ``python -m`` would
(torchrun's agent: ``torch.distributed.run``) and ends so whether the module returns, exits or
raises: an exception's traceback, or a ``SystemExit``'s reason, on stderr and exit code 1, as
Python's own exit would (only a ``KeyboardInterrupt`` takes Python's own way out). From the
module's end on, a signal it had turned into an exception ends the process at once. Under a stoker
launcher it is watched as a supervisor (``lifeline.watch_as_supervisor``): the launcher gone, its
children get their stop time, and then it ends, whatever its own code waits on.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import threading
import time
from typing import NoReturn

from stoker.process import lifeline

AGENT_JOIN_S = 5.0  # what `python -m stoker.process.quick_exit MODULE` waits for its threads, in all


def quick_exit(code: int | None = 0, join_timeout: float | None = None) -> NoReturn:
    """Exit with `code` (None: 0) after the non-daemon threads (for `join_timeout` seconds in
    all, when given: the ones still alive then are named on stderr and left), the atexit
    handlers and a flush of stdout and stderr, skipping the interpreter's teardown."""
    main = threading.main_thread()
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon and thread.is_alive():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    left = [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
    if left:
        print(f"quick_exit: left {len(left)} thread(s) still running after {join_timeout} s: {left}", file=sys.stderr)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: Python's exit would not fail on it either
            pass
    os._exit(code or 0)


def main(argv: list[str]) -> NoReturn:
    """`<module> [args...]`: run the module as ``python -m`` would, then ``quick_exit``, whether
    it returns, exits or raises; under a stoker launcher, watched by its lifeline as a supervisor
    (``lifeline.watch_as_supervisor``: its launcher gone, its children get their stop time, then
    it ends, whatever it waits on)."""
    module, *args = argv
    sys.argv = [module, *args]
    lifeline.watch_as_supervisor()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        error = None
    except BaseException as exc:  # each kind is told apart just below
        error = exc
    _defaults_for_handled_signals()
    if error is None:
        quick_exit(0, join_timeout=AGENT_JOIN_S)
    if isinstance(error, SystemExit):
        code = error.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # as Python's own exit: the reason on stderr, 1
            code = 1
        quick_exit(code, join_timeout=AGENT_JOIN_S)
    if isinstance(error, Exception):
        # torchrun's agent leaves so when SIGTERMed (a SignalException): Python's own exit then
        # took 10-17 s on a loaded host, its main thread in the teardown's gc_collect_main
        sys.excepthook(type(error), error, error.__traceback__)
        quick_exit(1, join_timeout=AGENT_JOIN_S)
    raise error  # a KeyboardInterrupt: Python's own way (it ends by SIGINT)


def _defaults_for_handled_signals() -> None:
    """A signal the module turned into an exception (torchrun's agent: SIGTERM, SIGINT, SIGHUP,
    SIGQUIT raise SignalException) ends the process at once from here on: raised inside
    ``quick_exit``'s join, it took Python's own way out, past every deadline."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    main(sys.argv[1:])
