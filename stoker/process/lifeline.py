"""Nothing outlives the process that started it: a torchrun agent, a rank, a Ray driver or the
embedded Prefect server notices that its launcher is gone (SIGKILLed by the OOM killer, a lost
VM) and stops the way a cancel stops it. Standard library only: every room may use it.

Three signals, because no one of them covers every case:

- ``set_parent_death_signal``: the kernel sends SIGTERM to a child when the *thread* that forked
  it dies (``prctl(PR_SET_PDEATHSIG)``, Linux). Used only where the forking thread lives as long
  as the child's purpose does: the launcher's gang (``Launcher.run`` starts, streams and stops
  on one thread) and the CLI's flow process (its main thread), through ``start_child``, the
  ``preexec_fn`` that also clears the signal mask the forking thread would pass on and an
  inherited ignore of SIGINT or SIGTERM.
- A launcher token, ``STOKER_LAUNCHER`` = ``<boot id>/<pid namespace>/<pid>/<start time>``: on
  the same kernel and pid namespace (the tests' network-namespace nodes share both) a watcher
  reads the launcher's ``/proc/<pid>/stat``; the start time tells a reused pid from the
  launcher. Instant, and needs no parent relation (torchrun starts ranks in sessions of their
  own, as children of the agent).
- A heartbeat file, ``STOKER_LAUNCHER_HEARTBEAT``, touched by the launcher every
  ``HEARTBEAT_SECONDS``: for a watcher on another machine (the token says nothing there). It
  counts only once seen, and only its changes count (no clock is compared across machines): no
  change for ``HEARTBEAT_TIMEOUT_SECONDS`` means the launcher is gone. It lives in the launch
  folder (``tempfile``'s, so under ``$TMPDIR``): point ``TMPDIR`` at a filesystem the nodes
  share for it to reach them; ``srun`` nodes also get the stop through srun, which itself gets
  the parent-death signal.

A supervisor of ranks (torchrun's agent) also watches from inside itself (``watch_as_supervisor``,
started by the module runner ``process.quick_exit`` when its environment names a launcher): torch's
agent, once its launcher is gone, is SIGTERMed twice (the parent-death signal, then by its local
rank 0), each signal raised as an exception wherever its main thread stands (inside its own
shutdown, the second time); ``end_supervisor`` gives its ranks their stop time, then ends it,
whatever it waits on.

``python -m stoker.process.lifeline <token> <module> [args...]`` runs a Python module (``uvicorn``, for
Prefect's embedded server) that ends when the process named by the token does.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import threading
import time
from typing import Callable

LAUNCHER_ENV = "STOKER_LAUNCHER"
HEARTBEAT_ENV = "STOKER_LAUNCHER_HEARTBEAT"
HEARTBEAT_SECONDS = 2.0
HEARTBEAT_TIMEOUT_SECONDS = 20.0  # generous: a loaded host may delay the touching thread
POLL_SECONDS = 1.0
PR_SET_PDEATHSIG = 1
RANK_LATE_SECONDS = 5.0  # a rank's own deadline, late on a loaded host (its lifeline polls)
SUPERVISOR_END_SECONDS = 10  # a supervisor's own way out, once its children are gone


def _find_prctl():
    # resolved here, in the parent: a dlopen between fork and exec of a threaded process can
    # deadlock on a lock another thread held at the fork
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()


def set_parent_death_signal(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """In a child between fork and exec (a ``preexec_fn``): have the kernel send `sig` when the
    forking thread dies. If `parent` already died before this call, send it now."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def start_child(parent: int) -> None:
    """The ``preexec_fn`` of every process stoker starts: no signal blocked (a child inherits
    the mask of the thread that forks it, and a library may have blocked SIGINT or SIGTERM in
    that thread: the child could then not be stopped by them), SIGINT and SIGTERM not ignored
    (an ignored signal stays ignored across exec: stoker started as a shell's background job,
    `cmd &`, ignores SIGINT, and so did every evaluation and rank it started, until their own
    handlers were in place), and the parent-death signal. The children run in sessions of
    their own, so a terminal's Ctrl-C still reaches only the CLI."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    set_parent_death_signal(parent=parent)


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # from the 3rd field (state) on
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _host_identity() -> str:
    """This kernel (boot id) and pid namespace: where a pid means the same process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def token(pid: int | None = None) -> str:
    """The token of a process (this one by default): see the module docstring."""
    pid = os.getpid() if pid is None else pid
    return f"{_host_identity()}/{pid}/{process_start(pid)}"


