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
import shutil
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from storage.checkpoints import (
    commit_checkpoint,
    list_checkpoints,
    new_checkpoint_key,
    prune_checkpoints,
    rank_receipt_key,
)
from storage.store import Store, default_cache_dir, join, sha256_file

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
    step: int
    tokens_seen: int
    scheduler: dict
    param_groups: list[dict]
    sampler: dict


def _scalar_state(optimizer: torch.optim.Optimizer, scheduler, step: int, tokens_seen: int,
                  seed: int) -> dict:
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"step": step, "tokens_seen": tokens_seen, "scheduler": sched,
            "param_groups": json.loads(json.dumps(groups)),
            "sampler": {"kind": "pure(seed, step, rank)", "seed": seed, "next_step": step}}


def _broadcast_str(value: str | None, is_dist: bool) -> str:
    if not is_dist:
        return value
    box = [value]
    # group: world; rank 0 alone picks the folder name so every rank writes into one folder
    dist.broadcast_object_list(box, src=0)
    return box[0]


def with_retries(fn, *, what: str, deadline: float, on_retry=None):
    """Call fn until it succeeds or the deadline passes; backoff 0.5 s doubling to 8 s."""
    delay, attempt = 0.5, 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as err:  # storage errors come in many types (OSError, botocore, aiohttp)
            if time.monotonic() + delay > deadline:
                raise RuntimeError(f"{what} failed after {attempt} attempts: {err!r}") from err
            if on_retry:
                on_retry(attempt, err)
            time.sleep(delay + random.Random(attempt).random() * delay * 0.25)
            delay = min(delay * 2, 8.0)


def _pin_upload_thread() -> None:
    """STOKER_UPLOAD_CPUS="1" or "2,3": keep this upload thread off the training cores."""
    cpus = os.environ.get("STOKER_UPLOAD_CPUS")
    if cpus and hasattr(os, "sched_setaffinity") and threading.current_thread() is not threading.main_thread():
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


