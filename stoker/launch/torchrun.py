"""The torchrun launcher: one torchrun agent per (simulated) node, meeting by c10d
rendezvous; gloo on CPU, NCCL on GPU. The same arguments run across real machines.

Why a launch ended comes from torchelastic's error files, never from log tails: each rank
that raised left ``{log_dir}/node-{i}/*/attempt_*/{local_rank}/error.json`` with stoker's
Failure record in it (training.train's ``@record`` handler); a rank folder without one is a
rank that ended without raising (a signal, the OOM killer, a crash); an agent that failed
before its ranks started (a rendezvous time-out) leaves its own error file. Which global rank
a folder is comes from the rank itself (``contracts.events.RANK_FILE`` beside its error file): c10d
numbers the nodes in its own order (their addresses sorted as strings), not ours.

Where each node's agent runs is a ``NodeSpec``, one per node from ``launch.nodes`` (or given
in Python): by default every agent runs on this host and meets the others on 127.0.0.1. Given
an address, a command prefix and an environment per node (``ip netns exec <ns>`` in the
tests; ``srun --nodelist=<host>`` across machines), the same torchrun command runs there and
reaches the others on that address. The prefix and the command are exec'd as a list, never
through a shell here.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field

from stoker.config import LaunchConfig, RunConfig
from stoker.contracts.events import ERROR_INFO_KEY, PERMANENT_MARKER_ENV, RANK_FILE, Failure, from_dict
from stoker.failures import PERMANENT, classify_reported
from stoker.launch.base import GangResult
from stoker.launch.env import child_env
from stoker.launch.gang import GangLauncher, ProcessGang, make_work_dir

CPU_THREADS_ENV = "STOKER_CPU_THREADS"  # a CPU rank's torch threads (training.distributed.setup_distributed)

# torchrun's agent, ended without the interpreter's teardown of torch (process.quick_exit: 0.5-1
# CPU-s a node and round), however it ends (SIGTERMed, it raises), and watching this launcher as a
# supervisor (process.lifeline.watch_as_supervisor: the launcher gone, its ranks get their stop
# time and it ends within seconds of them, whatever torch waits on)
AGENT = (sys.executable, "-m", "stoker.process.quick_exit", "torch.distributed.run")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _local_port(host: str) -> int:
    try:
        return free_port(host)
    except OSError as err:
        raise ValueError(
            f"launch.rdzv_host {host!r} is not an address of this host ({err}), so "
            "no free port can be picked for it here; give the port its node listens "
            "on in launch.rdzv_port"
        ) from err


@dataclass(frozen=True)
class NodeSpec:
    """Where one node's torchrun agent runs, beyond the torchrun command every node runs."""

    # starts the agent there: ("ip", "netns", "exec", "n1"), ("srun", "--nodes=1",
    # "--ntasks=1", "--nodelist=host1"); nothing: this host
    prefix: tuple[str, ...] = ()
    # torchrun --local-addr, where the other nodes reach this one; the node whose address is
    # launch.rdzv_host hosts the rendezvous store (said explicitly: torchrun's guess compares
    # host names, which fails on a second interface or in a network namespace)
    address: str | None = None
    # added to the agent's environment: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (the interface
    # that address is on), STOKER_CACHE (the node's own cache)
    env: dict[str, str] = field(default_factory=dict)


def node_specs(lc: LaunchConfig, nodes: list[NodeSpec] | None = None) -> list[NodeSpec]:
    """One spec per node: the ones given, else launch.nodes, else every node on this host."""
    if nodes is None and lc.nodes:
        nodes = [NodeSpec(tuple(n.prefix), n.address, dict(n.env)) for n in lc.nodes]
    if nodes is None:
        return [NodeSpec()] * lc.num_nodes
    if len(nodes) != lc.num_nodes:
        raise ValueError(f"{len(nodes)} node specs for launch.num_nodes={lc.num_nodes}: give one per node")
    return list(nodes)


def torchrun_commands(
    cfg: RunConfig,
    config_url: str,
    shard_key: str,
    resume_key: str | None,
    port: int,
    log_dir: str | None = None,
    nodes: list[NodeSpec] | None = None,
) -> list[list[str]]:
    """The torchrun command of each node (no prefix), all meeting at one c10d endpoint."""
    lc = cfg.launch
    specs = node_specs(lc, nodes)
    placed = any(spec.address for spec in specs)
    cmds = []
    for node, spec in enumerate(specs):
        cmd = [
            *AGENT,
            f"--nnodes={lc.num_nodes}",
            f"--nproc-per-node={lc.nproc_per_node}",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={lc.rdzv_host}:{port}",
            f"--rdzv-id={cfg.resolved_run_name()}",
            f"--max-restarts={lc.max_restarts}",
            "--tee=3",
        ]
        if spec.address:
            cmd.append(f"--local-addr={spec.address}")
        if placed:  # said for every node: torchrun's guess hosts it wherever a name matches
            cmd.append(f"--rdzv-conf=is_host={str(spec.address == lc.rdzv_host).lower()}")
        if log_dir:
            cmd.append(f"--log-dir={os.path.join(log_dir, f'node-{node}')}")
        cmd += ["-m", "stoker.training.train", "--config", config_url, "--shards", shard_key]
        if resume_key:
            cmd += ["--resume-from", resume_key]
        cmds.append(cmd)
    return cmds


