"""The soup process: ``python -m stoker.training.soup_main --plan PLAN.json``.

Averages the committed checkpoints a ``storage.soups.SoupPlan`` names into a new checkpoint of
the soup run, tensor by tensor, and commits it with the checkpoint commit protocol (files
first, each with its size and sha256, ``commit.json`` last); prints a Souped event (a failure:
a Failure event). It runs in a process of its own (the orchestrator's rooms never import torch).

Each input is read the way every rank reads a checkpoint: ``rehydrate``'s full sha256 check,
its ``.metadata`` through ``SafeReader`` (nothing is unpickled but DCP's own metadata classes),
its tensors read straight from their storage records (``weights_only`` torch.load where an
item is anything else). Memory: one output tensor in fp32, the first input's chunks read into
it in place, every later input's streamed into it a few MB at a time (``Input.add_weighted``),
never two models and never two copies of the largest tensor (measured: 1.47 x the largest
tensor above the process's fixed overhead, ``benchmarks/bench_soup.py``). The output is one DCP file written as it goes, plus ``.metadata``.

The average of a tensor is ``sum_i (w_i * x_i)`` in fp32, accumulated in input order, then cast
to the stored dtype: model tensors and AdamW's moments (``exp_avg``, ``exp_avg_sq``). Every other
entry (the optimizer's step counters, the RNG states) and ``train_state.json`` are the lead's.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import shutil
import time
import uuid
from typing import Iterator

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from stoker.contracts import events
from stoker.contracts.soups import Souped
from stoker.failures import ConfigError
from stoker.process.quick_exit import quick_exit
from stoker.storage.checkpoints import NUMERICS_FINITE, commit_checkpoint, new_checkpoint_key, rehydrate
from stoker.storage.store import Store, default_cache_dir, join
from stoker.training.checkpoint import TRAIN_STATE
from stoker.training.untrusted import SafeReader

OUT_FILE = "__0_0.distcp"
AVERAGED_OPTIM = (".exp_avg", ".exp_avg_sq")  # AdamW's moments; its step counters are the lead's


def averaged(key: str) -> bool:
    """Whether a checkpoint entry is averaged (model tensors, AdamW moments) or the lead's."""
    return key.startswith("model.") or (key.startswith("optim.") and key.endswith(AVERAGED_OPTIM))


class _Slice(io.RawIOBase):
    """A read-only view of bytes [offset, offset + length) of an open file (one DCP item)."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.start, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


class Input:
    """One rehydrated checkpoint folder: its metadata (SafeReader) and its items' chunks."""

    def __init__(self, folder: str):
        self.folder = folder
        self.meta: Metadata = SafeReader(folder).read_metadata()
        self.files: dict[str, object] = {}

    def entry(self, key: str) -> TensorStorageMetadata:
        md = self.meta.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ConfigError([f"checkpoint {self.folder}: entry {key!r} is no tensor; refusing to read it"])
        return md

    def chunks(self, key: str) -> Iterator[tuple[ChunkStorageMetadata, torch.Tensor]]:
        """Each stored chunk of `key` (one per rank that held a shard of it) and its tensor: read
        straight from the file, no second copy (``_raw_storage``); through torch.load where the
        item is not one plain storage."""
        md = self.entry(key)
        for chunk in md.chunks:
            info = self.meta.storage_data[MetadataIndex(key, chunk.offsets)]
            if getattr(info, "transform_descriptors", None):
                raise ConfigError([f"checkpoint {self.folder}: {key!r} is stored transformed; not supported"])
            f = self.files.get(info.relative_path)
            if f is None:
                f = self.files[info.relative_path] = open(os.path.join(self.folder, info.relative_path), "rb")
            tensor = _raw_storage(f, info, chunk, md.properties.dtype, None)
            if tensor is None:
                tensor = torch.load(_Slice(f, info.offset, info.length), map_location="cpu", weights_only=True)
            yield chunk, tensor

    def add_weighted(self, key: str, acc: torch.Tensor, weight: float, piece: int = 1 << 22) -> None:
        """acc += weight x this input's `key`, in fp32, each chunk streamed from its file
        ``piece`` elements at a time into one small buffer (never the whole chunk in memory);
        through torch.load where a chunk is not one plain storage or its region not contiguous."""
        md = self.entry(key)
        dtype = md.properties.dtype
        buf = None
        for chunk in md.chunks:
            info = self.meta.storage_data[MetadataIndex(key, chunk.offsets)]
            if getattr(info, "transform_descriptors", None):
                raise ConfigError([f"checkpoint {self.folder}: {key!r} is stored transformed; not supported"])
            f = self.files.get(info.relative_path)
            if f is None:
                f = self.files[info.relative_path] = open(os.path.join(self.folder, info.relative_path), "rb")
            region = acc[_region(chunk)]
            record = _raw_record(f, info, chunk, dtype)
            if record is None or not region.is_contiguous():
                tensor = torch.load(_Slice(f, info.offset, info.length), map_location="cpu", weights_only=True)
                region.add_(tensor.float().mul_(weight))
                continue
            flat, size = region.view(-1), torch.empty((), dtype=dtype).element_size()
            if buf is None:
                buf = torch.empty(min(piece, max(1, flat.numel())), dtype=dtype)
            for i in range(0, flat.numel(), piece):
                part = buf[: min(piece, flat.numel() - i)]
                _read_into(f, record[0] + i * size, part)
                flat[i : i + len(part)].add_(part.float().mul_(weight))

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _raw_record(f, info, chunk: ChunkStorageMetadata, dtype: torch.dtype) -> tuple[int, int] | None:
    """(absolute offset in the file, bytes) of the chunk's elements: its torch.save archive's one
    uncompressed storage record (``*/data/0``, exactly the chunk's contiguous elements, as DCP's
    writer stores a chunk); None where the item is anything else (torch.load reads it)."""
    import zipfile

    numel = 1
    for n in chunk.sizes:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        with zipfile.ZipFile(_Slice(f, info.offset, info.length)) as z:
            records = [i for i in z.infolist() if i.filename.endswith("/data/0")]
            others = [i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith("/data/0")]
            if len(records) != 1 or others or records[0].compress_type != zipfile.ZIP_STORED:
                return None
            record = records[0]
            if record.file_size != nbytes:
                return None
            f.seek(info.offset + record.header_offset)
            header = f.read(30)  # the local file header: its name and extra field lengths at 26 and 28
    except zipfile.BadZipFile:
        return None
    names = int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return info.offset + record.header_offset + 30 + names, nbytes


