"""data.engine 'ray': the corpus's fixed partitions tokenized by Ray tasks across a cluster.

Phase 1: one task per partition (the byte ranges of the dataset's stored parts,
``sharding.part_ranges``) reads its range (ranged reads), tokenizes it with ``sharding.tokenize_docs`` and
writes one piece per split to ``{staging}/parts/``; it returns the pieces' document ends.
Phase 2: the driver cuts the shard files where ``sharding.shard_cuts`` says (the local
engine's cut points), and one task per shard file concatenates its runs of pieces into
``{staging}/{split}-NNNNN.bin`` with the ``.idx`` beside it, returning size and sha256. The
driver then deletes the pieces; the caller writes the manifest last. Both engines share the
three definitions that shape the bytes, so the shard files are byte-identical whatever the
engine, the cluster or the partition size.

Every node reaches the store itself: tasks get the store's root and options (with the
credentials of a ``storage.credentials_block`` when one is in use, else the node's own
environment) as task arguments, never shown. storage.root must therefore be an object store
(or a folder mounted at the same path on every node) once the cluster spans hosts.

Ray is imported inside functions only: ``data`` imports without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.data.sharding import (
    COPY_CHUNK,
    SPLITS,
    UNENCODABLE,
    available_cores,
    corpus_text,
    merge_unencodable,
    part_ranges,
    shard_cuts,
    shard_entries,
    shard_name,
    store_lines,
    tokenize_docs,
)
from stoker.failures import ConfigError, DataError, StokerError
from stoker.process import ray_connect
from stoker.storage.credentials import options_for
from stoker.storage.store import Store, join
from stoker.storage.tokenized import cached_counts, commit_counts, piece_cache_key, piece_file

if TYPE_CHECKING:  # the task workers import this module: they need no config models
    from stoker.config import RayConfig

log = logging.getLogger("stoker.data.ray")
LOCAL_OBJECT_STORE_BYTES = 256 << 20  # task results are document ends: small
CANCEL_WAIT_S = 30


@dataclass(frozen=True)
class StoreSpec:
    """What a task needs to open the store; the options may hold credentials, never shown."""

    root: str
    options: dict = field(repr=False)

    def open(self) -> Store:
        """This worker process's Store for the spec, made once (an S3 client costs ~0.1 CPU-s)."""
        key = (self.root, json.dumps(self.options, sort_keys=True, default=str))
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = Store(self.root, self.options)
        return store


_STORES: dict[tuple[str, str], Store] = {}  # per worker process; the key may hold credentials: never shown


@dataclass
class RayBuild:
    """The shard files built ({split: {name: manifest entry}}) and where the work ran."""

    files: dict[str, dict[str, dict]]
    nodes: set[str]
    num_tasks: int
    task_cpu_s: float
    unencodable: list = field(default_factory=lambda: [0, ""])  # [bytes, first example] (sharding.UNENCODABLE)
    cached: int = 0  # partitions tokenized before (storage.tokenized), read back


# ---- tasks (run on the cluster's nodes) ---------------------------------------------------
_TOKENIZERS: dict[tuple[str, str], Any] = {}


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _set_threads(cpus: float) -> None:
    """The tokenizer's threads: as many as the CPUs the task reserved (one: none)."""
    threads = max(1, int(cpus))
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))


def _tokenizer(store: Store, key: str):
    from tokenizers import Tokenizer

    tok = _TOKENIZERS.get((store.root, key))
    if tok is None:  # keys under tokenizers/by-hash/ never change content
        tok = _TOKENIZERS[(store.root, key)] = Tokenizer.from_str(store.read_bytes(key).decode("utf-8"))
    return tok