def token_alive(value: str) -> bool | None:
    """Whether the process of a token lives; None when this host cannot tell (another machine
    or pid namespace, or a malformed token)."""
    where, _, rest = value.rpartition("/")
    where, _, pid = where.rpartition("/")
    here = _host_identity()
    if not here or where != here or not pid.isdigit():
        return None
    return str(process_start(int(pid))) == rest


def token_gone(value: str) -> bool:
    """True only when this host can tell that the process of a token is gone (same kernel and
    pid namespace, and no process of that pid and start time): what a lock or lease held by a
    process that was killed outright is freed by, without waiting for its expiry. A token of
    another machine or pid namespace, an empty or a malformed one, is never gone here."""
    return bool(value) and token_alive(value) is False


class Heartbeat:
    """The launcher's side: touches `path` every HEARTBEAT_SECONDS until `stop()`."""

    def __init__(self, path: str):
        self.path, self._done = path, threading.Event()
        self._thread = threading.Thread(target=self._beat, name="stoker-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _beat(self) -> None:
        while True:
            try:
                with open(self.path, "w") as f:
                    f.write(f"{time.time():.3f}\n")
            except OSError:  # the folder went away: the launch is over
                pass
            if self._done.wait(HEARTBEAT_SECONDS):
                return

    def stop(self) -> None:
        self._done.set()


class Lifeline:
    """The watcher's side: calls `on_gone(reason)` once, from a daemon thread, when the launcher
    of `launcher_token` / `heartbeat` is gone, or (`watch_parent`) this process's parent is."""

    def __init__(
        self,
        on_gone: Callable[[str], None],
        launcher_token: str | None = None,
        heartbeat: str | None = None,
        watch_parent: bool = False,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_SECONDS,
    ):
        self.on_gone, self.launcher_token, self.heartbeat = on_gone, launcher_token, heartbeat
        self.parent = os.getppid() if watch_parent else None
        self.heartbeat_timeout = heartbeat_timeout
        self._beat: tuple[float, float] | None = None  # (mtime seen, when it last changed)

    @classmethod
    def from_env(cls, on_gone: Callable[[str], None], env=os.environ, watch_parent: bool = False):
        """The lifeline a launcher's environment describes; None when it describes none."""
        launcher, heartbeat = env.get(LAUNCHER_ENV), env.get(HEARTBEAT_ENV)
        if not launcher and not heartbeat and not watch_parent:
            return None
        return cls(on_gone, launcher, heartbeat, watch_parent)

    def check(self) -> str | None:
        """Why the launcher counts as gone, or None while it lives (or nothing can tell)."""
        if self.parent is not None and os.getppid() != self.parent:
            return f"its parent process {self.parent} is gone"
        if self.launcher_token and token_alive(self.launcher_token) is False:
            return f"the launcher ({self.launcher_token.rsplit('/', 2)[-2]}) is gone"
        if self.heartbeat:
            return self._heartbeat_stale()
        return None

    def _heartbeat_stale(self) -> str | None:
        try:
            mtime = os.stat(self.heartbeat).st_mtime
        except OSError:
            mtime = None  # never seen: another machine without the shared folder; or removed
        now = time.monotonic()
        if self._beat is None:
            if mtime is not None:
                self._beat = (mtime, now)
            return None
        if mtime is not None and mtime != self._beat[0]:
            self._beat = (mtime, now)
            return None
        if now - self._beat[1] > self.heartbeat_timeout:
            return f"the launcher's heartbeat {self.heartbeat} stopped {now - self._beat[1]:.0f} s ago"
        return None

    def start(self) -> "Lifeline":
        threading.Thread(target=self._watch, name="stoker-lifeline", daemon=True).start()
        return self

    def _watch(self) -> None:
        while True:
            reason = self.check()
            if reason:
                self.on_gone(reason)
                return
            time.sleep(POLL_SECONDS)


def terminate_self(grace: float, announce: Callable[[], bool] = lambda: True) -> Callable[[str], None]:
    """An `on_gone` that stops this process as a cancel does (SIGTERM to itself), and SIGKILLs
    it when it is still here `grace` seconds later (stuck where no handler runs). It says why
    on stderr when `announce()` is true (not when the process is already stopping: a Ctrl-C's
    launcher ends before its ranks, and the user was told once already)."""

    def on_gone(reason: str) -> None:
        if announce():
            print(f"stoker: stopping: {reason}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os.kill(os.getpid(), signal.SIGKILL)

    return on_gone


def children(pid: int | None = None) -> list[int]:
    """The live children of a process (this one by default; Linux /proc, zombies left out)."""
    pid = os.getpid() if pid is None else pid
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # from the 3rd field (state) on
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(name))
    return found


def _signal_child(pid: int, sig: int) -> None:
    """`sig` to a child and, when it leads a process group of its own (a torchrun rank's
    session), to that group: what the child started goes with it."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def supervisor_grace(env=os.environ) -> float:
    """How long a supervisor whose launcher is gone gives its children (torchrun's ranks): their
    stop budget (``STOKER_STOP_GRACE_SECONDS``, training.distributed.stop_grace_seconds) and the
    15 s more after which a rank SIGKILLs itself (training.train), plus RANK_LATE_SECONDS."""
    try:
        stop = float(env.get("STOKER_STOP_GRACE_SECONDS", "15"))
    except ValueError:
        stop = 15.0
    return stop + 15.0 + RANK_LATE_SECONDS


def end_supervisor(
    grace: float, end: int = SUPERVISOR_END_SECONDS, announce: Callable[[], bool] = lambda: True
) -> Callable[[str], None]:
    """An `on_gone` for a process that supervises children in sessions of their own (torchrun's
    agent): its children are sent SIGTERM (a rank stops as on a cancel, with a stop checkpoint)
    and given `grace` seconds to end, then SIGKILLed, each with its process group (a child that
    appears meanwhile, a restart round's, at once: it has nothing to save); this process is then
    given `end` seconds to end its own way (its error file, its handlers) and is ended with
    ``os._exit`` (or by SIGALRM a second later, where its interpreter's teardown has begun and
    holds this thread; the process must leave SIGALRM's action the default). Whatever its own code
    waits on, a monitor loop, a shutdown that a second signal cut short, a thread, the teardown,
    it is gone `grace + end` seconds after its launcher at the latest, and about `end` seconds
    after its children. It says why on stderr (from a thread of its own: a pipe no one reads
    cannot hold it)."""

    def on_gone(reason: str) -> None:
        try:
            if announce():
                threading.Thread(target=_say, args=(f"stoker: stopping: {reason}",), daemon=True).start()
            first = set(children())
            for pid in first:
                _signal_child(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                now = children()
                if not now:
                    break
                for pid in set(now) - first:
                    _signal_child(pid, signal.SIGKILL)
                time.sleep(0.2)
            for pid in children():
                _signal_child(pid, signal.SIGKILL)
            # the kernel's deadline too: once the interpreter's teardown has begun, a thread
            # that wakes up never runs again (SIGALRM's default action ends the process)
            signal.alarm(end + 1)
            time.sleep(end)
        finally:
            os._exit(128 + signal.SIGTERM)

    return on_gone


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def watch_as_supervisor(env=os.environ) -> "Lifeline | None":
    """In a supervisor a stoker launcher started (its environment names the launcher: torchrun's
    agent, run by ``python -m stoker.process.quick_exit``): a started lifeline that ends it with
    `end_supervisor` when the launcher, or its parent, is gone. None (nothing watched) elsewhere."""
    if not env.get(LAUNCHER_ENV) and not env.get(HEARTBEAT_ENV):
        return None
    return Lifeline(
        end_supervisor(supervisor_grace(env)),
        env.get(LAUNCHER_ENV),
        env.get(HEARTBEAT_ENV),
        watch_parent=True,
    ).start()


def main(argv: list[str]) -> None:
    """`[--quiet] <token> <module> [args...]`: run the module as ``python -m`` would, ending it
    (SIGTERM, then SIGKILL 10 s later) when the token's process is gone; `--quiet`: without a
    word on stderr (a helper whose end is no news, such as Prefect's temporary server)."""
    quiet = argv[:1] == ["--quiet"]
    launcher, module, *args = argv[1:] if quiet else argv
    Lifeline(terminate_self(10.0, announce=lambda: not quiet), launcher_token=launcher).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
