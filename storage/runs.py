"""A run's folder in the store: pinning its config, tokenizer and shard set before launch,
and reading them back from a checkpoint URL."""

from __future__ import annotations

import uuid

from core.config import RunConfig
from core.failures import ConfigError
from core.results import ShardInfo
from storage.layout import CONFIG_FILE, SHARDS_FILE, TOKENIZER_FILE, parse_checkpoint_url, run_file_key
from storage.store import Store, join


def store_problem(store: Store) -> str:
    """'' when the store root can be written (a tiny probe object, written and removed), else
    one line naming storage.root and the fix. Permanent failures only (a missing bucket,
    access denied); a store that is merely unreachable raises, to be retried."""
    from core.failures import describe, is_transient

    probe = f".stoker-probe-{uuid.uuid4().hex[:12]}"
    try:
        store.write_bytes(probe, b"")
        store.rm(probe)
    except Exception as err:
        if is_transient(err):
            raise
        return (f"storage.root: {store.root} cannot be written ({describe(err)}); create the "
                "bucket or folder, fix its name, or give credentials that may write there.")
    return ""


def pin_run_folder(store: Store, config: RunConfig, shards: ShardInfo) -> str:
    """Write config.json, the tokenizer and shards.json into the run folder; return the
    config URL. A run folder that already holds another model is refused: resuming from it
    could not load, and overwriting it would lose work."""
    run = config.resolved_run_name()
    key = run_file_key(run, CONFIG_FILE)
    if store.exists(key):
        old = RunConfig.model_validate_json(store.read_bytes(key))
        if old.model_hash() != config.model_hash():
            raise ConfigError([f"run_name: run {run!r} already holds a different model "
                               "(model or tokenizer.vocab_size changed); choose a new run_name."])
        pinned = run_file_key(run, SHARDS_FILE)
        if store.exists(pinned):
            before = store.read_json(pinned).get("cache_key")
            if before and before != shards.cache_key:
                raise ConfigError([f"run_name: run {run!r} was trained on shard set {before}, and this "
                                   f"config makes {shards.cache_key} (the data, tokenizer or "
                                   "sharding changed); resuming would change the data under the "
                                   "run: choose a new run_name."])
    store.write_bytes(key, config.to_json().encode())
    store.copy(join(shards.key, TOKENIZER_FILE), run_file_key(run, TOKENIZER_FILE))
    store.write_json(run_file_key(run, SHARDS_FILE), shards.as_dict())
    return store.url(key)


def checkpoint_inputs(checkpoint_url: str, storage_options: dict) -> tuple[RunConfig, str, str, str]:
    """From a checkpoint URL: the run's config (pointed at that store), its URL, the
    checkpoint key and the shard-set key."""
    where = parse_checkpoint_url(checkpoint_url)  # ConfigError naming checkpoint_uri
    store = Store(where.root, storage_options)
    config_key = run_file_key(where.run_name, CONFIG_FILE)
    config = RunConfig.model_validate_json(store.read_bytes(config_key))
    config = config.model_copy(update={"storage": config.storage.model_copy(
        update={"root": where.root, "storage_options": storage_options or config.storage.storage_options})})
    shard_key = store.read_json(run_file_key(where.run_name, SHARDS_FILE))["key"]
    return config, store.url(config_key), where.key, shard_key