def _read_into(f, start: int, out: torch.Tensor) -> None:
    f.seek(start)
    view = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
    if f.readinto(view) != len(view):
        raise ConfigError([f"a checkpoint file ends inside a tensor's item at byte {start}"])


def _raw_storage(f, info, chunk: ChunkStorageMetadata, dtype: torch.dtype, into: torch.Tensor | None):
    """The chunk's tensor read straight from its storage record (``_raw_record``) into ``into``
    (or a new tensor): no second copy; None where the item is not one plain storage."""
    record = _raw_record(f, info, chunk, dtype)
    if record is None:
        return None
    numel = record[1] // torch.empty((), dtype=dtype).element_size()
    out = into.view(-1)[:numel] if into is not None and into.numel() >= numel else torch.empty(numel, dtype=dtype)
    _read_into(f, record[0], out)
    return out.view(tuple(chunk.sizes))


def _finite(tensor: torch.Tensor, step: int = 1 << 20) -> bool:
    """No NaN/inf in `tensor`, checked a million elements at a time (torch.isfinite of the whole
    makes temporaries of its size)."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + step]).all()) for i in range(0, flat.numel(), step))


def _region(chunk: ChunkStorageMetadata) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))


def read_whole(source: Input, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor `key` of an input, its chunks read into place one by one."""
    md = source.entry(key)
    out = None
    for chunk, tensor in source.chunks(key):
        if out is None:
            if len(md.chunks) == 1 and tuple(chunk.sizes) == tuple(md.size):
                return tensor if dtype is None else tensor.to(dtype)
            out = torch.empty(md.size, dtype=dtype or md.properties.dtype)
        out[_region(chunk)] = tensor
    return out if out is not None else torch.empty(md.size, dtype=dtype or md.properties.dtype)


def average_tensor(inputs: list[Input], weights: list[float], key: str) -> torch.Tensor:
    """sum_i (w_i * x_i) in fp32, in input order, chunk by chunk (see the module docstring)."""
    md = inputs[0].entry(key)
    acc = None
    for i, (source, weight) in enumerate(zip(inputs, weights)):
        got = source.entry(key)
        if tuple(got.size) != tuple(md.size):
            raise ConfigError([f"entry {key!r} is {tuple(got.size)} in input {i}, {tuple(md.size)} in input 0"])
        if i == 0:
            acc = read_whole(source, key, torch.float32)
            acc.mul_(weight)
            continue
        source.add_weighted(key, acc, weight)  # streamed: a few MB of it in memory at a time
    return acc


