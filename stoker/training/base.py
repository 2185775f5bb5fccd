"""Initial weights from a base model (``model.init_from``), read slice by slice.

A run takes its base's weights only when it has no valid checkpoint: model only (the
optimizer and the schedule start fresh); once a checkpoint is committed, resume owns the
weights (``train.run_rank`` decides, and says which one ran).

Each rank reads only its own slices: for every parameter, the family's adapter names the
Hugging Face tensor it comes from (``ModelSpec.hf_map``); under FSDP2 the parameter is a
DTensor sharded on its first dimension, and the rank reads just the rows of its shard, one
contiguous byte range of the safetensors file read straight into the parameter's memory
(GPT-2's transposed Conv1D weights: their columns, through safetensors' lazy ``get_slice``), so
no rank ever holds the whole model, on the host or the device. Under engine.parallelism
'fsdp+tp' a row-wise projection (o_proj, down_proj) is split on its columns too: the rank
reads its rows whole and keeps its columns. Nothing is unpickled: safetensors holds tensors
only.
"""

from __future__ import annotations

import json
import math
import os

import torch

from stoker.families import spec_of
from stoker.families.spec import is_vocab

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


def _rows_of(param: torch.Tensor) -> tuple[int, int]:
    """(first row, rows) of this rank's part of a parameter: a DTensor's shard of dim 0, or the
    whole of a plain tensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return (offset[0] if shape else 0), (shape[0] if shape else 0)
    return 0, (param.shape[0] if param.dim() else 0)


def _columns_of(param: torch.Tensor) -> tuple[int, int] | None:
    """(first column, columns) of this rank's part of a matrix split on its columns too (a
    row-wise tensor-parallel projection, engine.parallelism 'fsdp+tp'), else None."""
    if not hasattr(param, "device_mesh") or param.dim() < 2:
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return (offset[1], shape[1]) if shape[1] != param.shape[1] else None


@torch.no_grad()
def load_base(model: torch.nn.Module, model_cfg, folder: str) -> int:
    """Copy the base's weights at `folder` into `model` (plain or FSDP2-sharded), reading only
    this rank's slices; returns the bytes read. A slice of rows (every tensor but GPT-2's
    transposed Conv1D weights) is one contiguous byte range of its file, read straight into
    the parameter's own memory (through a buffer of the slice's size when the dtypes differ);
    a transposed one goes through safetensors' lazy get_slice, one file mapped at a time.
    Every parameter must be written: ValueError naming a tensor that is missing, of another
    shape, or a parameter the base does not cover (the model is built without initial values
    when a base is loaded)."""
    spec = spec_of(model_cfg)
    where = weight_files(folder)
    tied = set(spec.hf_tied(model_cfg))
    fused = spec.hf_fused(model_cfg)
    by_file: dict[str, list[tuple[str, str, bool]]] = {}
    stacked: list[tuple[str, tuple[str, ...]]] = []
    for ours, theirs, transpose in spec.hf_map(model_cfg):
        if ours in tied:
            continue
        if isinstance(theirs, tuple):  # a mixture's experts: per-expert tensors, or a fused one
            present = theirs[0] in where or fused.get(ours, ("",))[0] in where
            if not present:
                raise ValueError(f"the base has no tensor {theirs[0]!r} (for {ours}); is it a {spec.family} model?")
            stacked.append((ours, theirs))
            continue
        if theirs not in where and ours in fused:  # transformers 5's own layout's name of it
            theirs = fused[ours][0]
        if theirs not in where:
            raise ValueError(f"the base has no tensor {theirs!r} (for {ours}); is it a {spec.family} model?")
        by_file.setdefault(where[theirs], []).append((ours, theirs, transpose))
    written = {ours for entries in by_file.values() for ours, _, _ in entries} | tied | {o for o, _ in stacked}
    missing = [name for name, _ in model.named_parameters() if name not in written]
    if missing:
        raise ValueError(f"the {spec.family} adapter maps no tensor of the base to {', '.join(missing)}")
    read = 0
    for path, entries in by_file.items():
        header, data_start = safetensors_header(path)
        with open(path, "rb") as raw:
            for ours, theirs, transpose in entries:
                param = model.get_parameter(ours)
                if transpose:
                    read += _copy_transposed(param, ours, path, theirs)
                else:
                    read += _read_rows(param, ours, raw, header[theirs], data_start, theirs)
    headers: dict[str, tuple[dict, int]] = {}
    for ours, theirs in stacked:
        read += _read_experts(model.get_parameter(ours), ours, theirs, fused.get(ours), where, headers)
    return read


def _read_experts(param, ours: str, theirs: tuple[str, ...], fused, where: dict, headers: dict) -> int:
    """This rank's experts of a stacked (E, F, D) weight (dim 0 sharded by FSDP2 or expert
    parallel): each expert's (F, D) from its own tensor (``experts.{e}.….weight``), or its part
    of transformers 5's fused (E, parts x F, D) tensor; each one contiguous byte range read
    into the expert's rows."""
    start, rows = _rows_of(param)
    local = param.to_local() if hasattr(param, "to_local") else param
    per_expert = list(param.shape[1:])
    read = 0
    for e in range(start, min(start + rows, param.shape[0])):
        if theirs[0] in where:
            name, offset_rows, full = theirs[e], 0, None
        else:
            name, part, parts = fused
            offset_rows, full = (
                e * parts * per_expert[0] + part * per_expert[0],
                [param.shape[0], parts * per_expert[0]],
            )
        path = where[name]
        if path not in headers:
            headers[path] = safetensors_header(path)
        header, data_start = headers[path]
        entry = header[name]
        shape = list(entry["shape"])
        expected = per_expert if full is None else full + per_expert[1:]
        if shape != expected:
            raise ValueError(f"the base's {name} has shape {shape}, the model's {ours} needs {expected}")
        dtype = _DTYPES[entry["dtype"]]
        target = local[e - start]
        buf = torch.empty(target.shape, dtype=dtype)
        view = memoryview(buf.view(torch.uint8).numpy()).cast("B")
        with open(path, "rb") as f:
            f.seek(data_start + entry["data_offsets"][0] + offset_rows * per_expert[1] * dtype.itemsize)
            if f.readinto(view) != len(view):
                raise ValueError(f"the base's file for {name} ends before the tensor does")
        target.copy_(buf.to(local.dtype))
        read += len(view)
    return read


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_header(path: str) -> tuple[dict, int]:
    """(the header {name: {dtype, shape, data_offsets}}, where the data starts) of a
    safetensors file: an 8-byte little-endian length, then that much JSON."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def _check_shape(param: torch.Tensor, ours: str, full: list[int], theirs: str) -> None:
    expected = list(param.shape)
    # a padded vocabulary may hold more rows than the base (zeros, never a target); a base's
    # longer position table gives its first rows; any other difference is refused
    shorter_ok, longer_ok = is_vocab(ours), ours.endswith("wpe.weight")
    if (
        full[1:] != expected[1:]
        or (full[0] < expected[0] and not shorter_ok)
        or (full[0] > expected[0] and not longer_ok)
    ):
        raise ValueError(f"the base's {theirs} has shape {full}, the model's {ours} {expected}")


def _read_rows(param: torch.Tensor, ours: str, f, entry: dict, data_start: int, theirs: str) -> int:
    """This rank's rows of `param` read from the file `f`: rows [start, stop) of a row-major
    tensor are bytes [begin + start*row, begin + stop*row)."""
    full = list(entry["shape"])
    _check_shape(param, ours, full, theirs)
    dtype = _DTYPES[entry["dtype"]]
    start, rows = _rows_of(param)
    stop = min(start + rows, full[0])
    local = param.to_local() if hasattr(param, "to_local") else param
    if stop - start < rows:  # padded vocabulary rows, beyond the base's
        local.zero_()
    if stop <= start:
        return 0
    row_bytes = dtype.itemsize * (math.prod(full[1:]) if len(full) > 1 else 1)
    f.seek(data_start + entry["data_offsets"][0] + start * row_bytes)
    target = local[: stop - start]
    columns = _columns_of(param)
    if columns is not None:  # this rank's columns of each of its rows: the whole rows are read
        rows_read = torch.empty((stop - start, *full[1:]), dtype=dtype)
        view = memoryview(rows_read.view(torch.uint8).numpy()).cast("B") if rows_read.numel() else memoryview(b"")
        if f.readinto(view) != len(view):
            raise ValueError(f"the base's file for {theirs} ends before the tensor does")
        first, count = columns
        target.copy_(rows_read[:, first : first + count].to(local.dtype))
        return len(view)
    same = local.dtype == dtype and target.is_contiguous() and target.device.type == "cpu"
    buf = target if same else torch.empty(target.shape, dtype=dtype)
    view = memoryview(buf.view(torch.uint8).numpy()).cast("B") if buf.numel() else memoryview(b"")
    if f.readinto(view) != len(view):
        raise ValueError(f"the base's file for {theirs} ends before the tensor does")
    if not same:
        target.copy_(buf.to(local.dtype))
    return len(view)


def _copy_transposed(param: torch.Tensor, ours: str, path: str, theirs: str) -> int:
    """This rank's rows of `param` from the columns of the base's (in, out) tensor (GPT-2's
    Conv1D weights), through safetensors' lazy slice."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        sl = f.get_slice(theirs)
        full = list(sl.get_shape())[::-1]
        _check_shape(param, ours, full, theirs)
        start, rows = _rows_of(param)
        stop = min(start + rows, full[0])
        local = param.to_local() if hasattr(param, "to_local") else param
        if stop - start < rows:
            local.zero_()
        if stop <= start:
            return 0
        part = sl[:, start:stop].t()
        local[: part.shape[0]].copy_(part.to(local.dtype))
        return part.numel() * part.element_size()
