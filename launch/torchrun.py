"""Launch helpers (no Prefect): start a gang of torchrun agents, stream their output with
rank prefixes, watch for hangs, kill every process of the gang on any exit path, and say why
the run ended.

Each agent is its own session (``start_new_session=True``), and torchrun starts every rank
in a session of its own too, so no single process group holds the gang. Every process of a
gang carries ``STOKER_GANG_ID`` in its environment (inherited by the ranks and anything they
start); the kill finds them by it in ``/proc``, even after an agent died and its ranks were
reparented.

Stopping fits inside the orchestrator's grace: Prefect's runner sends the flow-run process
SIGTERM and SIGKILLs it 30 s later. The gang gets SIGTERM, `GRACE_SECONDS` (20 s), then
SIGKILL; the ranks are told to finish their stop checkpoint `RANK_STOP_MARGIN_SECONDS` before
that (``STOKER_STOP_GRACE_SECONDS``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from core.config import RunConfig
from core.failures import TrainingFailed
from training.loop import METRIC_PREFIX

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_SECONDS = 20.0  # SIGTERM -> SIGKILL; plus KILL_WAIT_SECONDS, inside Prefect's 30 s
KILL_WAIT_SECONDS = 5.0
RANK_STOP_MARGIN_SECONDS = 8.0  # ranks end their stop checkpoint this long before the SIGKILL
HANG_GRACE_SECONDS = 5.0  # a hung collective cannot reach a step boundary: no stop checkpoint
GANG_ENV = "STOKER_GANG_ID"
_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:(.*)$")
_TRANSIENT_PATTERNS = [
    re.compile(p)
    for p in (
        r"Signal \d+ \(SIG\w+\) received by PID",
        r"exitcode\s*:\s*-\d+",
        r"RendezvousTimeoutError|RendezvousClosedError|DistNetworkError",
        r"Connection (reset|refused|closed) by peer|Broken pipe|ECONNRESET",
        r"ServiceUnavailable|SlowDown|503 Service|EndpointConnectionError",
    )
]


@dataclass
class GangResult:
    returncodes: list[int]
    reason: str  # completed | failed | timeout | hang
    seconds: float
    metrics: list[dict] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    last_step: int | None = None  # the last step rank 0 reported finished
    hang_timeout: float = 0.0
    gang_id: str = ""
    pids: list[int] = field(default_factory=list)  # the agents'


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_commands(cfg: RunConfig, config_url: str, shard_key: str, resume_key: str | None,
                      port: int) -> list[list[str]]:
    """One torchrun agent per simulated node, all meeting at one c10d endpoint."""
    lc = cfg.launch
    cmds = []
    for node in range(lc.num_nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={lc.num_nodes}", f"--nproc-per-node={lc.nproc_per_node}",
            f"--node-rank={node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={lc.rdzv_host}:{port}", f"--rdzv-id={cfg.resolved_run_name()}",
            "--max-restarts=0", "--tee=3",
            "-m", "training.train", "--config", config_url, "--shards", shard_key,
        ]
        if resume_key:
            cmd += ["--resume-from", resume_key]
        cmds.append(cmd)
    return cmds


def child_env(cfg: RunConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["STOKER_STORAGE_OPTIONS"] = json.dumps(cfg.storage.storage_options)
    if cfg.launch.rdzv_host in ("127.0.0.1", "localhost"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.pop("PREFECT__FLOW_RUN_ID", None)
    env["STOKER_STOP_GRACE_SECONDS"] = str(_rank_stop_grace(env.get("STOKER_STOP_GRACE_SECONDS")))
    return env


def _rank_stop_grace(requested: str | None) -> float:
    """The ranks' stop budget: what was asked for, but never past the launcher's grace."""
    ceiling = GRACE_SECONDS - RANK_STOP_MARGIN_SECONDS
    try:
        return min(float(requested), ceiling) if requested else ceiling
    except ValueError:
        return ceiling


def _pump(node: int, stream, out: "queue.Queue[tuple[int, str | None]]") -> None:
    for line in iter(stream.readline, ""):
        out.put((node, line.rstrip("\n")))
    out.put((node, None))


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


def kill_gang(procs: list[subprocess.Popen], grace: float = GRACE_SECONDS,
              gang_id: str | None = None) -> None:
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


def run_gang(cmds: list[list[str]], env: dict[str, str], nproc_per_node: int,
             on_line: Callable[[str], None], on_metric: Callable[[dict], None],
             timeout: float, hang_timeout: float = 0.0, grace: float = GRACE_SECONDS) -> GangResult:
    """Run the agents to the end, streaming '[rank N] ...' lines; always kill the gang.

    Hang watchdog (`hang_timeout` > 0): armed at rank 0's first metric record (after
    start-up), then fed by its per-step heartbeats; when no step finishes for
    `hang_timeout` seconds the gang is killed and the run ends with reason "hang"."""
    t0 = time.monotonic()
    lines: "queue.Queue[tuple[int, str | None]]" = queue.Queue()
    procs: list[subprocess.Popen] = []
    metrics: list[dict] = []
    tail: list[str] = []
    gang_id = uuid.uuid4().hex
    env = {**env, GANG_ENV: gang_id}
    last_beat: float | None = None  # when the last step finished (None: not armed yet)
    last_step: int | None = None
    reason = "completed"
    try:
        for node, cmd in enumerate(cmds):
            p = subprocess.Popen(cmd, env=env, cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1,
                                 start_new_session=True)
            procs.append(p)
            threading.Thread(target=_pump, args=(node, p.stdout, lines), daemon=True).start()
        open_streams = len(procs)
        while open_streams:
            now = time.monotonic()
            if now - t0 > timeout:
                reason = "timeout"
                break
            if hang_timeout > 0 and last_beat is not None and now - last_beat > hang_timeout:
                reason = "hang"
                break
            try:
                node, line = lines.get(timeout=0.5)
            except queue.Empty:
                if any(p.poll() not in (None, 0) for p in procs):
                    reason = "failed"  # one agent died: the rest would only hang
                    break
                continue
            if line is None:
                open_streams -= 1
                continue
            text = _prefixed(node, line, nproc_per_node)
            tail = (tail + [text])[-60:]
            if METRIC_PREFIX in line:
                try:
                    record = json.loads(line.split(METRIC_PREFIX, 1)[1])
                except ValueError:
                    record = None
                if record is not None:
                    if record.get("event") == "step":  # heartbeats feed the watchdog only
                        last_beat, last_step = time.monotonic(), record.get("step")
                        continue
                    if last_beat is None:
                        last_beat = time.monotonic()  # start-up is over: arm the watchdog
                    metrics.append(record)
                    on_metric(record)
                    continue
            on_line(text)
        if reason == "completed":
            for p in procs:
                p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            if any(p.returncode != 0 for p in procs):
                reason = "failed"
    finally:
        kill_gang(procs, HANG_GRACE_SECONDS if reason == "hang" else grace, gang_id)
    while True:  # drain what the pumps read before the kill
        try:
            node, line = lines.get_nowait()
        except queue.Empty:
            break
        if line is not None:
            tail = (tail + [_prefixed(node, line, nproc_per_node)])[-60:]
    return GangResult([p.returncode for p in procs], reason, time.monotonic() - t0, metrics, tail,
                      last_step=last_step, hang_timeout=hang_timeout, gang_id=gang_id,
                      pids=[p.pid for p in procs])


def _prefixed(node: int, line: str, nproc_per_node: int) -> str:
    m = _RANK_PREFIX.match(line)
    if m:
        return f"[rank {node * nproc_per_node + int(m.group(1))}] {m.group(2)}"
    return f"[node {node}] {line}"


def classify(result: GangResult) -> TrainingFailed:
    """Turn a failed gang into an error that says whether retrying can help.

    A rank that raised reports {"event": "failure", "transient": ...}. Any permanent report
    (a bug, a bad config, out of memory) makes the whole failure permanent, since peers of
    a crashed rank only see lost connections. Otherwise a signal, a lost peer, a network or
    storage error, a time-out or a hang (no step finished within the watchdog's limit) is
    transient."""
    text = "\n".join(result.tail)
    reports = [m for m in result.metrics if m.get("event") == "failure"]
    permanent = [m for m in reports if not m.get("transient")]
    if permanent:
        first = permanent[0]
        return TrainingFailed(
            f"rank {first.get('rank')} raised {first.get('type')}: {first.get('message')} "
            "(not retried: it would fail the same way)\n" + "\n".join(result.tail[-30:]),
            transient=False, reason="error")
    if result.reason == "timeout":
        return TrainingFailed(f"training exceeded its time limit after {result.seconds:.0f}s",
                              transient=True, reason="timeout")
    if result.reason == "hang":
        seen = "none yet" if result.last_step is None else f"step {result.last_step}"
        return TrainingFailed(
            f"training hung: no step finished for {result.hang_timeout:.0f}s (last step seen: "
            f"{seen}); the gang was killed (a stuck collective or a frozen rank). Retrying from "
            "the newest valid checkpoint.\n" + "\n".join(result.tail[-15:]),
            transient=True, reason="hang")
    if reports or any(rc is not None and rc < 0 for rc in result.returncodes) or any(
        p.search(text) for p in _TRANSIENT_PATTERNS
    ):
        return TrainingFailed("a rank or node was lost (signal, network or storage); retrying "
                              "from the newest valid checkpoint.\n" + "\n".join(result.tail[-15:]),
                              transient=True, reason="lost-rank")
    return TrainingFailed("training exited with an error (not retried):\n"
                          + "\n".join(result.tail[-30:]), transient=False, reason="error")