def average_folders(folders: list[str], weights: list[float], lead: int, out: str) -> dict:
    """Write the soup of the checkpoint folders `folders` into the new folder `out`: one DCP file
    and .metadata, and the lead's train_state.json. Returns {"tensors", "averaged", "largest_bytes"}."""
    inputs = [Input(f) for f in folders]
    try:
        keys = sorted(inputs[lead].meta.state_dict_metadata)
        mine = {k for k in keys if averaged(k)}
        for i, source in enumerate(inputs):
            theirs = {k for k in source.meta.state_dict_metadata if averaged(k)}
            if theirs != mine:
                odd = sorted(theirs ^ mine)[:3]
                raise ConfigError([f"input {i} holds other tensors than input {lead} (e.g. {odd}); not one model"])
        os.makedirs(out)
        state_md, storage, largest, num_averaged = {}, {}, 0, 0
        with open(os.path.join(out, OUT_FILE), "wb") as f:
            for key in keys:
                md = inputs[lead].entry(key)
                if averaged(key):
                    tensor = average_tensor(inputs, weights, key)
                    if tensor.is_floating_point() and not _finite(tensor):
                        raise ConfigError([f"the average of {key!r} holds NaN/inf; an input holds non-finite state"])
                    tensor = tensor.to(md.properties.dtype)
                    num_averaged += 1
                else:
                    tensor = read_whole(inputs[lead], key)
                largest = max(largest, tensor.numel() * tensor.element_size())
                offset = f.tell()
                torch.save(tensor.contiguous(), f)
                zeros = torch.Size([0] * len(md.size))
                state_md[key] = TensorStorageMetadata(md.properties, md.size, [ChunkStorageMetadata(zeros, md.size)])
                storage[MetadataIndex(key, zeros, 0)] = _StorageInfo(OUT_FILE, offset, f.tell() - offset)
                del tensor
        metadata = Metadata(state_md, planner_data={k: (k,) for k in keys}, storage_data=storage)
        metadata.storage_meta = StorageMeta()
        with open(os.path.join(out, ".metadata"), "wb") as f:  # last, as DCP writes it
            pickle.dump(metadata, f)
        shutil.copyfile(os.path.join(folders[lead], TRAIN_STATE), os.path.join(out, TRAIN_STATE))
        return {"tensors": len(keys), "averaged": num_averaged, "largest_bytes": largest}
    finally:
        for source in inputs:
            source.close()


def _describe_local(folder: str) -> dict[str, dict]:
    out = {}
    for name in sorted(os.listdir(folder)):
        digest = hashlib.sha256()
        with open(os.path.join(folder, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[name] = {"size": os.path.getsize(os.path.join(folder, name)), "sha256": digest.hexdigest()}
    return out


def make_soup(plan: dict, cache_dir: str) -> Souped:
    """Rehydrate every input (full check), average them locally, upload the files into a new
    checkpoint folder of the soup run and commit it (commit.json last)."""
    began = time.monotonic()
    store = Store(plan["root"], plan["storage_options"])
    folders = [rehydrate(store, i["key"], cache_dir, expected={"run_name": i["run"]}) for i in plan["inputs"]]
    weights = [float(i["weight"]) for i in plan["inputs"]]
    staging = os.path.join(cache_dir, "soups", f"{plan['soup_id'][:16]}-{uuid.uuid4().hex[:8]}")
    try:
        done = average_folders(folders, weights, int(plan["lead"]), staging)
        files = _describe_local(staging)
        meta = plan["meta"]
        key = new_checkpoint_key(store, plan["run_name"], int(meta["step"]))  # never an earlier attempt's folder
        for name in files:
            store.put_file(os.path.join(staging, name), join(key, name))
        commit_checkpoint(store, key, {**meta, "numerics": NUMERICS_FINITE}, files)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Souped(
        checkpoint=store.url(key),
        key=key,
        step=int(meta["step"]),
        soup_id=plan["soup_id"],
        num_tensors=done["tensors"],
        num_averaged=done["averaged"],
        largest_tensor_bytes=done["largest_bytes"],
        bytes_written=sum(f["size"] for f in files.values()),
        seconds=round(time.monotonic() - began, 3),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Average committed stoker checkpoints into a soup checkpoint.")
    p.add_argument("--plan", required=True, help="a JSON file: storage.soups.SoupPlan.to_json()")
    p.add_argument("--cache-dir", default=default_cache_dir())
    args = p.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    return events.report_outcome(lambda: make_soup(plan, args.cache_dir))


if __name__ == "__main__":
    quick_exit(main())