class CheckpointWriter:
    """One per rank. save() stages the DCP files on local disk (a collective; the only part
    training waits for), then a background thread uploads this rank's files with retries,
    checksummed locally, and writes a receipt. Rank 0's thread then waits for every rank's
    receipt and writes commit.json last. One save in flight: the next save, and close(),
    wait for the previous one. Nothing here touches the store from the training thread,
    so a storage outage delays checkpoints but never stops training."""

    def __init__(self, store: Store, run_name: str, *, rank: int, world_size: int,
                 staging_root: str, keep_latest_k: int, upload_timeout: float,
                 commit_timeout: float, async_enabled: bool, on_event=None, after_commit=None):
        self.store, self.run_name, self.rank, self.world_size = store, run_name, rank, world_size
        self.staging_root, self.keep_latest_k = staging_root, keep_latest_k
        self.upload_timeout, self.commit_timeout = upload_timeout, commit_timeout
        self.async_enabled = async_enabled
        self.on_event = on_event or (lambda **kw: None)
        self.after_commit = after_commit or (lambda: None)
        self.is_dist = dist.is_available() and dist.is_initialized()
        self.thread: threading.Thread | None = None
        self.failures: list[str] = []
        self.last_finish_seconds = 0.0  # upload (+ commit on rank 0) of the last checkpoint
        # folder names already used, read once; later names are derived without listing
        self.taken = ({r.name for r in list_checkpoints(store, run_name)} if rank == 0 else set())

    def save(self, state: dict[str, torch.Tensor], scalars: dict, step: int, meta: dict) -> str:
        self.wait()
        t0 = time.perf_counter()
        key = None
        if self.rank == 0:
            key = new_checkpoint_key(self.store, self.run_name, step, taken=self.taken)
            self.taken.add(key.rsplit("/", 1)[-1])
        key = _broadcast_str(key, self.is_dist)
        local = self.store.local_path(key) if self.store.is_local else os.path.join(self.staging_root, key)
        os.makedirs(local, exist_ok=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(local))  # collective; .metadata last
        mine = sorted(n for n in os.listdir(local) if n.startswith(f"__{self.rank}_"))
        if self.rank == 0:
            with open(os.path.join(local, TRAIN_STATE), "w") as f:
                json.dump(scalars, f, indent=2, sort_keys=True)
            mine += [".metadata", TRAIN_STATE]
        staged = time.perf_counter() - t0
        job = (key, local, mine, step, meta, staged)
        if self.async_enabled:
            self.thread = threading.Thread(target=self._finish, args=job, daemon=True,
                                           name=f"ckpt-upload-{step}")
            self.thread.start()
        else:
            self._finish(*job)
            if self.is_dist:
                dist.barrier()  # group: world; synchronous mode: no rank runs ahead of the commit
        return key

    def wait(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.thread = None

    def close(self, timeout: float | None = None) -> None:
        """Wait for the upload in flight (at most `timeout` seconds when given)."""
        self.wait(timeout)

    # ---- background part -------------------------------------------------------------
    def _finish(self, key, local, names, step, meta, staged_seconds) -> None:
        _pin_upload_thread()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.upload_timeout
        try:
            files = {}
            for name in names:
                path = os.path.join(local, name)
                files[name] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
                if not self.store.is_local:
                    with_retries(lambda: self.store.put_file(path, join(key, name)),
                                 what=f"upload of {name}", deadline=deadline,
                                 on_retry=lambda n, e: self.on_event(event="upload_retry", step=step,
                                                                     rank=self.rank, attempt=n, error=repr(e)[:200]))
            upload_seconds = time.perf_counter() - t0
            receipt = {"rank": self.rank, "files": files, "upload_seconds": upload_seconds}
            with_retries(lambda: self.store.write_json(rank_receipt_key(key, self.rank), receipt),
                         what="upload receipt", deadline=deadline)
            if not self.store.is_local and self.rank != 0:  # rank 0 clears the folder after commit
                for name in names:
                    os.remove(os.path.join(local, name))
            if self.rank == 0:
                self._commit(key, local, step, meta, staged_seconds, t0)
            self.last_finish_seconds = time.perf_counter() - t0
        except Exception as err:
            self.failures.append(f"step {step}: {err}")
            self.on_event(event="checkpoint_failed", step=step, rank=self.rank, error=str(err)[:500])

    def _commit(self, key, local, step, meta, staged_seconds, t0) -> None:
        deadline = time.monotonic() + self.commit_timeout
        receipts = {}
        while len(receipts) < self.world_size:
            for r in range(self.world_size):
                try:
                    if r not in receipts and self.store.exists(rank_receipt_key(key, r), refresh=True):
                        receipts[r] = self.store.read_json(rank_receipt_key(key, r))
                except Exception:  # storage blinking: ask again until the deadline
                    pass
            if len(receipts) < self.world_size:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(receipts))
                    raise RuntimeError(f"ranks {missing} never reported their upload; not committed")
                time.sleep(0.2)
        files = {name: entry for rec in receipts.values() for name, entry in rec["files"].items()}
        upload_seconds = max(rec["upload_seconds"] for rec in receipts.values())
        manifest = with_retries(
            lambda: commit_checkpoint(self.store, key, {
                "step": step, "world_size": self.world_size, **meta,
                "upload_seconds": upload_seconds}, files=files),
            what="commit manifest", deadline=deadline)
        with_retries(lambda: prune_checkpoints(self.store, self.run_name, self.keep_latest_k),
                     what="retention", deadline=deadline)
        if not self.store.is_local:
            shutil.rmtree(local, ignore_errors=True)
        self.on_event(event="checkpoint", step=step, uri=self.store.url(key),
                      bytes=sum(e["size"] for e in manifest["files"].values()),
                      stage_seconds=round(staged_seconds, 3), upload_seconds=round(upload_seconds, 3),
                      commit_seconds=round(time.perf_counter() - t0, 3))
        self.after_commit()


def save_checkpoint(store: Store, run_name: str, *, model, optimizer, scheduler, step: int,
                    tokens_seen: int, seed: int, rank: int, world_size: int, meta: dict,
                    keep_latest_k: int, staging_root: str | None = None) -> tuple[str, float]:
    """Save and commit synchronously (tests, tools). Returns (checkpoint key, seconds)."""
    t0 = time.perf_counter()
    writer = CheckpointWriter(store, run_name, rank=rank, world_size=world_size,
                              staging_root=staging_root or os.path.join(default_cache_dir(), "staging"),
                              keep_latest_k=keep_latest_k, upload_timeout=300, commit_timeout=300,
                              async_enabled=False)
    state = {**model_optim_tensors(model, optimizer), **rng_state_tensors(rank)}
    key = writer.save(state, _scalar_state(optimizer, scheduler, step, tokens_seen, seed), step,
                      {"tokens_seen": tokens_seen, **meta})
    if writer.failures:
        raise RuntimeError(f"checkpoint at step {step} was not committed: {writer.failures[-1]}")
    return key, time.perf_counter() - t0


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
    return TrainState(scalars["step"], scalars["tokens_seen"], scalars["scheduler"],
                      scalars["param_groups"], scalars["sampler"])


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()
