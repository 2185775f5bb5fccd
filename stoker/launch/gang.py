"""A gang of local processes (one per node agent): started in sessions of their own,
streamed line by line with rank prefixes, watched, and always killed as a whole.

torchrun starts every rank in a session of its own too, so no single process group holds
the gang. Every process of a gang carries ``STOKER_GANG_ID`` in its environment (inherited by
the ranks and anything they start); the kill finds them by it in ``/proc``, even after an
agent died and its ranks were reparented.

Stopping fits inside the orchestrator's grace: Prefect's runner sends the flow-run process
SIGTERM and SIGKILLs it 30 s later. The gang gets SIGTERM, `GRACE_SECONDS` (20 s), then
SIGKILL; the ranks are told to finish their stop checkpoint `RANK_STOP_MARGIN_SECONDS` before
that (``STOKER_STOP_GRACE_SECONDS``).

The gang also ends when this process dies without stopping it (SIGKILL, the OOM killer): each
agent gets SIGTERM from the kernel (a parent-death signal: `run` starts, streams and stops on
one thread, so the forking thread lives exactly as long as the gang should), and every process
of the gang carries this launcher's token and heartbeat file (``process.lifeline``), which the
ranks watch.
"""

from __future__ import annotations

import glob
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from stoker.contracts import events
from stoker.launch.base import GangResult, Launcher, OnEvent, OnLine
from stoker.launch.watchdog import Watchdog
from stoker.process import lifeline

GRACE_SECONDS = 20.0  # SIGTERM -> SIGKILL; plus KILL_WAIT_SECONDS, inside Prefect's 30 s
KILL_WAIT_SECONDS = 5.0
RANK_STOP_MARGIN_SECONDS = 8.0  # ranks end their stop checkpoint this long before the SIGKILL
HANG_GRACE_SECONDS = 5.0  # a hung collective cannot reach a step boundary: no stop checkpoint
GANG_ENV = "STOKER_GANG_ID"
TAIL_LINES = 60
_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:(.*)$")


def make_work_dir(prefix: str) -> str:
    """A launch's folder under $TMPDIR, named for this launcher (its lifeline token, in
    ``launcher``); first removes the folders of earlier launches whose launcher died without
    removing them (a SIGKILL), as their tokens tell."""
    for old in glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*")):
        try:
            with open(os.path.join(old, "launcher")) as f:
                owner = f.read().strip()
        except OSError:
            continue  # not ours to judge: made before tokens, or being made now
        if lifeline.token_alive(owner) is False:
            shutil.rmtree(old, ignore_errors=True)
    work_dir = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(work_dir, "launcher"), "w") as f:
        f.write(lifeline.token())
    return work_dir


def gang_env(gang_id: str, heartbeat: str | None = None) -> dict[str, str]:
    """What ties a process to its gang and its launcher (this process): the gang id the kill
    finds it by, the lifeline token and, when given, the heartbeat file (``process.lifeline``)."""
    beat = {lifeline.HEARTBEAT_ENV: heartbeat} if heartbeat else {}
    return {GANG_ENV: gang_id, lifeline.LAUNCHER_ENV: lifeline.token(), **beat}