def tokenize_task(
    spec: StoreSpec,
    corpus_key: str,
    corpus_size: int,
    index: int,
    start: int,
    end: int,
    tokenizer_key: str,
    eot_id: int,
    dtype: str,
    val_fraction: float,
    cache_key: str,
    cpus: float,
) -> dict:
    """Phase 1, one partition: its tokens and document ends per split go to the store under
    `cache_key` (storage.tokenized: a partition tokenized before is read back, not tokenized);
    returns counts, document ends and the keys of its token files."""
    cpu0 = time.process_time()
    _set_threads(cpus)
    store = spec.open()
    bins = {s: piece_file(cache_key, s, "bin") for s in SPLITS}
    counts = cached_counts(store, cache_key)
    if counts is not None:
        ends = {s: np.frombuffer(store.read_bytes(piece_file(cache_key, s, "idx")), dtype="<u8") for s in SPLITS}
        return {
            "counts": counts,
            "ends": ends,
            "bins": bins,
            "cached": True,
            "node": node_id(),
            "cpu_s": time.process_time() - cpu0,
        }
    files = {s: (io.BytesIO(), io.BytesIO()) for s in SPLITS}
    try:
        tok = _tokenizer(store, tokenizer_key)
        docs = (corpus_text(line, offset) for offset, line in store_lines(store, corpus_key, corpus_size, start, end))
        counts = tokenize_docs(docs, tok, eot_id, np.dtype(dtype), val_fraction, files)
    except FileNotFoundError:
        raise ConfigError(
            [
                f"storage.root: a Ray node ({node_id()[:12]}) finds no {store.url(corpus_key)}, which the "
                "flow's host reads; with data.engine 'ray' every node must reach storage.root: use an "
                "object store (s3://...) or a folder mounted at the same path on every node."
            ]
        ) from None
    sizes = {}
    for split, (binf, idxf) in files.items():  # each one PUT: whole or absent
        for ext, buf in (("bin", binf), ("idx", idxf)):
            store.write_bytes(piece_file(cache_key, split, ext), buf.getvalue())
            sizes[f"{split}.{ext}"] = len(buf.getvalue())
    commit_counts(store, cache_key, counts, sizes)  # last: the entry's commit
    ends = {s: np.frombuffer(files[s][1].getvalue(), dtype="<u8") for s in SPLITS}
    return {
        "counts": counts,
        "ends": ends,
        "bins": bins,
        "cached": False,
        "node": node_id(),
        "cpu_s": time.process_time() - cpu0,
    }


def assemble_task(
    spec: StoreSpec,
    staging: str,
    split: str,
    index: int,
    runs: list[tuple[str, int, int]],
    idx: np.ndarray,
    itemsize: int,
) -> dict:
    """Phase 2, one shard file: the token runs [first, end) of pieces, in order, then its
    document ends; uploaded whole. Returns sizes and sha256s."""
    cpu0 = time.process_time()
    store = spec.open()
    digest, size = hashlib.sha256(), 0
    with tempfile.NamedTemporaryFile(prefix="stoker-shard-", suffix=".bin") as tmp:
        for key, first, end in runs:
            offset, todo = first * itemsize, (end - first) * itemsize
            while todo > 0:
                block = store.read_range(key, offset, min(COPY_CHUNK, todo))
                if not block:
                    raise OSError(f"{store.url(key)} is shorter than its document ends say")
                tmp.write(block)
                digest.update(block)
                offset, todo, size = offset + len(block), todo - len(block), size + len(block)
        tmp.flush()
        store.put_file(tmp.name, join(staging, shard_name(split, index, "bin")))
    idx_bytes = np.ascontiguousarray(idx, dtype="<u8").tobytes()
    store.write_bytes(join(staging, shard_name(split, index, "idx")), idx_bytes)
    return {
        "bin_size": size,
        "bin_sha256": digest.hexdigest(),
        "idx_size": len(idx_bytes),
        "idx_sha256": hashlib.sha256(idx_bytes).hexdigest(),
        "node": node_id(),
        "cpu_s": time.process_time() - cpu0,
    }


# ---- the driver's plan ---------------------------------------------------------------
@dataclass
class ShardPlan:
    split: str
    index: int
    tokens: int
    docs: int
    runs: list[tuple[str, int, int]]  # (piece key, first token, end token)
    idx: np.ndarray  # (docs,) document ends relative to the file, uint64


