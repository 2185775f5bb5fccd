"""Checkpoint save/load with torch.distributed.checkpoint (DCP), tensors only.

The DCP part holds only tensors: model parameters, AdamW moments and step counts, and
every rank's RNG states under ``rng.rank{r}.*``. DCP would unpickle non-tensor entries
with ``weights_only=False``, so none are written and loading refuses any that appear.
Scalars (step, tokens seen, scheduler and param-group hyper-parameters) go to
``train_state.json``. Rank 0 writes ``commit.json`` last, after every rank's files.
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
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from storage.uploader import CheckpointUploader

TRAIN_STATE = "train_state.json"


# ---- RNG state as tensors -------------------------------------------------------------
def rng_state_tensors(rank: int) -> dict[str, torch.Tensor]:
    """Every RNG state of this rank (torch, numpy, python, CUDA), as tensors."""
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
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[p + f"cuda{i}"] = s
    return out


def restore_rng_state(state: dict[str, torch.Tensor], rank: int) -> None:
    p = f"rng.rank{rank}."
    torch.set_rng_state(state[p + "torch"])
    pos, has_gauss = (int(v) for v in state[p + "numpy_meta"])
    np.random.set_state(("MT19937", state[p + "numpy_key"].numpy().astype(np.uint32), pos,
                         has_gauss, float(state[p + "numpy_gauss"])))
    gauss = float(state[p + "python_gauss"])
    random.setstate((3, tuple(int(v) for v in state[p + "python"]), None if math.isnan(gauss) else gauss))
    if torch.cuda.is_available():
        cuda = [state[k] for k in sorted(state) if k.startswith(p + "cuda")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


# ---- model + optimizer as a flat tensor dict ------------------------------------------
def model_optim_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        allocate: bool = False) -> dict[str, torch.Tensor]:
    """model.{fqn} and optim.{fqn}.{moment} tensors, sharing storage with the live ones.

    allocate=True creates empty optimizer state to load into (a fresh run has none)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        out[f"model.{name}"] = param.detach()
        state = optimizer.state[param]
        if allocate and not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                         exp_avg_sq=torch.zeros_like(param))
        for key, value in state.items():
            out[f"optim.{name}.{key}"] = value
    return out


def to_host(state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stage CUDA tensors through pinned host buffers (kept in `buffers` and reused by every
    save): non-blocking device-to-host copies and one synchronize, so DCP then writes from
    host memory. CPU tensors pass through untouched."""
    out, copied = {}, False
    for key, t in state.items():
        if not t.is_cuda:
            out[key] = t
            continue
        buf = buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        out[key], copied = buf, True
    if copied:
        torch.cuda.synchronize()
    return out


@dataclass
class TrainState:
    """The scalars a resumed run continues from."""

    step: int
    tokens_seen: int


def scalar_state(optimizer: torch.optim.Optimizer, scheduler, step: int, tokens_seen: int,
                 seed: int) -> dict:
    """What train_state.json holds: step, tokens seen, scheduler and param-group scalars."""
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"step": step, "tokens_seen": tokens_seen, "scheduler": sched,
            "param_groups": json.loads(json.dumps(groups)),
            "sampler": {"kind": "pure(seed, step, rank)", "seed": seed, "next_step": step}}


def _broadcast_str(value: str | None) -> str:
    if not _is_dist():
        return value
    box = [value]
    # group: world; rank 0 alone picks the folder name so every rank writes into one folder
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_state(uploader: CheckpointUploader, state: dict[str, torch.Tensor], scalars: dict,
               step: int, meta: dict) -> str:
    """Write this step's checkpoint to local staging (the part the training thread waits for)
    and hand it to the uploader, which uploads and commits it. Returns the checkpoint key."""
    uploader.wait()  # one checkpoint in flight per rank
    t0 = time.perf_counter()
    key = _broadcast_str(uploader.new_key(step) if uploader.rank == 0 else None)
    local = uploader.staging_folder(key)
    os.makedirs(local, exist_ok=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(local))  # collective; .metadata last
    names = sorted(n for n in os.listdir(local) if n.startswith(f"__{uploader.rank}_"))
    if uploader.rank == 0:
        with open(os.path.join(local, TRAIN_STATE), "w") as f:
            json.dump(scalars, f, indent=2, sort_keys=True)
        names += [".metadata", TRAIN_STATE]
    uploader.submit(key, names, step, meta, time.perf_counter() - t0)
    if not uploader.async_enabled and _is_dist():
        dist.barrier()  # group: world; synchronous mode: no rank runs ahead of the commit
    return key


def load_checkpoint(folder: str, *, model, optimizer=None, scheduler=None,
                    rank: int = 0) -> TrainState | None:
    """Load a checkpoint from a local folder (see storage.checkpoints.rehydrate) in place.

    Only tensors are read; any non-tensor entry among the requested keys is refused rather
    than unpickled. Without an optimizer only the model is loaded."""
    reader = dcp.FileSystemReader(folder)
    if optimizer is None:
        state = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    else:
        state = {**model_optim_tensors(model, optimizer, allocate=True), **rng_state_tensors(rank)}
    saved = reader.read_metadata().state_dict_metadata
    missing = sorted(k for k in state if k not in saved)
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {len(missing)} entries, e.g. {missing[:3]}; "
                         "it was written by another model or world size")
    unsafe = sorted(k for k in state if not isinstance(saved[k], TensorStorageMetadata))
    if unsafe:
        raise ValueError(f"checkpoint {folder} holds non-tensor entries {unsafe[:3]}; refusing to unpickle")
    with torch.no_grad():
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=not _is_dist())
    if optimizer is None:
        return None
    restore_rng_state(state, rank)
    with open(os.path.join(folder, TRAIN_STATE)) as f:
        scalars = json.load(f)
    for group, saved_group in zip(optimizer.param_groups, scalars["param_groups"]):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved_group.items()})
    if scheduler is not None:
        scheduler.load_state_dict({**scalars["scheduler"], "lr_lambdas": [None] * len(optimizer.param_groups)})
    return TrainState(scalars["step"], scalars["tokens_seen"])


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()
