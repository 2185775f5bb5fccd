"""Initial weights from a base model (``model.init_from``), read slice by slice.

A run takes its base's weights only when it has no valid checkpoint: model only (the
optimizer and the schedule start fresh); once a checkpoint is committed, resume owns the
weights (``train.run_rank`` decides, and says which one ran).

Each rank reads only its own slices: for every parameter, the family's adapter names the
Hugging Face tensor it comes from (``ModelSpec.hf_map``); under FSDP2 the parameter is a
DTensor sharded on its first dimension, and the rank reads just the rows of its shard through
safetensors' lazy ``get_slice`` (columns, for a transposed tensor), so no rank ever holds the
whole model, on the host or the device. Nothing is unpickled: safetensors holds tensors only.
"""

from __future__ import annotations

import json
import os

import torch

from stoker.training.models import is_vocab, spec_of

INDEX = "model.safetensors.index.json"


def weight_files(folder: str) -> dict[str, str]:
    """{HF tensor name: the safetensors file that holds it} of a base folder."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return {name: os.path.join(folder, file) for name, file in json.load(f)["weight_map"].items()}
    from safetensors import safe_open

    single = os.path.join(folder, "model.safetensors")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _rows_of(param: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """(first row, rows, local shape) of this rank's part of a parameter: a DTensor's shard of
    dim 0, or the whole of a plain tensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return (offset[0] if shape else 0), (shape[0] if shape else 0), tuple(shape)
    return 0, (param.shape[0] if param.dim() else 0), tuple(param.shape)


@torch.no_grad()
def load_base(model: torch.nn.Module, model_cfg, folder: str) -> int:
    """Copy the base's weights at `folder` into `model` (plain or FSDP2-sharded), reading only
    this rank's slices, one safetensors file at a time (a file's mapping is closed before the
    next is opened, so the pages read stay bounded by one file); returns the bytes read.
    ValueError naming a tensor that is missing or of another shape."""
    from safetensors import safe_open

    spec = spec_of(model_cfg)
    where = weight_files(folder)
    tied = set(spec.hf_tied(model_cfg))
    by_file: dict[str, list[tuple[str, str, bool]]] = {}
    for ours, theirs, transpose in spec.hf_map(model_cfg):
        if ours in tied:
            continue
        if theirs not in where:
            raise ValueError(f"the base has no tensor {theirs!r} (for {ours}); is it a {spec.family} model?")
        by_file.setdefault(where[theirs], []).append((ours, theirs, transpose))
    read = 0
    for path, entries in by_file.items():
        with safe_open(path, framework="pt") as f:
            for ours, theirs, transpose in entries:
                read += _copy_slice(model.get_parameter(ours), ours, f.get_slice(theirs), theirs, transpose)
    return read


def _copy_slice(param: torch.Tensor, ours: str, sl, theirs: str, transpose: bool) -> int:
    """This rank's rows of `param` from the lazy slice `sl` of the base's tensor; the bytes read."""
    start, rows, _ = _rows_of(param)
    full = list(sl.get_shape())
    full = full[::-1] if transpose else full
    expected = list(param.shape)
    # a padded vocabulary may hold more rows than the base (zeros, never a target); a base's
    # longer position table gives its first rows
    if full[1:] != expected[1:] or (full[0] < expected[0] and not is_vocab(ours)):
        raise ValueError(f"the base's {theirs} has shape {sl.get_shape()}, the model's {ours} {expected}")
    stop = min(start + rows, full[0])
    part = (sl[:, start:stop].t() if transpose else sl[start:stop]) if stop > start else None
    local = param.to_local() if hasattr(param, "to_local") else param
    if part is None or part.shape[0] < rows:
        local.zero_()
    if part is None:
        return 0
    local[: part.shape[0]].copy_(part.to(local.dtype))
    return part.numel() * part.element_size()
