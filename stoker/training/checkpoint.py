"""Checkpoint state in and out of live objects, with torch.distributed.checkpoint (DCP).

State goes through ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
``set_state_dict``), so a checkpoint written under DDP or FSDP2, with fused or plain AdamW,
at one world size loads under any other: DCP reshards on load.

The DCP part holds only tensors: ``model.{fqn}``, ``optim.{fqn}.{exp_avg,exp_avg_sq,step}``
and each rank's own RNG states under ``rng.rank{r}.*`` (torch, numpy, python and the RNG of
the rank's current CUDA device only, so the checkpoint loads on a host with another GPU
count). DCP would unpickle non-tensor entries with ``weights_only=False``, so none are
written and loading refuses any that appear. Scalars (step, tokens seen, scheduler and
param-group hyper-parameters) go to ``train_state.json``. Rank 0 writes ``commit.json``
last, after every rank's files (storage.uploader).

Saving (``Checkpointer.save``) costs the training thread only the copy of the state into
reused host buffers (pinned on CUDA, copied without blocking: the copies are ordered
before the next step's kernels on the same stream), after waiting for the previous save's
DCP write to staging (never for its upload). The DCP write runs on the uploader's write
thread, whose collectives use their own gloo group; checksums, upload and commit run on its
upload thread.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from stoker.storage.uploader import CheckpointUploader
from stoker.training.untrusted import SafeReader

TRAIN_STATE = "train_state.json"
# how the live optimizer runs, never taken from a checkpoint (it may come from other hardware)
_IMPLEMENTATION_KEYS = {"params", "fused", "foreach", "capturable", "differentiable"}


# ---- RNG state as tensors -------------------------------------------------------------
def rng_state_tensors(rank: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Every RNG state of this rank (torch, numpy, python, its CUDA device), as tensors."""
    p = f"rng.rank{rank}."
    _, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    py_version, py_state, py_gauss = random.getstate()
    out = {
        p + "torch": torch.get_rng_state(),
        p + "numpy_key": torch.from_numpy(np_key.astype(np.int64)),
        p + "numpy_meta": torch.tensor([np_pos, np_has_gauss], dtype=torch.int64),
        p + "numpy_gauss": torch.tensor(np_gauss, dtype=torch.float64),
        p + "python": torch.tensor(py_state, dtype=torch.int64),
        p + "python_gauss": torch.tensor(math.nan if py_gauss is None else py_gauss, dtype=torch.float64),
    }
    if device is not None and device.type == "cuda":
        out[p + "cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore_rng_state(state: dict[str, torch.Tensor], rank: int, device: torch.device | None = None) -> None:
    p = f"rng.rank{rank}."
    torch.set_rng_state(state[p + "torch"])
    pos, has_gauss = (int(v) for v in state[p + "numpy_meta"])
    np.random.set_state(
        ("MT19937", state[p + "numpy_key"].numpy().astype(np.uint32), pos, has_gauss, float(state[p + "numpy_gauss"]))
    )
    gauss = float(state[p + "python_gauss"])
    random.setstate((3, tuple(int(v) for v in state[p + "python"]), None if math.isnan(gauss) else gauss))
    if device is not None and device.type == "cuda" and p + "cuda" in state:
        torch.cuda.set_rng_state(state[p + "cuda"], device)


def seed_rank_rngs(seed: int, rank: int, step: int = 0, device: torch.device | None = None) -> None:
    """The per-rank streams (dropout, anything drawing from numpy or random): a function of
    (seed, rank, step); used at the start and when a checkpoint of another world size holds
    no stream for this rank."""
    s = (seed * 1_000_003 + 1 + rank + 7919 * step) % 2**32
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)
    if device is not None and device.type == "cuda":
        torch.cuda.manual_seed(s)