class _ShardPlanner:
    """The driver's twin of sharding._ShardAssembler: the same cuts, as plans for tasks."""

    def __init__(self, split: str, shard_tokens: int):
        self.split, self.shard_tokens = split, shard_tokens
        self.index = self.count = self.docs = 0
        self.runs: list[tuple[str, int, int]] = []
        self.idx: list[np.ndarray] = []

    def add(self, key: str, ends: np.ndarray) -> list[ShardPlan]:
        ends = ends.astype(np.int64)
        done = []
        for first, end, start_tok, stop_tok, closes in shard_cuts(ends, self.count, self.shard_tokens):
            self.runs.append((key, start_tok, stop_tok))
            self.idx.append(ends[first:end] - start_tok + self.count)
            self.count += stop_tok - start_tok
            self.docs += end - first
            if closes:
                done.append(self.close())
        return done

    def close(self) -> ShardPlan | None:
        if not self.runs:
            return None
        plan = ShardPlan(
            self.split, self.index, self.count, self.docs, self.runs, np.concatenate(self.idx).astype("<u8")
        )
        self.index, self.count, self.docs, self.runs, self.idx = self.index + 1, 0, 0, [], []
        return plan


# ---- connecting, errors, cancelling --------------------------------------------------
def _start_local(ray, cpus_per_task: float) -> None:
    """A Ray instance for this job on 127.0.0.1, with this host's cores (process.ray_connect)."""
    cores = available_cores()
    if cpus_per_task > cores:
        raise ConfigError(
            [
                f"ray.cpus_per_data_task: {cpus_per_task:g} CPUs per task, but the local Ray "
                f"instance (ray.address empty) has this host's {cores}; use at most {cores}."
            ]
        )
    try:
        ray_connect.start_local(cores, object_store_memory=LOCAL_OBJECT_STORE_BYTES, logging_level=logging.WARNING)
    except Exception as err:  # e.g. "timed out during startup" on a host too busy: worth a retry
        raise ChildProcessError(
            f"data.engine 'ray': the local Ray instance did not start ({type(err).__name__}: {err})"
        ) from err


def connect(cfg: RayConfig, cpus_per_task: float) -> tuple[Any, bool]:
    """(the ray module, whether this call started the connection and must shut it down).
    A connection this process already holds is used as it is."""
    import ray

    if ray.is_initialized():
        return ray, False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a data job never reports home
    if cfg.address is None:
        _start_local(ray, cpus_per_task)
        return ray, True
    ray_connect.connect(cfg.address)
    return ray, True


def shutdown(ray) -> None:
    """Disconnect (a local instance: stop it); a broken connection must not hide the build's
    own outcome."""
    try:
        ray.shutdown()
    except Exception as err:
        log.warning("ray.shutdown() failed: %s: %s", type(err).__name__, err)