# ---- why a launch ended ------------------------------------------------------------------
def read_error_files(log_dir: str, nproc_per_node: int) -> tuple[list[Failure], list[int], list[tuple[str, str]]]:
    """(failures of ranks that raised, ranks that ended without raising, agent errors)."""
    failures, lost, agents = [], [], []
    for node_dir in sorted(glob.glob(os.path.join(log_dir, "node-*"))):
        node = int(node_dir.rsplit("-", 1)[1])
        for rank_dir in sorted(glob.glob(os.path.join(node_dir, "*", "attempt_*", "*"))):
            if not os.path.basename(rank_dir).isdigit():
                continue
            rank = _global_rank(rank_dir, node * nproc_per_node + int(os.path.basename(rank_dir)))
            record = _error_record(os.path.join(rank_dir, "error.json"))
            if record is None:
                lost.append(rank)
            else:
                info = record.get("extraInfo", {}).get(ERROR_INFO_KEY)
                failure = from_dict(info) if isinstance(info, dict) else None
                if not isinstance(failure, Failure):  # raised before stoker's handler was set up
                    kind, _, msg = str(record.get("message", "")).partition(": ")
                    failure = Failure(
                        rank=rank, type=kind, message=msg, transient=classify_reported(kind, msg) != PERMANENT
                    )
                failures.append(failure)
        agent = _error_record(os.path.join(node_dir, "agent-error.json"))
        if agent is not None:
            kind, _, msg = str(agent.get("message", "")).partition(": ")
            agents.append((kind, msg))
    return failures, lost, agents


def _cpu_threads(nodes: list[NodeSpec], nproc_per_node: int, env: dict[str, str]) -> dict[str, str]:
    """The CPU threads of each rank of a node on this host, when several agents share it: a
    rank divides the cores only among the ranks of its own agent (training.distributed reads
    STOKER_CPU_THREADS first), so 2 agents x 1 rank on 2 cores ran 4 threads, 7-10x slower
    than 1 x 2 (benchmarks/bench_multinode.py). Nothing when one agent runs here, or when the
    environment already says."""
    here = sum(1 for spec in nodes if not spec.prefix)
    if here < 2 or CPU_THREADS_ENV in env:
        return {}
    return {CPU_THREADS_ENV: str(max(1, (os.cpu_count() or 1) // (here * nproc_per_node)))}


def _global_rank(rank_dir: str, launch_order: int) -> int:
    """The rank's own RANK, as it wrote it at start (see contracts.events.RANK_FILE); else (a rank
    killed before it wrote it) the launch-order guess, right while c10d keeps that order."""
    try:
        with open(os.path.join(rank_dir, RANK_FILE)) as f:
            rank = json.load(f)["rank"]
    except (OSError, ValueError, KeyError, TypeError):
        return launch_order
    return rank if isinstance(rank, int) else launch_order


def _error_record(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message")
    return message if isinstance(message, dict) else {"message": str(message)}


class TorchrunLauncher(GangLauncher):
    """`launch.num_nodes` torchrun agents, one process gang: on this host (simulated nodes),
    or each where its `NodeSpec` puts it (`nodes`, else launch.nodes). `rdzv_port`: the port the
    rendezvous host listens on (else launch.rdzv_port, else one free on this host, which then
    hosts it)."""

    def __init__(
        self,
        cfg: RunConfig,
        config_url: str,
        shard_key: str,
        resume_key: str | None,
        env: dict[str, str] | None = None,
        nodes: list[NodeSpec] | None = None,
        rdzv_port: int | None = None,
    ):
        self.launch: LaunchConfig = cfg.launch
        nodes = node_specs(cfg.launch, nodes)
        port = rdzv_port or cfg.launch.rdzv_port or _local_port(cfg.launch.rdzv_host)
        self.work_dir = make_work_dir("stoker-launch-")
        self.torchrun_cmds = torchrun_commands(
            cfg, config_url, shard_key, resume_key, port, log_dir=self.work_dir, nodes=nodes
        )
        self.cmds = [list(spec.prefix) + cmd for spec, cmd in zip(nodes, self.torchrun_cmds)]
        base = env if env is not None else child_env(cfg)
        envs = [
            {
                **base,
                **spec.env,
                "TORCHELASTIC_ERROR_FILE": os.path.join(self.work_dir, f"node-{i}", "agent-error.json"),
                PERMANENT_MARKER_ENV: os.path.join(self.work_dir, "permanent-failure.json"),
            }
            for i, spec in enumerate(nodes)
        ]
        for spec, node_env in zip(nodes, envs):
            if not spec.prefix:
                node_env.update(_cpu_threads(nodes, self.launch.nproc_per_node, node_env))
        for i in range(len(self.cmds)):
            os.makedirs(os.path.join(self.work_dir, f"node-{i}"), exist_ok=True)
        self.gang = ProcessGang(
            self.cmds,
            envs,
            self.launch.nproc_per_node,
            self.launch.timeout_seconds,
            self.launch.hang_timeout_seconds,
            startup_timeout=self.launch.startup_timeout_seconds,
            heartbeat=os.path.join(self.work_dir, "heartbeat"),
            end_on_permanent=True,  # the rank wrote its error file and the marker first
        )

    @property
    def description(self) -> str:
        return f"{self.launch.num_nodes} node(s) x {self.launch.nproc_per_node} rank(s): " + " ".join(
            self.torchrun_cmds[0][2:]
        )

    def collect(self, result: GangResult) -> GangResult:
        result = self.gang.collect(result)
        result.failures, result.lost_ranks, result.launcher_errors = read_error_files(
            self.work_dir, self.launch.nproc_per_node
        )
        if result.reason == "completed":
            result.lost_ranks = []  # ranks that exited cleanly leave no error file either
        return result

    def close(self) -> None:
        shutil.rmtree(self.work_dir, ignore_errors=True)
