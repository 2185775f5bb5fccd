"""Prefect tasks of the data stage: one job each, policy on the decorator.

Caching is by content in the object store (the manifests are the truth). Each task's Prefect
cache key is the store's content key of its output (below, each computed by the same data.prepare
function that names the output; orchestration.caching is the policy), and its record counts only
while the store holds that output with a valid manifest: then the task run shows Cached and
returns the stored result with cache_hit=True; from a deleted store, the task builds again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tempfile

from prefect import get_run_logger

from stoker.config import DataConfig, EvalConfig, RayConfig, StorageConfig, TokenizerConfig
from stoker.config.data import DEFAULT_SOURCE_NAME
from stoker.contracts.results import DatasetInfo, DedupInfo, FilterInfo, ShardInfo, TokenizerInfo
from stoker.data import dedup, filtering, prepare
from stoker.data.sources import resolve_source
from stoker.failures import DataError
from stoker.observe.report import (
    DEDUP_SAMPLES_FILE,
    FILTER_SAMPLES_FILE,
    dedup_line,
    dedup_rows,
    filter_line,
    vocabulary_note,
)
from stoker.orchestration.caching import StoreCache, digest, result_shape
from stoker.orchestration.progress import StageProgress
from stoker.storage.datasets import committed_dataset
from stoker.storage.layout import run_file_key
from stoker.storage.shards import validate_shard_set
from stoker.storage.store import Store
from stoker.tasks.policy import stoker_task


# ---- each task's content key, and what its record's output needs in the store ----------------
def dataset_key(store: Store, parameters: dict) -> str:
    """download_dataset: the source's fingerprint (datasets/by-source/), taken as the task
    takes it (content hashes of local files, ETags, revisions): on a miss, twice."""
    with tempfile.TemporaryDirectory(prefix="stoker-cache-key-") as work:
        source = resolve_source(parameters["data"], work)
    return f"{source.fingerprint}-{digest(result_shape(DatasetInfo))}"


def holds_dataset(store: Store, info: DatasetInfo) -> bool:
    """The dataset is committed: info.json, its corpus at the listed size."""
    return committed_dataset(store, info.fingerprint) is not None


def tokenizer_key(store: Store, parameters: dict) -> str | None:
    """train_tokenizer: the trained tokenizer's recipe (tokenizers/{recipe}/, as
    data.prepare.tokenizer_recipe names it). A tokenizer.path is loaded each time (no key)."""
    datasets, cfg = parameters["datasets"], parameters["tokenizer"]
    if cfg.path or prepare.kept_tokenizer(store, parameters.get("run"), datasets, cfg):
        return None
    return f"{prepare.tokenizer_recipe(datasets, cfg)}-{digest(result_shape(TokenizerInfo))}"


def holds_tokenizer(store: Store, info: TokenizerInfo) -> bool:
    """The tokenizer file is there by its hash, with that hash."""
    try:
        return hashlib.sha256(store.read_bytes(info.key)).hexdigest() == info.sha256
    except FileNotFoundError:
        return False


def shards_key(store: Store, parameters: dict) -> str:
    """tokenize_and_shard: the shard set's cache key (shards/{cache key}/)."""
    cache_key = prepare.shard_key_of(parameters["dataset"], parameters["tokenizer"], parameters["data"])
    return f"{cache_key}-{digest(result_shape(ShardInfo))}"


def holds_shards(store: Store, info: ShardInfo) -> bool:
    """The shard set is valid: its manifest, every file at its size, no invalid marker."""
    return bool(validate_shard_set(store, info.cache_key))


@stoker_task(
    name="download_dataset",
    retries=3,
    cache=StoreCache(content_key=dataset_key, holds=holds_dataset),
)
def download_dataset(data: DataConfig, storage: StorageConfig, name: str = DEFAULT_SOURCE_NAME) -> DatasetInfo:
    """Copy the raw source into {root}/datasets/{fingerprint}/ (no copy when present).

    Transient network failures are retried inside (with backoff) and then by this task;
    a missing object, a wrong field or undecodable data fails at once (DataError), naming
    the source of data.sources it is about (`name`).

    No task timeout: submitted, the task runs on a worker thread, where Prefect's could not
    end it (policy.stoker_task). What can block is a read of the source, and each read ends
    by the client's own connect and read timeouts (the object store's, HTTP's, the Hub's);
    data.sources.with_retries retries it within its time budget, then this task."""
    try:
        info = prepare.download_dataset(data, Store.of(storage))
    except DataError as err:
        if name == DEFAULT_SOURCE_NAME:
            raise
        # "data.source: ..." of the one-source DataConfig is this source's field
        raise DataError(re.sub(r"^data\.(\w+):", rf"data.sources[{name}].\1:", str(err))) from None
    logger = get_run_logger()
    logger.info(
        "dataset%s %s: %d documents, %.1f MB (%s)",
        "" if name == DEFAULT_SOURCE_NAME else f" of source {name!r}",
        info.fingerprint,
        info.num_docs,
        info.num_bytes / 1e6,
        "already in the store, nothing stored" if info.cache_hit else "downloaded and stored",
    )
    if info.capped_at:  # a user's corpus cut silently at the built-in corpus's cap is a surprise
        logger.warning(
            "data.max_bytes: the source holds more than %d bytes and was cut there (%d documents "
            "taken); set data.max_bytes to 0 to take all of it",
            info.capped_at,
            info.num_docs,
        )
    if info.num_skipped_files:
        logger.warning(
            "%d source file(s) skipped as not UTF-8 text (data.on_decode_error='skip')", info.num_skipped_files
        )
    return info


