"""What accelerators this host has, without importing torch (the orchestrator does not):
the NVIDIA driver's list of GPUs, narrowed by CUDA_VISIBLE_DEVICES as CUDA narrows it."""

from __future__ import annotations

import importlib.metadata
import os

from stoker.config import RunConfig

NVIDIA_PROC = "/proc/driver/nvidia/gpus"


def visible_gpu_count(env: dict[str, str] | None = None, proc: str = NVIDIA_PROC) -> int:
    """GPUs a process started here would see: those the driver lists, narrowed by
    CUDA_VISIBLE_DEVICES (indices or UUIDs, comma-separated; '' or -1 hide them all)."""
    env = os.environ if env is None else env
    try:
        physical = len([d for d in os.listdir(proc) if not d.startswith(".")])
    except OSError:  # no NVIDIA driver on this host
        return 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    count = 0
    for item in visible.split(","):
        item = item.strip()
        if not item or item.startswith("-"):  # CUDA stops at the first invalid entry
            break
        count += 1
    return min(count, physical)


def installed_torch() -> str:
    """The version of the torch installed here, from its metadata (torch is not imported)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def device_problems(cfg: RunConfig, gpus: int | None = None, torch_version: str | None = None) -> list[str]:
    """Config-time problems of the launch on this host: NCCL without GPUs, engine settings
    that ranks on CPUs or this host's torch cannot honour, or more ranks per host than GPUs
    (the local launcher puts every simulated node on this host, or those of launch.nodes that
    have no prefix)."""
    lc = cfg.launch
    if lc.launcher == "ray":
        return []  # the GPUs are the cluster's: Ray places the workers (ScalingConfig)
    gpus = visible_gpu_count() if gpus is None else gpus
    nodes_here = lc.num_nodes if lc.launcher == "local" else 1
    if lc.nodes:  # launch.nodes: only those without a prefix run here
        nodes_here = sum(1 for node in lc.nodes if not node.prefix)
        if nodes_here == 0:
            return []  # the GPUs are the other machines'
    ranks_here = nodes_here * lc.nproc_per_node
    problems = cfg.engine.torch_problems(installed_torch() if torch_version is None else torch_version)
    if lc.backend == "nccl" and gpus == 0:
        problems.append(
            "launch.backend: 'nccl' needs NVIDIA GPUs and this machine has none (no "
            "driver or CUDA_VISIBLE_DEVICES hides them); run a CPU recipe such as "
            "tiny-cpu, or set launch.backend=gloo with a model small enough for CPUs."
        )
    if gpus == 0 or lc.backend == "gloo":  # the ranks here run on CPUs
        problems += cfg.engine.cpu_problems()
    elif ranks_here > gpus:
        problems.append(
            f"launch.nproc_per_node: {ranks_here} rank(s) on this host need a GPU each "
            f"and it has {gpus}; set launch.nproc_per_node to at most "
            f"{max(1, gpus // nodes_here)} (and train.global_batch_size to a multiple "
            "of the new world size), or launch.backend=gloo to train on CPUs."
        )
    return problems
