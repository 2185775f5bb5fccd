"""Data preparation as plain functions (no Prefect): download, tokenizer, tokenize+shard.

Each function is idempotent against the object store: it first looks for its committed
output and does no work when it is there. The Prefect tasks in stoker/tasks/data.py wrap them.
Sources live in stoker/data/sources.py, the multi-process tokenizer in stoker/data/sharding.py, the Ray
engine (data.engine 'ray') in stoker/data/ray_engine.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from stoker.config import DataConfig, EvalConfig, RayConfig, TokenizerConfig
from stoker.contracts.results import DatasetInfo, DataShards, ShardInfo, TokenizerInfo
from stoker.data.dedup import dedup_sources
from stoker.data.filtering import filter_sources
from stoker.data.sharding import (
    SPLITS,
    UNENCODABLE,
    PartitionJob,
    available_cores,
    build_shards,
    corpus_text,
    part_ranges,
)
from stoker.data.sources import resolve_source, with_retries, write_corpus
from stoker.data.units import ProgressFn, Tracker
from stoker.failures import DataError
from stoker.storage.datasets import (
    PartWriter,
    committed_dataset,
    content_fingerprint,
    dataset_key,
    dataset_of_source,
    dataset_parts,
    iter_part_lines,
    link_source,
    publish_dataset,
)
from stoker.storage.layout import run_file_key
from stoker.storage.shards import (
    FORMAT_VERSION,
    TOKENIZER_FILE,
    clear_stale_staging,
    publish_shard_set,
    shard_cache_key,
    shard_set_key,
    staging_key,
    validate_shard_set,
)
from stoker.storage.store import Store, build_lock, fetch_url, join, sha256_file
from stoker.storage.tokenized import cached_counts, commit_counts, piece_cache_key, piece_file

log = logging.getLogger("stoker.data")
TRAIN_BATCH_DOCS = 1000
STORE_THREADS = 16  # probes of the tokenized cache and copies of parts, on a remote store
PARTITION_BYTES = None  # of a stored part: data.partition_bytes unless set (tests cut smaller parts)


# ---- download ------------------------------------------------------------------------
def _dataset_info(info: dict, key: str, cache_hit: bool) -> DatasetInfo:
    return DatasetInfo(
        info["fingerprint"],
        key,
        info["num_docs"],
        info["num_bytes"],
        cache_hit,
        info.get("num_skipped_files", 0),
        info.get("capped_at", 0),
        len(info.get("parts") or [None]),
    )


def download_dataset(cfg: DataConfig, store: Store) -> DatasetInfo:
    """Read the source into the store's partitions, then publish it as
    {root}/datasets/{fingerprint}/info.json (stoker.storage.datasets).

    The source's fingerprint comes first, from content hashes (local files), ETag/VersionId
    + size (object stores, HTTP) or the resolved revision (Hugging Face); when that source
    gave a committed dataset before, nothing is downloaded. Otherwise its documents are
    normalized into JSON-lines parts of about data.partition_bytes, each stored by its
    content as soon as it is made (this host's disk holds one), and the sha256 of their bytes
    in order is the dataset's fingerprint: the same documents in another file format land on
    the same dataset (stored once) and so on the same tokenizer and shards; a grown source
    stores only its new parts. A failure publishes nothing."""
    with tempfile.TemporaryDirectory(prefix="stoker-download-") as work:
        source = resolve_source(cfg, work)
        known = dataset_of_source(store, source.fingerprint)
        if known is not None:
            return _dataset_info(known[1], dataset_key(known[0]), cache_hit=True)
        # a concurrent run of this source on this host waits, then finds ours
        with build_lock(store, join("datasets", "by-source", source.fingerprint)):
            known = dataset_of_source(store, source.fingerprint)
            if known is not None:
                return _dataset_info(known[1], dataset_key(known[0]), cache_hit=True)
            parts_dir = os.path.join(work, "parts")
            os.makedirs(parts_dir)
            writer = PartWriter(store, parts_dir, PARTITION_BYTES or cfg.partition_bytes)
            try:
                stats = write_corpus(source, cfg, writer, cfg.resolved_workers())
            except BaseException:
                writer.discard()  # nothing half-written: the parts stored so far go
                raise
            parts, digest = writer.close()
            if stats.num_docs == 0:
                skipped = f" ({len(stats.skipped)} file(s) skipped as not UTF-8)" if stats.skipped else ""
                raise DataError(
                    f"data.source: {cfg.source!r} holds no non-empty document{skipped}; point it at text data."
                )
            if stats.skipped:
                log.warning("%d file(s) of %s skipped as not UTF-8 text", len(stats.skipped), cfg.source)
            fingerprint = content_fingerprint(digest)
            key = dataset_key(fingerprint)
            with build_lock(store, key):
                info = committed_dataset(store, fingerprint)
                stored_before = info is not None  # the same documents, from another source
                if not stored_before:
                    info = {
                        "source": cfg.source,
                        "fingerprint": fingerprint,
                        "sha256": digest,
                        "source_fingerprint": source.fingerprint,
                        "fingerprint_inputs": source.fingerprint_inputs,
                        "num_docs": stats.num_docs,
                        "num_bytes": stats.num_bytes,
                        "num_skipped_files": len(stats.skipped),
                        "capped_at": cfg.max_bytes if stats.capped else 0,
                        "skipped_files": stats.skipped[:100],
                        "partition_bytes": PARTITION_BYTES or cfg.partition_bytes,
                    }
                    publish_dataset(store, fingerprint, parts, info)
                else:
                    log.info(
                        "%s holds the same documents as dataset %s (from %s): stored once",
                        cfg.source,
                        fingerprint,
                        info.get("source"),
                    )
            link_source(store, source.fingerprint, fingerprint)
            return _dataset_info(info, key, cache_hit=stored_before)


def iter_corpus(store: Store, dataset: DatasetInfo) -> Iterator[str]:
    """The dataset's documents, in order (its parts one after another)."""
    for offset, line in iter_part_lines(store, dataset_parts(store, dataset.fingerprint)):
        yield corpus_text(line, offset)


def _corpus_batches(store: Store, dataset: DatasetInfo) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in iter_corpus(store, dataset):
        batch.append(doc)
        if len(batch) >= TRAIN_BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


# ---- tokenizer ---------------------------------------------------------------------
def tokenizer_recipe(datasets: list[DatasetInfo], cfg: TokenizerConfig) -> str:
    """The folder name of a tokenizer trained on these datasets (tokenizers/{recipe}/): one
    dataset's fingerprint, or a mixture's in sorted order (the order of data.sources and their
    weights do not change what it is trained on)."""
    prints = sorted(d.fingerprint for d in datasets)
    what = prints[0] if len(prints) == 1 else prints
    return hashlib.sha256(json.dumps([what, cfg.vocab_size, cfg.min_frequency, cfg.eot_token]).encode()).hexdigest()[
        :24
    ]


def _train_bpe(store: Store, datasets: list[DatasetInfo], cfg: TokenizerConfig, local: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[cfg.eot_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    ordered = sorted(datasets, key=lambda d: d.fingerprint)
    batches = (batch for d in ordered for batch in _corpus_batches(store, d))
    tok.train_from_iterator(batches, trainer=trainer, length=sum(d.num_docs for d in ordered))
    tok.save(local)


def _fetch_tokenizer(path: str, local: str, storage_options: dict) -> None:
    """A tokenizer.json by path or URL (a URL with the store's options: a base's tokenizer in
    the same object store as the run)."""
    if "://" in path:
        with_retries(path, lambda: fetch_url(path, local, **storage_options), field_name="tokenizer.path")
    else:
        shutil.copyfile(os.path.expanduser(path), local)


def kept_tokenizer(store: Store, run: str | None, datasets: list[DatasetInfo], cfg: TokenizerConfig) -> str | None:
    """The run's own tokenizer (runs/{run}/tokenizer.json) when it trained one and the data
    would now train another (a source added, removed or changed): a run's tokenizer never
    changes under it. None: no run folder yet, a given tokenizer (tokenizer.path, a base), or
    the data's recipe gives the same tokenizer."""
    if not run or cfg.path:
        return None
    key = run_file_key(run, TOKENIZER_FILE)
    try:
        mine = store.read_bytes(key)
    except FileNotFoundError:
        return None
    try:
        recipe = store.read_bytes(join("tokenizers", tokenizer_recipe(datasets, cfg), TOKENIZER_FILE))
    except FileNotFoundError:
        recipe = None
    return None if recipe == mine else key


def train_tokenizer(
    datasets: DatasetInfo | list[DatasetInfo], cfg: TokenizerConfig, store: Store, run: str | None = None
) -> TokenizerInfo:
    """Train a byte-level BPE on the corpus, or on every corpus of a mixture (or load
    cfg.path); stored under tokenizers/. A run that trained its own keeps it (kept_tokenizer)."""
    from tokenizers import Tokenizer

    datasets = [datasets] if isinstance(datasets, DatasetInfo) else list(datasets)
    kept = kept_tokenizer(store, run, datasets, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, TOKENIZER_FILE)
        if kept:
            log.info("run %s keeps the tokenizer it trained (%s); its data changed since", run, store.url(kept))
            store.get_file(kept, local)
            cache_hit = True
        elif cfg.path:
            _fetch_tokenizer(cfg.path, local, store.storage_options)
            cache_hit = False
        else:
            cached = join("tokenizers", tokenizer_recipe(datasets, cfg), TOKENIZER_FILE)
            cache_hit = store.exists(cached)
            if cache_hit:
                store.get_file(cached, local)
            else:
                _train_bpe(store, datasets, cfg, local)
                store.put_file(local, cached)
        try:
            tok = Tokenizer.from_file(local)
        except Exception as err:
            raise DataError(f"tokenizer.path: {cfg.path!r} is not a tokenizers JSON file ({err}).") from None
        eot_id = tok.token_to_id(cfg.eot_token)
        if eot_id is None:
            raise DataError(
                f"tokenizer.eot_token: the tokenizer has no {cfg.eot_token!r} token; add it "
                "as a special token, or set tokenizer.eot_token to its end-of-text token."
            )
        vocab_size = tok.get_vocab_size()
        if vocab_size > cfg.vocab_size:
            raise DataError(
                f"tokenizer.vocab_size: the tokenizer has {vocab_size} ids but the config "
                f"says {cfg.vocab_size}, which sizes the model's embedding; set "
                f"tokenizer.vocab_size >= {vocab_size}."
            )
        digest = sha256_file(local)
        key = join("tokenizers", "by-hash", digest[:24], TOKENIZER_FILE)
        if not store.exists(key):
            store.put_file(local, key)
        return TokenizerInfo(digest, key, vocab_size, eot_id, cache_hit)


def prepare_all(
    data: DataConfig,
    tokenizer: TokenizerConfig,
    store: Store,
    run: str | None = None,
    ray: RayConfig | None = None,
    evaluation: EvalConfig | None = None,
) -> DataShards:
    """The whole data stage as plain calls, one source after another (the flow's prepare_data
    runs the same steps as tasks, the sources concurrently): each source downloaded, filtered
    (data.filters), its duplicates and evaluation items removed (data.dedup, data.decontaminate; against the sets
    of `evaluation`), one tokenizer for all of them, each source tokenized into its own shard set."""
    sources = data.source_configs()
    downloaded = [download_dataset(cfg, store) for _, _, cfg in sources]
    filtered = filter_sources(downloaded, [(name, cfg) for name, _, cfg in sources], store, ray)
    deduped = dedup_sources(
        [ds for ds, _ in filtered], [(name, cfg) for name, _, cfg in sources], store, evaluation, ray
    )
    datasets = [ds for ds, _ in deduped]
    tok = train_tokenizer(datasets, tokenizer, store, run=run)
    sets = [
        dataclasses.replace(tokenize_and_shard(ds, tok, cfg, store, ray=ray), name=name)
        for ds, (name, _, cfg) in zip(datasets, sources)
    ]
    return DataShards(
        sets,
        mixture=data.is_mixture(),
        dedup=[info for _, info in deduped],
        downloads=downloaded,
        filtered=[info for _, info in filtered if info is not None],
    )


# ---- tokenize and shard --------------------------------------------------------------
def token_dtype(choice: str, vocab_size: int) -> np.dtype:
    """The little-endian dtype of the shard files for data.token_dtype and a vocabulary."""
    if choice == "auto":
        return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")
    if choice == "uint16" and vocab_size > 2**16:
        raise DataError(
            f"data.token_dtype: uint16 holds token ids below 65536, but the tokenizer has "
            f"{vocab_size} ids; set data.token_dtype to 'uint32' or 'auto'."
        )
    return np.dtype("<u2" if choice == "uint16" else "<u4")


def shard_params(cfg: DataConfig, tokenizer: TokenizerInfo) -> dict:
    """Every preprocessing parameter that shapes a shard set's bytes (part of its cache key)."""
    return {
        "val_fraction": cfg.val_fraction,
        "shard_tokens": cfg.shard_tokens,
        "dtype": token_dtype(cfg.token_dtype, tokenizer.vocab_size).str,
        "eot_id": tokenizer.eot_id,
        "special_tokens_as_text": True,  # text that spells a special token stays text (tokenize_docs)
    }


def shard_key_of(dataset: DatasetInfo, tokenizer: TokenizerInfo, cfg: DataConfig) -> str:
    """The cache key of the shard set of this dataset, tokenizer and data section: the one
    tokenize_and_shard builds and the data task's cache policy looks up."""
    return shard_cache_key(dataset.fingerprint, tokenizer.sha256, shard_params(cfg, tokenizer))


def tokenize_and_shard(
    dataset: DatasetInfo,
    tokenizer: TokenizerInfo,
    cfg: DataConfig,
    store: Store,
    partition_bytes: int | None = None,
    ray: RayConfig | None = None,
    on_progress: ProgressFn | None = None,
) -> ShardInfo:
    """Tokenize the corpus once into flat little-endian token files, manifest last.

    Returns at once (cache_hit=True) when a shard set with the same key exists: its manifest,
    every listed file at its size, no invalid marker; no shard byte is read here (each host
    hashes the bytes it uses, storage.shards.materialize). One that is incomplete or marked
    invalid by a host whose full check failed is rebuilt. cfg.engine 'ray' runs the work as Ray tasks on the cluster of
    `ray` (default: a local Ray instance). The key and the bytes do not depend on the
    engine, cfg.num_workers or partition_bytes."""
    dtype = token_dtype(cfg.token_dtype, tokenizer.vocab_size)  # before any work
    partition_bytes = partition_bytes or cfg.partition_bytes
    params = shard_params(cfg, tokenizer)
    cache_key = shard_key_of(dataset, tokenizer, cfg)
    existing = validate_shard_set(store, cache_key)  # cheap: the bytes are hashed where they land
    if existing:
        return _shard_info(store, cache_key, existing.manifest, cache_hit=True)
    with build_lock(store, shard_set_key(cache_key)):  # same key on this host: built once
        existing = validate_shard_set(store, cache_key)
        if existing:
            return _shard_info(store, cache_key, existing.manifest, cache_hit=True)
        if store.is_local:
            clear_stale_staging(store, cache_key)
        inputs = {"dataset_fingerprint": dataset.fingerprint, "tokenizer_sha256": tokenizer.sha256, "params": params}
        staging = staging_key(cache_key)
        try:
            manifest = _build(dataset, tokenizer, cfg, store, staging, dtype, partition_bytes, ray, on_progress)
        except BaseException:
            store.rm(staging)  # nothing half-written survives a failure
            raise
        manifest.update(cache_key=cache_key, inputs=inputs)
        published = publish_shard_set(store, staging, cache_key, manifest)
    verdict = validate_shard_set(store, cache_key)
    if not verdict:
        raise OSError(
            f"shard set {store.url(shard_set_key(cache_key))} did not validate after publishing: {verdict.reason}"
        )
    return _shard_info(store, cache_key, verdict.manifest, cache_hit=not published)


SAMPLE_BYTES = 1 << 20  # of the corpus, tokenized to estimate the shards' size
DISK_MARGIN = 1.2


def _existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _token_bytes(dataset: DatasetInfo, store: Store, tokenizer_path: str, dtype: np.dtype) -> int:
    """The shards' size, estimated from a tokenized sample of the corpus, with a margin."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    docs, sampled = [], 0
    for doc in iter_corpus(store, dataset):
        docs.append(doc)
        sampled += len(doc.encode("utf-8"))
        if sampled >= SAMPLE_BYTES:
            break
    tokens = sum(len(e.ids) for e in tok.encode_batch(docs)) + len(docs)  # + end-of-text each
    return int(dataset.num_bytes / max(1, sampled) * tokens * dtype.itemsize * DISK_MARGIN)


def _check_disk_space(
    dataset: DatasetInfo,
    store: Store,
    tokenizer_path: str,
    dtype: np.dtype,
    shard_tokens: int,
    tmp: str,
    ray: RayConfig | None = None,
) -> None:
    """Before tokenizing: is there room for what this host writes? Estimated from a tokenized
    sample of the corpus. Local engine: the per-partition token files and, on a remote store,
    the corpus copy go to the temp folder; the shards go to the store (local) or one at a
    time to the temp folder (remote). Ray engine (`ray` given): the pieces and the shards go
    to the store, a local one on this host's disk; a local Ray instance's tasks each hold one
    shard in the temp folder; a remote cluster's disks are its own. One DataError naming
    where, what is needed and the fix."""
    to_root = ("storage.root", "free space there or point storage.root at a bigger disk")
    to_tmp = ("the temporary folder (TMPDIR)", "free space there or set TMPDIR to a folder on a bigger disk")
    if ray is not None:  # pieces, then shards: twice the tokens, in the store
        needs = (
            [(store.local_path(), 2 * _token_bytes(dataset, store, tokenizer_path, dtype), *to_root)]
            if store.is_local
            else []
        )
        if ray.address is None:
            needs.append((tmp, available_cores() * shard_tokens * dtype.itemsize, *to_tmp))
    else:
        token_bytes = _token_bytes(dataset, store, tokenizer_path, dtype)
        corpus_bytes = 0 if store.is_local else sum(p.size for p in dataset_parts(store, dataset.fingerprint))
        needs = [(tmp, token_bytes + corpus_bytes, *to_tmp)]
        if store.is_local:
            needs.append((store.local_path(), token_bytes, *to_root))
        else:
            needs[0] = (tmp, needs[0][1] + shard_tokens * dtype.itemsize, *needs[0][2:])
    by_device: dict[int, list] = {}
    for path, size, name, fix in needs:
        by_device.setdefault(os.stat(_existing(path)).st_dev, []).append((path, size, name, fix))
    for group in by_device.values():
        need = sum(size for _, size, _, _ in group)
        path, _, name, fix = group[-1]
        free = shutil.disk_usage(_existing(path)).free
        if need > free:
            where = " and ".join(n for _, _, n, _ in group)
            raise DataError(
                f"{name}: tokenizing {dataset.num_bytes / 1e6:.1f} MB of text needs about "
                f"{need / 1e6:.1f} MB on {_existing(path)} ({where}) and {free / 1e6:.1f} MB are "
                f"free; {fix}."
            )


def _build(
    dataset: DatasetInfo,
    tokenizer: TokenizerInfo,
    cfg: DataConfig,
    store: Store,
    staging: str,
    dtype: np.dtype,
    partition_bytes: int,
    ray: RayConfig | None = None,
    on_progress: ProgressFn | None = None,
) -> dict:
    """Build the shard set into `staging`; return its manifest (without key and inputs)."""
    with tempfile.TemporaryDirectory(prefix="stoker-shards-") as tmp:
        found: dict = {}
        if cfg.engine == "ray":
            by_split, files = _build_on_ray(
                dataset,
                tokenizer,
                cfg,
                store,
                staging,
                dtype,
                partition_bytes,
                ray or RayConfig(),
                tmp,
                found,
                on_progress,
            )
        else:
            by_split, files = _build_here(
                dataset, tokenizer, cfg, store, staging, dtype, partition_bytes, tmp, found, on_progress
            )
    lost, example = found.get(UNENCODABLE) or [0, ""]
    bins = {s: sorted(n for n in by_split[s] if n.endswith(".bin")) for s in SPLITS}
    return {
        "format_version": FORMAT_VERSION,
        "dtype": dtype.str,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "splits": bins,
        "num_tokens": {s: sum(files[n]["tokens"] for n in bins[s]) for s in SPLITS},
        "num_docs": {s: sum(files[n]["docs"] for n in bins[s]) for s in SPLITS},
        # the text's bytes that the tokenizer's vocabulary cannot spell (dropped when tokenized)
        "unencodable_bytes": {"count": int(lost), "example": example},
        "files": files,
    }


def _every_split_filled(by_split: dict[str, dict], dataset: DatasetInfo) -> None:
    for split in SPLITS:
        if not by_split[split]:
            raise DataError(
                f"data.val_fraction: the {split} split got no document "
                f"({dataset.num_docs} documents in all); use more data or change val_fraction."
            )


def _build_here(
    dataset: DatasetInfo,
    tokenizer: TokenizerInfo,
    cfg: DataConfig,
    store: Store,
    staging: str,
    dtype: np.dtype,
    partition_bytes: int,
    tmp: str,
    found: dict,
    on_progress: ProgressFn | None = None,
) -> tuple[dict, dict]:
    """The local engine: cfg.num_workers processes on this host. Returns the shard files by
    split and every file's manifest entry (tokenizer.json included)."""
    build = store.local_path(staging) if store.is_local else os.path.join(tmp, "build")
    os.makedirs(build, exist_ok=True)
    local_tok = os.path.join(build, TOKENIZER_FILE)
    store.get_file(tokenizer.key, local_tok)
    _check_disk_space(dataset, store, local_tok, dtype, cfg.shard_tokens, tmp)
    parts = dataset_parts(store, dataset.fingerprint)
    if store.is_local:
        corpus = [store.local_path(p.key) for p in parts]
    else:  # the parts a partition to tokenize reads, copied here for the workers (below)
        corpus = [os.path.join(tmp, "corpus", f"{k:05d}.jsonl") for k in range(len(parts))]

    def on_close(name: str, path: str) -> None:
        if not store.is_local:  # upload each finished file, so local disk holds one
            store.put_file(path, join(staging, name))
            os.remove(path)

    pieces = os.path.join(tmp, "parts")
    os.makedirs(pieces)
    ranges = part_ranges([p.size for p in parts], partition_bytes)
    common = dict(tokenizer=local_tok, eot_id=tokenizer.eot_id, dtype=dtype.str, val_fraction=cfg.val_fraction)
    jobs = [
        PartitionJob(k, corpus[i], a, b, out=os.path.join(pieces, f"p-{k:05d}"), **common)
        for k, (i, a, b) in enumerate(ranges)
    ]
    # partitions tokenized before (storage.tokenized) are fetched as the shards reach them, not
    # run; the others are stored as they are made
    keys = {
        job.index: piece_cache_key(
            parts[i].sha256, a, b, tokenizer.sha256, tokenizer.eot_id, dtype.str, cfg.val_fraction
        )
        for job, (i, a, b) in zip(jobs, ranges)
    }
    # a remote store answers each probe and copy in a round trip or more: they go in parallel
    threads = 1 if store.is_local else STORE_THREADS
    with ThreadPoolExecutor(threads) as pool:
        found_counts = pool.map(lambda job: cached_counts(store, keys[job.index]), jobs)
        cached = {job.index: c for job, c in zip(jobs, found_counts) if c is not None}
        if not store.is_local:
            needed = sorted({ranges[j.index][0] for j in jobs if j.index not in cached})
            list(pool.map(lambda i: store.get_file(parts[i].key, corpus[i]), needed))

    def fetch(job) -> None:
        for split in SPLITS:
            for path, ext in zip(job.paths(split), ("bin", "idx")):
                store.get_file(piece_file(keys[job.index], split, ext), path)

    def on_tokenized(job, counts: dict) -> None:
        sizes = {}
        for split in SPLITS:
            for path, ext in zip(job.paths(split), ("bin", "idx")):
                store.put_file(path, piece_file(keys[job.index], split, ext))
                sizes[f"{split}.{ext}"] = os.path.getsize(path)
        commit_counts(store, keys[job.index], counts, sizes)

    if cached:
        log.info(
            "tokenize: %d of %d partitions tokenized before (storage.tokenized), %d to do",
            len(cached),
            len(jobs),
            len(jobs) - len(cached),
        )
    tracker = Tracker("tokenize", len(jobs), on_progress)
    by_split = build_shards(
        jobs,
        build,
        cfg.shard_tokens,
        cfg.resolved_workers(),
        tmp,
        on_close,
        found,
        tracker,
        cached,
        on_tokenized,
        fetch,
    )
    _every_split_filled(by_split, dataset)
    files = {TOKENIZER_FILE: {"size": os.path.getsize(local_tok), "sha256": sha256_file(local_tok)}}
    on_close(TOKENIZER_FILE, local_tok)
    for split_files in by_split.values():
        files.update(split_files)
    return by_split, files


def _build_on_ray(
    dataset: DatasetInfo,
    tokenizer: TokenizerInfo,
    cfg: DataConfig,
    store: Store,
    staging: str,
    dtype: np.dtype,
    partition_bytes: int,
    ray: RayConfig,
    tmp: str,
    found: dict,
    on_progress: ProgressFn | None = None,
) -> tuple[dict, dict]:
    """The Ray engine (stoker/data/ray_engine.py): Ray tasks read the corpus from the store and write
    the shard files to staging; this host writes only tokenizer.json there."""
    from stoker.data.ray_engine import build_shards_on_ray

    local_tok = os.path.join(tmp, TOKENIZER_FILE)
    store.get_file(tokenizer.key, local_tok)
    _check_disk_space(dataset, store, local_tok, dtype, cfg.shard_tokens, tmp, ray)
    parts = dataset_parts(store, dataset.fingerprint)
    built = build_shards_on_ray(
        store,
        ray,
        [(p.key, p.size, p.sha256) for p in parts],
        tokenizer.key,
        tokenizer.sha256,
        staging,
        tokenizer.eot_id,
        dtype,
        cfg.val_fraction,
        cfg.shard_tokens,
        partition_bytes,
        Tracker(
            "tokenize",
            len(part_ranges([p.size for p in parts], partition_bytes)),
            on_progress,
        ),
    )
    log.info(
        "data.engine ray: %d tasks on %d node(s), %.1f task CPU-s; %d of %d partitions tokenized before",
        built.num_tasks,
        len(built.nodes),
        built.task_cpu_s,
        built.cached,
        len(part_ranges([p.size for p in parts], partition_bytes)),
        extra={"ray_nodes": sorted(built.nodes), "ray_task_cpu_s": built.task_cpu_s},
    )
    found[UNENCODABLE] = built.unencodable
    _every_split_filled(built.files, dataset)
    files = {TOKENIZER_FILE: {"size": os.path.getsize(local_tok), "sha256": sha256_file(local_tok)}}
    store.put_file(local_tok, join(staging, TOKENIZER_FILE))
    for split_files in built.files.values():
        files.update(split_files)
    return built.files, files


def _shard_info(store: Store, cache_key: str, manifest: dict, cache_hit: bool) -> ShardInfo:
    key = shard_set_key(cache_key)
    return ShardInfo(
        cache_key=cache_key,
        key=key,
        url=store.url(key),
        num_train_tokens=manifest["num_tokens"]["train"],
        num_val_tokens=manifest["num_tokens"]["val"],
        vocab_size=manifest["vocab_size"],
        dtype=manifest["dtype"],
        cache_hit=cache_hit,
        unencodable_bytes=int((manifest.get("unencodable_bytes") or {}).get("count", 0)),
        unencodable_example=(manifest.get("unencodable_bytes") or {}).get("example", ""),
    )