@stoker_task(name="filter_documents", retries=2)
def filter_documents(
    datasets: list[DatasetInfo],
    data: DataConfig,
    storage: StorageConfig,
    ray: RayConfig | None = None,
    run: str | None = None,
) -> list[tuple[DatasetInfo, FilterInfo | None]]:
    """data.filters on every source that has them (each source's filtering cached in the store
    by content: a rerun reads it): its filtered dataset and what each filter removed, one log
    line per source. No task timeout (policy.stoker_task): the work is units over partitions in
    worker processes, each with its own deadline (data.units)."""
    store = Store.of(storage)
    sources = [(name, cfg) for name, _, cfg in data.source_configs()]
    out = filtering.filter_sources(datasets, sources, store, ray, on_progress=StageProgress(run))
    logger = get_run_logger()
    samples = []
    for _, info in out:
        if info is not None:
            logger.info(filter_line(info))
            samples += filtering.removed_samples(store, info)
    if run and samples:
        body = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
        store.write_bytes(run_file_key(run, FILTER_SAMPLES_FILE), body.encode("utf-8"))
    return out


@stoker_task(name="dedup_and_decontaminate", retries=2)
def dedup_and_decontaminate(
    datasets: list[DatasetInfo],
    data: DataConfig,
    evaluation: EvalConfig | None,
    storage: StorageConfig,
    ray: RayConfig | None = None,
    run: str | None = None,
) -> list[tuple[DatasetInfo, DedupInfo]]:
    """data.dedup and data.decontaminate on every source, in the order listed (each source's
    decision is cached in the store by content: a rerun reads it). Per source: one log line, a
    row of the 'dedup' table artifact; with `run`, the removed sample in its run folder.
    No task timeout (policy.stoker_task): the work is units over partitions, each bounded by
    its input, in worker processes (here, for a small corpus), a lost one run again
    (data.units); the store calls end by the store client's own timeouts."""
    from prefect.artifacts import create_table_artifact

    store = Store.of(storage)
    sources = [(name, cfg) for name, _, cfg in data.source_configs()]
    out = dedup.dedup_sources(datasets, sources, store, evaluation, ray, on_progress=StageProgress(run))
    logger = get_run_logger()
    samples = []
    for _, info in out:
        logger.info(dedup_line(info))
        samples += dedup.removed_samples(store, info)
    if run:
        body = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
        store.write_bytes(run_file_key(run, DEDUP_SAMPLES_FILE), body.encode("utf-8"))
    create_table_artifact(
        dedup_rows([info for _, info in out]),
        key=f"{re.sub(r'[^a-z0-9-]', '-', (run or 'data').lower())}-dedup"[:100],
        description="per source: documents in, exact and near duplicates and documents holding evaluation items removed",
    )
    return out


@stoker_task(
    name="train_tokenizer",
    retries=2,
    cache=StoreCache(content_key=tokenizer_key, holds=holds_tokenizer),
)
def train_tokenizer(
    datasets: list[DatasetInfo], tokenizer: TokenizerConfig, storage: StorageConfig, run: str | None = None
) -> TokenizerInfo:
    """Train a byte-level BPE on the corpus (every source's, for a mixture), or load the given
    tokenizer.json; a run that trained its own keeps it when its data changes (`run`).
    No task timeout (policy.stoker_task): the training is CPU work bounded by the corpus (the
    merges in native code, which no timeout in this thread interrupts); the reads of the corpus
    and of a tokenizer.path URL end by the store's and the HTTP client's own timeouts."""
    info = prepare.train_tokenizer(datasets, tokenizer, Store.of(storage), run=run)
    logger = get_run_logger()
    logger.info(
        "tokenizer %s: vocab %d (%s)",
        info.sha256[:12],
        info.vocab_size,
        "cached" if info.cache_hit else "trained/loaded",
    )
    # a loaded tokenizer (a base's) may have fewer ids than the model's rows, as real bases do
    if info.vocab_size < tokenizer.vocab_size and not tokenizer.path:
        logger.warning(vocabulary_note(info.vocab_size, tokenizer.vocab_size))
    return info


@stoker_task(
    name="tokenize_and_shard",
    retries=2,
    cache=StoreCache(content_key=shards_key, holds=holds_shards),
)
def tokenize_and_shard(
    dataset: DatasetInfo,
    tokenizer: TokenizerInfo,
    data: DataConfig,
    storage: StorageConfig,
    ray: RayConfig | None = None,
    name: str = DEFAULT_SOURCE_NAME,
) -> ShardInfo:
    """Tokenize once into shards keyed by content; a valid shard set is reused as is.
    data.num_workers worker processes share the work, or with data.engine 'ray' Ray tasks on
    the cluster of `ray`; the bytes depend on neither.

    No task timeout: submitted, the task runs on a worker thread, where Prefect's could not
    end it (policy.stoker_task). This thread only waits for the units: each is bounded by its
    partition, runs in a worker process (or a Ray task) and, lost, runs again (data.units);
    its progress shows as the stage's progress artifact."""
    progress = StageProgress(f"{name}-{dataset.fingerprint[:8]}")
    info = prepare.tokenize_and_shard(dataset, tokenizer, data, Store.of(storage), ray=ray, on_progress=progress)
    if data.engine == "ray":
        where = f"Ray tasks on {ray.address}" if ray and ray.address else "Ray tasks on a local Ray instance"
    else:
        where = f"up to {data.resolved_workers()} worker process(es)"
    get_run_logger().info(
        "shards%s %s: %d train / %d val tokens, %s (%s)",
        "" if name == DEFAULT_SOURCE_NAME else f" of source {name!r}",
        info.cache_key,
        info.num_train_tokens,
        info.num_val_tokens,
        info.dtype,
        "cache hit, no tokenization" if info.cache_hit else f"tokenized, {where}",
    )
    return dataclasses.replace(info, name=name)
