"""Where the ranks run: the launch section (``LaunchConfig``, its nodes: ``NodeConfig``), its
rendezvous, watchdogs and lease, and the Ray cluster behind launcher 'ray' and data.engine
'ray' (``RayConfig``)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from stoker.config.checks import _no_credentials
from stoker.fields import NonBlank, _field, _rule, _Section

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class NodeConfig(_Section):
    """One node of launch.nodes: where its torchrun agent runs and how the others reach it."""

    prefix: list[NonBlank] = Field(
        default_factory=list,
        description="Command that starts this node's torchrun agent on its machine, one word per "
        "item, run as is (no shell): ['srun', '--nodes=1', '--ntasks=1', '--nodelist=host1'] or "
        "['ssh', 'host1']. The agent gets this host's environment and env only through a "
        "prefix that passes them on (srun does, ssh does not). Empty: this host.",
        json_schema_extra={"fix": "give the command as a list of words, e.g. ['ssh', 'host1']"},
    )
    address: str | None = Field(
        None,
        description="Where the other nodes reach this one (torchrun --local-addr), on the "
        "interface env names. The node whose address is launch.rdzv_host hosts the rendezvous.",
        json_schema_extra={"fix": "give an IP address or host name, e.g. '10.0.0.11'"},
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Added to the agent's environment: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME "
        "(the interface of address), STOKER_CACHE (the node's cache folder). Never credentials.",
        json_schema_extra={"fix": "give variable names such as GLOO_SOCKET_IFNAME"},
    )

    @field_validator("prefix")
    @classmethod
    def _a_list_of_words(cls, prefix: list[str]) -> list[str]:
        if prefix and len(prefix[0].split()) > 1:  # no program's name holds a space
            raise _rule(
                "is one shell string", f"give one word per item: {prefix[0].split()!r}; it is run without a shell"
            )
        return prefix

    @field_validator("address")
    @classmethod
    def _an_address(cls, address: str | None) -> str | None:
        if address is None or not address.strip():
            return None
        address = address.strip()
        if len(address.split()) > 1 or "/" in address:
            raise _rule("is not an address")
        return address

    @field_validator("env")
    @classmethod
    def _names_without_credentials(cls, env: dict[str, str]) -> dict[str, str]:
        _no_credentials(env)  # first: the other problem's line would show the values
        bad = [name for name in env if not _ENV_NAME.match(name)]
        if bad:
            raise _rule(
                f"{bad!r} cannot be an environment variable's name",
                "use letters, digits and '_', e.g. GLOO_SOCKET_IFNAME",
            )
        return env


class LaunchConfig(_Section):
    launcher: Literal["local", "ray"] = Field(
        "local",
        description="'local': torchrun agents (num_nodes simulated nodes on this host, or "
        "one per host with launch.nodes). 'ray': Ray Train workers (TorchTrainer, num_nodes x "
        "nproc_per_node of them) on the cluster at ray.address; needs the 'ray' extra: pip "
        "install 'stoker[ray]'.",
    )
    num_nodes: int = _field(
        1,
        "torchrun agents (nodes) meeting by c10d rendezvous: simulated on this host, or where launch.nodes puts them.",
        ge=1,
    )
    nproc_per_node: int = _field(2, "Training ranks per node.", ge=1)
    accelerator: str | None = _field(
        None,
        "The GPU model of each rank, for the run's plan (stoker plan; the refusal of a run that "
        "cannot fit; train.micro_batch_size 'auto'): e.g. 'H100', 'H200', 'A100-40GB', 'L40S'. "
        "Empty: this host's GPU, read from the driver, or none (CPU ranks).",
        fix="give a GPU model such as 'H100', or leave it empty",
        min_length=1,
    )
    device_memory_gib: float | None = _field(
        None,
        "Memory of one device in GiB, for the plan: needed for a GPU model stoker does not "
        "know; overrides the known one (e.g. 75 to keep a margin).",
        fix="give the device's memory in GiB, e.g. 80",
        gt=0,
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; 'auto' is NCCL with GPUs, gloo otherwise."
    )
    nodes: list[NodeConfig] | None = Field(
        None,
        description="Where each node's torchrun agent runs, one entry per node (num_nodes): "
        "the command prefix that starts it on its machine, its address and environment. Empty: "
        "every node on this host.",
        json_schema_extra={"fix": "give one entry per node, or leave it empty"},
    )
    rdzv_host: str = Field(
        "127.0.0.1",
        validate_default=True,
        description="Host of the c10d rendezvous endpoint. With launch.nodes: the address of the "
        "node whose agent hosts it.",
        json_schema_extra={"fix": "give the address of one node of launch.nodes"},
    )
    rdzv_port: int | None = _field(
        None,
        "Port of the rendezvous endpoint. Needed when its node is another machine (has a "
        "prefix); empty: a free port of this host.",
        fix="give the port the rendezvous node listens on, e.g. 29500",
        ge=1,
        le=65535,
        validate_default=True,
    )
    timeout_seconds: int = _field(3600, "Wall-clock limit of one training launch.", ge=10)
    max_attempts: int = _field(2, "Launch attempts; each retry resumes from the newest valid checkpoint.", ge=1)
    max_restarts: int = _field(
        2,
        "In-place restarts per launch attempt: when a rank dies, torchrun restarts the ranks "
        "and they load the newest valid checkpoint themselves (seconds, not a relaunch). A "
        "failure no restart can fix (a bug, a bad input) is not restarted. 0: every failure "
        "goes to a new launch attempt.",
        fix="e.g. 2, or 0 to relaunch instead",
        ge=0,
        le=100,
    )
    concurrency_limit: str = Field(
        "stoker-accelerators",
        description="Prefect global concurrency limit a launch holds one slot of while its ranks "
        "run, so two runs never take the same accelerators; `stoker deploy` creates it with one "
        "slot. Not on the server (an embedded server, a notebook) or empty: no limit. Give each "
        "machine's runs their own name to run one per machine.",
    )
    hang_timeout_seconds: int = _field(
        300,
        "Hang watchdog: when no training step finishes for this long (rank 0 "
        "reports each one), the gang is killed and the launch fails as transient (retried from "
        "the newest valid checkpoint). Armed at rank 0's first report, so start-up (rendezvous, "
        "loading shards and the checkpoint, the step-0 evaluation) counts only against "
        "timeout_seconds. Keep it above the slowest step plus an evaluation and a checkpoint "
        "save. 0 turns the watchdog off.",
        fix="give 0 (watchdog off) or more than the slowest step plus an evaluation and a checkpoint save, e.g. 300",
        ge=0,
    )

    startup_timeout_seconds: int = _field(
        900,
        "Start-up watchdog: when rank 0 has not reported (its step-0 evaluation or first step) "
        "this long after the launch, start-up has hung (a rendezvous that never completes, a rank "
        "stuck loading) and the gang is killed; the launch fails as transient and is retried. "
        "Give it room for rendezvous, loading the shards and the checkpoint, compiling, and the "
        "step-0 evaluation. 0 turns it off.",
        fix="give 0 (off) or the longest start-up plus a margin, e.g. 900",
        ge=0,
    )
    takeover: bool = Field(
        False,
        description="Take the run over from another launch that holds its lease "
        "({root}/runs/{run}/lease.json) and is still alive: that launch stops at its next "
        "heartbeat. Without it a second launch of the run refuses in one line naming the holder; "
        "a lease whose heartbeat expired (launch.lease_seconds), or whose process on this host "
        "is gone, is taken without it. The CLI's `stoker run --takeover` sets it.",
    )
    lease_seconds: int = _field(
        90,
        "How long the run lease lasts without a heartbeat (renewed every third of it by the "
        "process that launches training). After that another launch may take the run over.",
        fix="give at least 10 seconds, e.g. 90",
        ge=10,
    )
    collective_timeout_seconds: int = _field(
        1800,
        "How long a rank waits in one collective (the process group's timeout, NCCL's and "
        "gloo's) before it fails with an error naming the collective, instead of hanging: "
        "longer than any wait of one rank for another (a peer loading and checking a "
        "checkpoint from the store, compiling, evaluating, a synchronous checkpoint save). "
        "NCCL's own default is 10 minutes, which a slow checkpoint download can exceed.",
        fix="give at least the longest checkpoint download and check plus a compile, e.g. 1800",
        ge=60,
    )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    @field_validator("nodes")
    @classmethod
    def _one_per_node(cls, nodes: list[NodeConfig] | None, info: ValidationInfo) -> list[NodeConfig] | None:
        if not nodes:
            return None  # an empty list (the UI form's) is no list
        if info.data.get("launcher") == "ray":
            raise _rule(
                "places torchrun agents, and launch.launcher is 'ray'",
                "remove launch.nodes (Ray places its workers), or use launcher 'local'",
            )
        num_nodes = info.data.get("num_nodes")
        if num_nodes is not None and len(nodes) != num_nodes:
            raise _rule(
                f"gives {len(nodes)} node(s) for num_nodes={num_nodes}",
                f"give one entry per node, or set launch.num_nodes to {len(nodes)}",
            )
        return nodes

    @field_validator("rdzv_host")
    @classmethod
    def _a_node_hosts_the_rendezvous(cls, host: str, info: ValidationInfo) -> str:
        nodes = info.data.get("nodes")
        if not nodes:  # none given, or they failed (reported on their own)
            return host
        hosting = [i for i, node in enumerate(nodes) if node.address == host]
        addresses = [node.address for node in nodes if node.address]
        if not hosting:
            raise _rule(
                "is no node's address: the rendezvous is hosted by the node whose address it is",
                f"give one of {addresses}"
                if addresses
                else "give that node's address in launch.nodes[i].address and here",
            )
        if len(hosting) > 1:
            raise _rule(
                f"is the address of nodes {hosting}", "give each node its own address: one node hosts the rendezvous"
            )
        return host

    @field_validator("rdzv_port")
    @classmethod
    def _port_of_a_remote_rendezvous(cls, port: int | None, info: ValidationInfo) -> int | None:
        nodes, host = info.data.get("nodes"), info.data.get("rdzv_host")
        if port is not None or not nodes or host is None:
            return port
        for i, node in enumerate(nodes):
            if node.address == host and node.prefix:
                raise _rule(
                    f"is needed: the rendezvous host {host} is node {i}, started on "
                    f"another machine ({node.prefix[0]}), where no free port can be "
                    "picked from here"
                )
        return port

    @field_validator("hang_timeout_seconds")
    @classmethod
    def _off_or_long_enough(cls, seconds: int) -> int:
        if 0 < seconds < 5:
            raise _rule("must be 0 (watchdog off) or >= 5")
        return seconds


class RayConfig(_Section):
    """The Ray cluster behind launch.launcher 'ray' and data.engine 'ray'. Where work runs, not
    what it computes: left out of the run's identity."""

    address: str | None = Field(
        None,
        description="The cluster: 'ray://HEAD:10001' (Ray Client, from any host that reaches the "
        "head), 'auto' or 'HOST:6379' (from a host that is a node of the cluster). Empty: a "
        "local Ray instance started for the job on 127.0.0.1 and stopped after it. Every node "
        "needs stoker installed and must reach storage.root (an object store, not a local "
        "folder, once the cluster spans hosts).",
        json_schema_extra={"fix": "give ray://HOST:10001, auto or HOST:PORT, or leave it empty"},
    )
    cpus_per_worker: float = _field(
        1.0,
        "CPUs a training worker reserves (Ray's ScalingConfig resources_per_worker).",
        fix="e.g. 1 or 4",
        gt=0,
        le=1024,
    )
    cpus_per_data_task: float = _field(
        1.0, "CPUs a tokenizing task reserves (data.engine 'ray').", fix="e.g. 1", gt=0, le=1024
    )

    @field_validator("address")
    @classmethod
    def _address(cls, address: str | None) -> str | None:
        if address is None or not address.strip():
            return None
        address = address.strip()
        if address == "auto" or address.startswith("ray://"):
            return address
        host, sep, port = address.rpartition(":")
        if not sep or not host or "/" in address or not port.isdigit():
            raise _rule("is not a Ray address")
        return address
