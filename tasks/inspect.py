"""What is in a store, for `stoker runs`, `stoker checkpoints` and `stoker verify`: plain
functions (no flow run), reading manifests and listings; only verify reads every byte."""

from __future__ import annotations

import re

from core.config import RunConfig
from core.failures import ConfigError
from storage.checkpoints import list_checkpoints, validate_checkpoint
from storage.layout import CONFIG_FILE, METRICS_FILE, parse_checkpoint_url, run_file_key
from storage.manifest import Verdict
from storage.shards import validate_shard_set
from storage.store import Store

_SHARD_URL = re.compile(r"^(?P<root>.+)/shards/(?P<key>[^/]+)/?$")


def _store(root: str, options: dict | None = None) -> Store:
    store = Store(root, options or {})
    if not store.exists(""):
        raise ConfigError([f"storage.root: {store.root} does not exist; give the root the runs "
                           "were written to (--root or $STOKER_ROOT)"])
    return store


def list_runs(root: str, options: dict | None = None) -> list[dict]:
    """One row per run folder: its newest committed checkpoint step, how many checkpoint
    folders it has, train.max_steps and the model's shape from its config.json."""
    store = _store(root, options)
    rows = []
    names = store.listdir("runs") if store.exists("runs") else []
    for run in sorted(names):
        refs = list_checkpoints(store, run)
        newest = next((r for r in refs if validate_checkpoint(store, r.key)), None)
        row = {"run": run, "newest_valid_step": newest.step if newest else None,
               "checkpoints": len(refs), "max_steps": None, "model": None,
               "metrics": store.exists(run_file_key(run, METRICS_FILE))}
        try:
            cfg = RunConfig.model_validate_json(store.read_bytes(run_file_key(run, CONFIG_FILE)))
            m = cfg.model
            row.update(max_steps=cfg.train.max_steps,
                       model=f"{m.n_layer} layers x {m.n_embd}, {m.n_head} heads, block {m.block_size}")
        except Exception:  # a run folder without a readable config is listed all the same
            pass
        rows.append(row)
    return rows


def checkpoint_rows(root: str, run: str, options: dict | None = None) -> list[dict]:
    """Every checkpoint folder of a run, newest first, with whether it is committed (manifest
    present, every listed file at its size, not marked invalid: no byte read, so a flipped byte
    is not seen; `verify` reads them) and the reason when it is not."""
    store = _store(root, options)
    rows = []
    for ref in list_checkpoints(store, run):
        verdict = validate_checkpoint(store, ref.key)
        files = verdict.manifest.get("files", {}) if verdict.manifest else {}
        rows.append({"step": ref.step, "name": ref.name, "uri": store.url(ref.key),
                     "valid": bool(verdict), "reason": verdict.reason,
                     "size_mb": round(sum(e.get("size", 0) for e in files.values()) / 1e6, 1)})
    return rows


def verify(uri: str, options: dict | None = None) -> tuple[str, Verdict]:
    """The full check of a checkpoint or shard-set URL: every listed file's sha256. Returns
    what was checked and the verdict; ConfigError for a URL of neither form."""
    shard = _SHARD_URL.match(uri.strip())
    if shard:
        store = Store(shard.group("root"), options or {})
        return "shard set", validate_shard_set(store, shard.group("key"), deep=True)
    try:
        where = parse_checkpoint_url(uri)
    except ConfigError:
        raise ConfigError([f"uri: {uri!r} is neither a checkpoint ({{root}}/runs/{{run}}/checkpoints/"
                           "step-NNNNNNNN) nor a shard set ({root}/shards/{key}); copy one from "
                           "`stoker checkpoints RUN` or the run report"]) from None
    store = Store(where.root, options or {})
    return "checkpoint", validate_checkpoint(store, where.key, deep=True)
