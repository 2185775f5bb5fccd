"""Launch helpers (no Prefect): start a gang of torchrun agents, stream their output with
rank prefixes, kill every process group on any exit path, and say why the run ended.

Each agent is its own session (``start_new_session=True``), so killing its process group
takes the agent and every rank it started; a plain child would survive a cancelled flow.
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
from dataclasses import dataclass, field
from typing import Callable

from training.config import RunConfig
from training.loop import METRIC_PREFIX

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_SECONDS = 10.0
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


class TrainingFailed(RuntimeError):
    """A training launch ended badly. `transient` says whether a retry can help."""

    def __init__(self, message: str, transient: bool, reason: str):
        super().__init__(message)
        self.transient, self.reason = transient, reason


@dataclass
class GangResult:
    returncodes: list[int]
    reason: str  # completed | failed | timeout
    seconds: float
    metrics: list[dict] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)


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
    return env


def _pump(node: int, stream, out: "queue.Queue[tuple[int, str | None]]") -> None:
    for line in iter(stream.readline, ""):
        out.put((node, line.rstrip("\n")))
    out.put((node, None))


def kill_gang(procs: list[subprocess.Popen], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM every agent's process group, then SIGKILL what is left after `grace`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(_group_alive(p.pid) for p in procs):
            for p in procs:
                p.poll()
            time.sleep(0.1)
    for p in procs:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


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
             timeout: float) -> GangResult:
    """Run the agents to the end, streaming '[rank N] ...' lines; always kill the groups."""
    t0 = time.monotonic()
    lines: "queue.Queue[tuple[int, str | None]]" = queue.Queue()
    procs: list[subprocess.Popen] = []
    metrics: list[dict] = []
    tail: list[str] = []
    try:
        for node, cmd in enumerate(cmds):
            p = subprocess.Popen(cmd, env=env, cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1,
                                 start_new_session=True)
            procs.append(p)
            threading.Thread(target=_pump, args=(node, p.stdout, lines), daemon=True).start()
        open_streams, reason = len(procs), "completed"
        while open_streams:
            if time.monotonic() - t0 > timeout:
                reason = "timeout"
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
                    if record.get("event") != "step":  # per-step heartbeats are not kept
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
        kill_gang(procs)
    while True:  # drain what the pumps read before the kill
        try:
            node, line = lines.get_nowait()
        except queue.Empty:
            break
        if line is not None:
            tail = (tail + [_prefixed(node, line, nproc_per_node)])[-60:]
    return GangResult([p.returncode for p in procs], reason, time.monotonic() - t0, metrics, tail)


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
    storage error, or a time-out is transient."""
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
    if reports or any(rc is not None and rc < 0 for rc in result.returncodes) or any(
        p.search(text) for p in _TRANSIENT_PATTERNS
    ):
        return TrainingFailed("a rank or node was lost (signal, network or storage); retrying "
                              "from the newest valid checkpoint.\n" + "\n".join(result.tail[-15:]),
                              transient=True, reason="lost-rank")
    return TrainingFailed("training exited with an error (not retried):\n"
                          + "\n".join(result.tail[-30:]), transient=False, reason="error")