# ---- model + optimizer as a flat tensor dict ------------------------------------------
def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied parameters: {alias name: the name its tensor is saved under}."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def flat_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """``model.*`` and ``optim.*`` tensors (live ones, or DTensor shards under FSDP2) through
    get_state_dict, and the optimizer's param groups. A fresh optimizer gets its state
    allocated first, so the dict can be loaded into."""
    if optimizer is None:
        msd, groups, ostate = get_model_state_dict(model), [], {}
    else:
        msd, osd = get_state_dict(model, optimizer)
        groups, ostate = osd["param_groups"], osd["state"]
    aliases = _aliases(model)
    out = {f"model.{k}": v for k, v in msd.items() if k not in aliases}
    for fqn, entries in ostate.items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            out[f"optim.{fqn}.{key}"] = value
    return out, groups


def scalar_state(
    param_groups: list[dict], scheduler, step: int, tokens_seen: int, seed: int, global_batch_size: int
) -> dict:
    """What train_state.json holds: step, tokens seen, scheduler and param-group scalars."""
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    groups = [{k: v for k, v in g.items() if k not in _IMPLEMENTATION_KEYS} for g in param_groups]
    return {
        "step": step,
        "tokens_seen": tokens_seen,
        "scheduler": sched,
        "param_groups": json.loads(json.dumps(groups)),
        "sampler": {
            "kind": "pure(seed, step, position in global batch)",
            "seed": seed,
            "next_step": step,
            "global_batch_size": global_batch_size,
        },
    }


@dataclass
class TrainState:
    """The scalars a resumed run continues from."""

    step: int
    tokens_seen: int
    rng_restored: bool = True  # False: saved at another world size, streams re-seeded


class Checkpointer:
    """Saves one rank's share of the training state; see the module docstring."""

    def __init__(
        self,
        uploader: CheckpointUploader,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        seed: int,
        global_batch_size: int,
        group: "dist.ProcessGroup | None" = None,
    ):
        self.uploader, self.model, self.optimizer, self.scheduler = uploader, model, optimizer, scheduler
        self.rank, self.world_size, self.device = rank, world_size, device
        self.seed, self.global_batch_size, self.group = seed, global_batch_size, group
        self.buffers: dict | None = None  # host copies, reused by every save
        self.last_stall_seconds = 0.0

    def save(self, step: int, tokens_seen: int, meta: dict) -> float:
        """Copy this step's state to host buffers and hand the rest to the uploader's threads.
        Returns the seconds the training thread spent."""
        # the buffers of the previous save are free once it is written; its upload may go on
        self.uploader.wait_written()
        t0 = time.perf_counter()
        state, groups = flat_state(self.model, self.optimizer)
        state.update(rng_state_tensors(self.rank, self.device))
        cuda = self.device.type == "cuda"
        if self.buffers is None or self.buffers.keys() != state.keys():
            self.buffers = _create_cpu_state_dict(state, pin_memory=cuda)
        _copy_state_dict(state, self.buffers, non_blocking=cuda)
        copied = torch.cuda.Event() if cuda else None
        if copied is not None:
            copied.record()
        scalars = scalar_state(groups, self.scheduler, step, tokens_seen, self.seed, self.global_batch_size)
        host, group, rank = self.buffers, self.group, self.rank

        def write(key: str, folder: str) -> list[str]:
            """On the uploader's write thread: DCP-write this rank's files into folder."""
            if copied is not None:
                copied.synchronize()
            os.makedirs(folder, exist_ok=True)
            if _is_dist():  # collective over the checkpoint group; .metadata last
                dcp.save(host, storage_writer=dcp.FileSystemWriter(folder), process_group=group)
            else:
                dcp.save(host, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
            names = sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_"))
            if rank == 0:
                with open(os.path.join(folder, TRAIN_STATE), "w") as f:
                    json.dump(scalars, f, indent=2, sort_keys=True)
                names += [".metadata", TRAIN_STATE]
            return names

        self.uploader.submit(step, meta, write)
        if not self.uploader.async_enabled and _is_dist():
            dist.barrier()  # group: world; synchronous mode: no rank runs ahead of the commit
        self.last_stall_seconds = time.perf_counter() - t0
        return self.last_stall_seconds


def agree_on_checkpoint(group: "dist.ProcessGroup | None"):
    """The uploader's agreement before each checkpoint: every rank's proposal (rank 0's
    folder and drops, any rank's permanent storage error), in rank order, on every rank (an
    all-gather over the checkpoint group, on the uploader's write thread)."""

    def agree(mine: dict) -> list[dict]:
        if not _is_dist():
            return [mine]
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)  # group: checkpoint (gloo), in order
        return everyone

    return agree


def load_checkpoint(
    folder: str,
    *,
    model,
    optimizer=None,
    scheduler=None,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | None = None,
    seed: int = 0,
) -> TrainState | None:
    """Load a checkpoint from a local folder (see storage.checkpoints.rehydrate) in place.

    Only tensors are read; any non-tensor entry among the requested keys is refused rather
    than unpickled. Without an optimizer only the model is loaded. RNG streams are restored
    when the checkpoint was written at this world size; otherwise they are re-seeded from
    (seed, rank, step) and ``rng_restored`` is False."""
    saved = SafeReader(folder).read_metadata().state_dict_metadata
    state, groups = flat_state(model, optimizer)
    saved_ranks = {k.split(".")[1] for k in saved if k.startswith("rng.rank")}
    same_world = optimizer is not None and saved_ranks == {f"rank{r}" for r in range(world_size)}
    if same_world:
        rng = rng_state_tensors(rank, device)
        state.update({k: v for k, v in rng.items() if k in saved})
    missing = sorted(k for k in state if k not in saved)
    if missing:
        raise ValueError(
            f"checkpoint {folder} lacks {len(missing)} entries, e.g. {missing[:3]}; it was written for another model"
        )
    unsafe = sorted(k for k in state if not isinstance(saved[k], TensorStorageMetadata))
    if unsafe:
        raise ValueError(f"checkpoint {folder} holds non-tensor entries {unsafe[:3]}; refusing to unpickle")
    with torch.no_grad():
        dcp.load(state, storage_reader=SafeReader(folder), no_dist=not _is_dist())
    aliases = _aliases(model)
    msd = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    msd.update({alias: msd[target] for alias, target in aliases.items()})
    if optimizer is None:
        set_model_state_dict(model, msd)
        return None
    with open(os.path.join(folder, TRAIN_STATE)) as f:
        scalars = json.load(f)
    ostate: dict[str, dict] = {}
    for k, v in state.items():
        if k.startswith("optim."):
            fqn, _, entry = k[len("optim.") :].rpartition(".")
            ostate.setdefault(fqn, {})[entry] = v
    for group, saved_group in zip(groups, scalars["param_groups"]):
        group.update(
            {k: tuple(v) if isinstance(v, list) else v for k, v in saved_group.items() if k not in _IMPLEMENTATION_KEYS}
        )
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict={"state": ostate, "param_groups": groups})
    if scheduler is not None:
        scheduler.load_state_dict({**scalars["scheduler"], "lr_lambdas": [None] * len(optimizer.param_groups)})
    if same_world:
        restore_rng_state(state, rank, device)
    else:
        seed_rank_rngs(seed, rank, scalars["step"], device)
    return TrainState(scalars["step"], scalars["tokens_seen"], rng_restored=same_world)


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()
