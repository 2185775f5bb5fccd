"""The soup process: ``python -m stoker.training.soup_main --plan PLAN.json``.

Averages the committed checkpoints a ``storage.soups.SoupPlan`` names into a new checkpoint of
the soup run, tensor by tensor, and commits it with the checkpoint commit protocol (files
first, each with its size and sha256, ``commit.json`` last); prints a Souped event (a failure:
a Failure event). It runs in a process of its own (the orchestrator's rooms never import torch).

Each input is read the way every rank reads a checkpoint: ``rehydrate``'s full sha256 check,
its ``.metadata`` through ``SafeReader`` (nothing is unpickled but DCP's own metadata classes),
its tensors with ``weights_only`` loading. Memory: one output tensor in fp32 and one input's
chunk of it at a time (a sharded checkpoint's per-rank chunks are read one by one into place),
never two models. The output is one DCP file written as it goes, plus ``.metadata``.

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
        """Each stored chunk of `key` (one per rank that held a shard of it) and its tensor."""
        for chunk in self.entry(key).chunks:
            info = self.meta.storage_data[MetadataIndex(key, chunk.offsets)]
            if getattr(info, "transform_descriptors", None):
                raise ConfigError([f"checkpoint {self.folder}: {key!r} is stored transformed; not supported"])
            f = self.files.get(info.relative_path)
            if f is None:
                f = self.files[info.relative_path] = open(os.path.join(self.folder, info.relative_path), "rb")
            tensor = torch.load(_Slice(f, info.offset, info.length), map_location="cpu", weights_only=True)
            yield chunk, tensor

    def close(self) -> None:
        for f in self.files.values():
            f.close()


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
        for chunk, tensor in source.chunks(key):
            part = tensor.float()  # the loaded chunk itself when fp32: no copy
            acc[_region(chunk)].add_(part.mul_(weight))
            del part, tensor
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
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
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
