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
of the gang carries this launcher's token and heartbeat file (``core.lifeline``), which the
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
from typing import Callable

from stoker.core import events, lifeline
from stoker.launch.base import GangResult, Launcher, OnEvent, OnLine
from stoker.launch.watchdog import Watchdog

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
    finds it by, the lifeline token and, when given, the heartbeat file (``core.lifeline``)."""
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


def kill_gang(procs: list[subprocess.Popen], grace: float = GRACE_SECONDS, gang_id: str | None = None) -> None:
    """SIGTERM every agent's process group and every process carrying `gang_id`, then
    SIGKILL what is left after `grace`. The ranks get the SIGTERM directly (not only through
    their agent), so they can stop at a step boundary and checkpoint."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT_SECONDS)):
        if not _gang_alive(procs, gang_id):
            break
        for p in procs:
            _signal(os.killpg, p.pid, sig)
        for pid in gang_pids(gang_id):
            _signal(os.kill, pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _gang_alive(procs, gang_id):
            time.sleep(0.1)
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
    ):
        self.gang_id = uuid.uuid4().hex
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
        open_streams = len(self.procs)
        while open_streams:
            self.reason = self.watchdog.verdict() or self.reason
            if self.reason != "completed":
                break
            try:
                node, line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if any(p.poll() not in (None, 0) for p in self.procs):
                    self.reason = "failed"  # one agent died: the rest would only hang
                    break
                continue
            if line is None:
                open_streams -= 1
                continue
            event = events.decode(line)
            if isinstance(event, events.Joined):  # feeds the prefixes only
                self.ranks[(node, event.local_rank)] = event.rank
                continue
            text = _prefixed(node, line, self.nproc_per_node, self.ranks)
            self._keep(text)
            if event is None:
                on_line(text)
                continue
            self.watchdog.saw(event)
            if not isinstance(event, events.Step):  # heartbeats are not kept in the result
                seen.append(event)
            on_event(event)  # heartbeats too: the Prefect events' stoker.run.step
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