def gang_pids(gang_id: str | None) -> list[int]:
    """Live processes whose environment carries this gang's id (Linux /proc; elsewhere
    none are found and only the agents' process groups are killed)."""
    if not gang_id:
        return []
    needle, pids = f"{GANG_ENV}={gang_id}".encode(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):  # a zombie's reads empty
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def kill_gang(
    procs: list[subprocess.Popen],
    grace: float = GRACE_SECONDS,
    gang_id: str | None = None,
    known: set[int] | None = None,
) -> None:
    """SIGTERM every agent's process group and every process carrying `gang_id`, then
    SIGKILL what is left after `grace`. The ranks get the SIGTERM directly (not only through
    their agent), so they can stop at a step boundary and checkpoint. `known`: the gang's
    processes when it was told to end; one that appears after (a restart round an agent began
    before its SIGTERM took effect) is SIGKILLed as soon as it is seen: it has nothing to save."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT_SECONDS)):
        if not _gang_alive(procs, gang_id):
            break
        for p in procs:
            _signal(os.killpg, p.pid, sig)
        for pid in gang_pids(gang_id):
            _signal(os.kill, pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _gang_alive(procs, gang_id):
            if known is not None:
                for pid in set(gang_pids(gang_id)) - known:
                    _signal(os.kill, pid, signal.SIGKILL)
            time.sleep(0.05 if known is not None else 0.1)
    for p in procs:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def _signal(send: Callable[[int, int], None], pid: int, sig: int) -> None:
    try:
        send(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _gang_alive(procs: list[subprocess.Popen], gang_id: str | None) -> bool:
    for p in procs:
        p.poll()  # reap an exited agent, or its group would look alive
    return any(_group_alive(p.pid) for p in procs) or bool(gang_pids(gang_id))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _pump(node: int, stream, out: "queue.Queue[tuple[int, str | None]]") -> None:
    for line in iter(stream.readline, ""):
        out.put((node, line.rstrip("\n")))
    out.put((node, None))


def _prefixed(node: int, line: str, nproc_per_node: int, ranks: dict[tuple[int, int], int]) -> str:
    """`[rank R] text` for a rank's line: R as the rank said it (a Joined event, `ranks`),
    else worked out from the launch order; `[node N] line` for the agent's own lines."""
    m = _RANK_PREFIX.match(line)
    if m:
        local = int(m.group(1))
        return f"[rank {ranks.get((node, local), node * nproc_per_node + local)}] {m.group(2)}"
    return f"[node {node}] {line}"


ENDING_SECONDS = 10.0  # a permanent failure: how long the round's other ranks get to end


