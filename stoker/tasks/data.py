"""Prefect tasks of the data stage: one job each, policy on the decorator.

Caching is by content in the object store (the manifests are the truth). Each task's Prefect
cache key is the store's content key of its output (tasks.caching), and its record counts only
while the store holds that output with a valid manifest: then the task run shows Cached and
returns the stored result with cache_hit=True; from a deleted store, the task builds again.
"""

from __future__ import annotations

import dataclasses

from prefect import get_run_logger

from stoker.core.config import DataConfig, RayConfig, StorageConfig, TokenizerConfig
from stoker.core.config.sections import DEFAULT_SOURCE_NAME
from stoker.core.failures import DataError
from stoker.core.results import DatasetInfo, ShardInfo, TokenizerInfo
from stoker.data import prepare
from stoker.observe.report import vocabulary_note
from stoker.storage.store import Store
from stoker.tasks.caching import (
    StoreCache,
    dataset_key,
    holds_dataset,
    holds_shards,
    holds_tokenizer,
    shards_key,
    tokenizer_key,
)
from stoker.tasks.policy import stoker_task


def _store(storage: StorageConfig) -> Store:
    return Store(storage.root, storage.storage_options)


@stoker_task(
    name="download_dataset",
    retries=3,
    timeout_seconds=3600,
    cache=StoreCache(content_key=dataset_key, holds=holds_dataset),
)
def download_dataset(data: DataConfig, storage: StorageConfig, name: str = DEFAULT_SOURCE_NAME) -> DatasetInfo:
    """Copy the raw source into {root}/datasets/{fingerprint}/ (no copy when present).

    Transient network failures are retried inside (with backoff) and then by this task;
    a missing object, a wrong field or undecodable data fails at once (DataError), naming
    the source of data.sources it is about (`name`)."""
    try:
        info = prepare.download_dataset(data, _store(storage))
    except DataError as err:
        if name == DEFAULT_SOURCE_NAME:
            raise
        raise DataError(str(err).replace("data.", f"data.sources[{name}].", 1)) from None
    logger = get_run_logger()
    logger.info(
        "dataset%s %s: %d documents, %.1f MB (%s)",
        "" if name == DEFAULT_SOURCE_NAME else f" of source {name!r}",
        info.fingerprint,
        info.num_docs,
        info.num_bytes / 1e6,
        "already in the store, nothing stored" if info.cache_hit else "downloaded and stored",
    )
    if info.num_skipped_files:
        logger.warning(
            "%d source file(s) skipped as not UTF-8 text (data.on_decode_error='skip')", info.num_skipped_files
        )
    return info


@stoker_task(
    name="train_tokenizer",
    retries=2,
    timeout_seconds=3600,
    cache=StoreCache(content_key=tokenizer_key, holds=holds_tokenizer),
)
def train_tokenizer(
    datasets: list[DatasetInfo], tokenizer: TokenizerConfig, storage: StorageConfig, run: str | None = None
) -> TokenizerInfo:
    """Train a byte-level BPE on the corpus (every source's, for a mixture), or load the given
    tokenizer.json; a run that trained its own keeps it when its data changes (`run`)."""
    info = prepare.train_tokenizer(datasets, tokenizer, _store(storage), run=run)
    logger = get_run_logger()
    logger.info(
        "tokenizer %s: vocab %d (%s)",
        info.sha256[:12],
        info.vocab_size,
        "cached" if info.cache_hit else "trained/loaded",
    )
    if info.vocab_size < tokenizer.vocab_size:
        logger.warning(vocabulary_note(info.vocab_size, tokenizer.vocab_size))
    return info


@stoker_task(
    name="tokenize_and_shard",
    retries=2,
    timeout_seconds=14400,
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
    the cluster of `ray`; the bytes depend on neither."""
    info = prepare.tokenize_and_shard(dataset, tokenizer, data, _store(storage), ray=ray)
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