def result_of(ray, ref, what: str) -> dict:
    """ray.get, with a task's error raised as the local engine would raise it."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        cause = err.cause
        if isinstance(cause, DataError):
            raise DataError(str(cause)) from None
        if isinstance(cause, StokerError):
            raise cause from None
        if isinstance(cause, ModuleNotFoundError):
            raise ConfigError(
                [
                    f"data.engine: 'ray' runs stoker's own code on every node, and a node cannot "
                    f"import it ({cause}); install stoker on every node of the cluster."
                ]
            ) from None
        if isinstance(cause, Exception):
            if hasattr(cause, "add_note"):
                cause.add_note(f"(in the Ray task that {what})")
            raise cause from None
        raise RuntimeError(f"data.engine 'ray': the task that {what} failed: {err}") from None
    except ray.exceptions.RayError as err:  # a lost worker or node: a retry may well succeed
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ChildProcessError(
            f"data.engine 'ray': the task that {what} was lost ({type(err).__name__}: {first})"
        ) from None


@contextlib.contextmanager
def ray_tasks(ray_cfg: RayConfig, cpus: float):
    """Ray, connected for a batch of tasks: yields (ray, refs), the caller adding its tasks'
    refs to `refs`. On any failure, Ctrl-C included, those tasks are cancelled and waited for
    before the error propagates; a Ray this call started is shut down."""
    ray, owned = connect(ray_cfg, cpus)
    refs: list = []
    try:
        yield ray, refs
    except BaseException:
        if refs:
            _cancel(ray, refs)
        raise
    finally:
        if owned:
            shutdown(ray)


def _cancel(ray, refs: list) -> None:
    """Stop every task still running, and wait until they are gone: none may write into the
    staging folder after the caller has removed it."""
    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # already finished, or the connection is gone
            pass
    try:
        _, running = ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)
    except Exception as err:
        log.warning("could not wait for the cancelled Ray tasks: %s: %s", type(err).__name__, err)
        return
    if running:
        log.warning("%d cancelled Ray task(s) still running after %d s", len(running), CANCEL_WAIT_S)


# ---- the build -------------------------------------------------------------------------
def build_shards_on_ray(
    store: Store,
    ray_cfg: RayConfig,
    corpus: list[tuple[str, int, str]],
    tokenizer_key: str,
    tokenizer_sha256: str,
    staging: str,
    eot_id: int,
    dtype: np.dtype,
    val_fraction: float,
    shard_tokens: int,
    partition_bytes: int,
    tracker=None,
) -> RayBuild:
    """Tokenize the stored corpus (its parts' keys, sizes and sha256s, in order) into shard files under `staging` with Ray tasks (see the
    module docstring); returns their manifest entries by split (as sharding.build_shards does)
    and where the work ran. On any failure, Ctrl-C included, the tasks are cancelled and waited
    for before the error propagates, and a connection made here is closed; the caller removes
    staging. `tracker` (stoker.data.units.Tracker) sees each partition tokenized."""
    spec = StoreSpec(store.root, options_for(store.root, store.storage_options))
    ranges = part_ranges([size for _, size, _ in corpus], partition_bytes)
    cpus = ray_cfg.cpus_per_data_task
    with ray_tasks(ray_cfg, cpus) as (ray, refs):
        # SPREAD: partitions go round the nodes (each reads its own range), not first to the driver's
        tokenize = ray.remote(tokenize_task).options(
            num_cpus=cpus, name="stoker-tokenize", scheduling_strategy="SPREAD"
        )
        assemble = ray.remote(assemble_task).options(num_cpus=cpus, name="stoker-assemble")
        parts = [
            tokenize.remote(
                spec,
                corpus[i][0],
                corpus[i][1],
                k,
                start,
                end,
                tokenizer_key,
                eot_id,
                dtype.str,
                val_fraction,
                piece_cache_key(corpus[i][2], start, end, tokenizer_sha256, eot_id, dtype.str, val_fraction),
                cpus,
            )
            for k, (i, start, end) in enumerate(ranges)
        ]
        refs += parts
        planners = {s: _ShardPlanner(s, shard_tokens) for s in SPLITS}
        plans: list[ShardPlan] = []
        nodes, cpu_s = set(), 0.0

        def submit(plan: ShardPlan | None) -> None:
            if plan is not None:
                plans.append(plan)
                refs.append(assemble.remote(spec, staging, plan.split, plan.index, plan.runs, plan.idx, dtype.itemsize))

        unencodable, cached = [0, ""], 0
        for k, ref in enumerate(parts):  # in partition order, as the local engine appends them
            got = result_of(ray, ref, f"tokenizes partition {k}")
            unencodable = merge_unencodable(unencodable, got["counts"].get(UNENCODABLE))
            nodes.add(got["node"])
            cpu_s += got["cpu_s"]
            if tracker is not None:  # stoker.data.units.Tracker: documents tokenized so far
                tracker.step(sum(got["counts"][s][1] for s in SPLITS), got["node"])
            cached += got["cached"]
            for split in SPLITS:
                for plan in planners[split].add(got["bins"][split], got["ends"][split]):
                    submit(plan)
        for planner in planners.values():
            submit(planner.close())
        files: dict[str, dict[str, dict]] = {s: {} for s in SPLITS}
        for plan, ref in zip(plans, refs[len(parts) :]):
            name = shard_name(plan.split, plan.index, "bin")
            got = result_of(ray, ref, f"assembles {name}")
            nodes.add(got["node"])
            cpu_s += got["cpu_s"]
            if (got["bin_size"], got["idx_size"]) != (plan.tokens * dtype.itemsize, plan.docs * 8):
                raise OSError(
                    f"{store.url(staging, name)}: {got['bin_size']} bytes written, "
                    f"{plan.tokens * dtype.itemsize} planned"
                )
            files[plan.split].update(
                shard_entries(
                    plan.split, plan.index, plan.tokens, plan.docs, dtype.itemsize, got["bin_sha256"], got["idx_sha256"]
                )
            )
        return RayBuild(files, nodes, len(refs), cpu_s, unencodable, cached)