@dataclass
class _Ending:
    """After a rank's permanent Failure: the ranks of that round seen on this host. Once they
    have all ended (torchrun stops them all before it would restart any), everything they
    said is in the agents' output, and the gang ends; ranks on other hosts are given until
    `deadline`."""

    ranks: set[int]
    deadline: float

    def done(self) -> bool:
        if time.monotonic() >= self.deadline:
            return True
        return not any(_alive(pid) for pid in self.ranks)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class ProcessGang(Launcher):
    """One local process per node (`cmds[i]` with `envs[i]`); see the module docstring."""

    def __init__(
        self,
        cmds: list[list[str]],
        envs: list[dict[str, str]],
        nproc_per_node: int,
        timeout: float,
        hang_timeout: float = 0.0,
        grace: float = GRACE_SECONDS,
        startup_timeout: float = 0.0,
        heartbeat: str | None = None,
        end_on_permanent: bool = False,
    ):
        self.gang_id = uuid.uuid4().hex
        # a rank's permanent Failure ends the gang at once: torchrun would otherwise spend a
        # restart round on it (every rank started again, on every node, only to end)
        self.end_on_permanent = end_on_permanent
        self.cmds, self.nproc_per_node, self.grace = cmds, nproc_per_node, grace
        self.envs = [{**env, **gang_env(self.gang_id, heartbeat)} for env in envs]
        self.heartbeat = lifeline.Heartbeat(heartbeat) if heartbeat else None
        self.watchdog = Watchdog(timeout, hang_timeout, startup_timeout)
        self.procs: list[subprocess.Popen] = []
        self.lines: "queue.Queue[tuple[int, str | None]]" = queue.Queue()
        self.tail: list[str] = []
        self.reason = "completed"
        self.ranks: dict[tuple[int, int], int] = {}  # (node, local rank) -> global rank, as said

    def start(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.start()
        me = os.getpid()
        for node, (cmd, env) in enumerate(zip(self.cmds, self.envs)):
            p = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                start_new_session=True,
                preexec_fn=lambda: lifeline.start_child(parent=me),
            )
            self.procs.append(p)
            threading.Thread(target=_pump, args=(node, p.stdout, self.lines), daemon=True).start()

    def _keep(self, text: str) -> None:
        self.tail.append(text)
        del self.tail[:-TAIL_LINES]

    def stream(self, on_line: OnLine, on_event: OnEvent) -> GangResult:
        """Until every agent's output ends (or the watchdog fires, or one agent dies)."""
        seen: list[events.Event] = []
        self.open_streams = len(self.procs)
        ending: _Ending | None = None
        while self.open_streams:
            self.reason = self.watchdog.verdict() or self.reason
            if self.reason != "completed":
                break
            if ending is not None and ending.done():
                self.reason = "failed"
                self._end(ending, on_line, on_event, seen)
                break
            try:
                node, line = self.lines.get(timeout=0.5 if ending is None else 0.05)
            except queue.Empty:
                if any(p.poll() not in (None, 0) for p in self.procs):
                    self.reason = "failed"  # one agent died: the rest would only hang
                    break
                continue
            event = self._take(node, line, on_line, seen)
            if event is None:
                continue
            on_event(event)  # heartbeats too: the Prefect events' stoker.run.step
            if self.end_on_permanent and ending is None and isinstance(event, events.Failure) and not event.transient:
                ending = self._ending()
        if self.reason == "completed":
            for p in self.procs:
                p.wait(timeout=max(1.0, self.watchdog.seconds_left()))
            if any(p.returncode != 0 for p in self.procs):
                self.reason = "failed"
        return GangResult(
            [p.returncode for p in self.procs],
            self.reason,
            time.monotonic() - self.watchdog.t0,
            seen,
            self.tail,
            last_step=self.watchdog.last_step,
            hang_timeout=self.watchdog.hang_timeout,
            gang_id=self.gang_id,
            pids=[p.pid for p in self.procs],
        )

    def _take(self, node: int, line: str | None, on_line: OnLine, seen: list[events.Event]) -> events.Event | None:
        """One line read from an agent: printed (prefixed) and kept; its event, if it is one
        the caller hands on (a rank's Joined only feeds the prefixes)."""
        if line is None:
            self.open_streams -= 1
            return None
        event = events.decode(line)
        if isinstance(event, events.Joined):
            self.ranks[(node, event.local_rank)] = event.rank
            return None
        text = _prefixed(node, line, self.nproc_per_node, self.ranks)
        self._keep(text)
        if event is None:
            on_line(text)
            return None
        self.watchdog.saw(event)
        if not isinstance(event, events.Step):  # heartbeats are not kept in the result
            seen.append(event)
        return event

    def _ending(self) -> "_Ending":
        agents = {p.pid for p in self.procs}
        ranks = {pid for pid in gang_pids(self.gang_id) if pid not in agents}
        return _Ending(ranks, time.monotonic() + ENDING_SECONDS)

    def _end(self, ending: "_Ending", on_line: OnLine, on_event: OnEvent, seen: list[events.Event]) -> None:
        """A rank failed for good and its round's ranks have ended: kill the agents before
        they start a restart round, then hand on what the ranks said before they ended."""
        kill_gang(self.procs, self.grace, self.gang_id, known=ending.ranks | {p.pid for p in self.procs})
        deadline = time.monotonic() + KILL_WAIT_SECONDS
        while self.open_streams and time.monotonic() < deadline:
            try:
                node, line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            event = self._take(node, line, on_line, seen)
            if event is not None:
                on_event(event)

    def stop(self) -> None:
        kill_gang(self.procs, HANG_GRACE_SECONDS if self.reason in ("hang", "startup") else self.grace, self.gang_id)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        while True:  # keep what the pumps read before the kill, for the failure message
            try:
                node, line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self._keep(_prefixed(node, line, self.nproc_per_node, self.ranks))
        for p in self.procs:
            p.poll()

    def collect(self, result: GangResult) -> GangResult:
        """The result with what only the stop could tell: exit codes, the last lines."""
        result.tail, result.returncodes = list(self.tail), [p.returncode for p in self.procs]
        return result


class GangLauncher(Launcher):
    """A launcher whose processes are one ProcessGang (`self.gang`, made by the subclass):
    start, stream and stop are the gang's; `collect` adds the launcher's own evidence."""

    gang: ProcessGang

    def start(self) -> None:
        self.gang.start()

    def stream(self, on_line: OnLine, on_event: OnEvent) -> GangResult:
        return self.gang.stream(on_line, on_event)

    def stop(self) -> None:
        self.gang.stop()


def run_gang(
    cmds: list[list[str]],
    env: dict[str, str],
    nproc_per_node: int,
    on_line: OnLine,
    on_event: OnEvent,
    timeout: float,
    hang_timeout: float = 0.0,
    grace: float = GRACE_SECONDS,
    startup_timeout: float = 0.0,
) -> GangResult:
    """Run the agents to the end with one environment; always kill the gang."""
    return ProcessGang(cmds, [env] * len(cmds), nproc_per_node, timeout, hang_timeout, grace, startup_timeout).run(
        on_line, on_event
    )
