"""Entry point of every rank: ``torchrun ... -m training.train --config <run>/config.json``.

Parse, build, train, close. No orchestrator is imported here or below.
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from storage.shards import materialize
from storage.store import Store, default_cache_dir
from core.config import RunConfig
from core.failures import is_transient
from training.loop import METRIC_PREFIX, Trainer, setup_distributed

def report_failure(exc: BaseException) -> None:
    """Tell the launcher why this rank failed, as one JSON line."""
    record = {"event": "failure", "rank": int(os.environ.get("RANK", "0")),
              "type": type(exc).__name__, "message": str(exc)[:800],
              "transient": is_transient(exc)}
    print(METRIC_PREFIX + json.dumps(record), flush=True)


def read_config(url: str) -> RunConfig:
    """Read config.json from any URL the store can reach (storage options from env)."""
    store_root, _, name = url.rpartition("/")
    options = json.loads(os.environ.get("STOKER_STORAGE_OPTIONS", "{}"))
    return RunConfig.model_validate_json(Store(store_root, options).read_bytes(name)).check()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train one rank of a stoker run.")
    p.add_argument("--config", required=True, help="URL or path of the run's config.json")
    p.add_argument("--shards", required=True, help="shard-set key under the store root (shards/<key>)")
    p.add_argument("--resume-from", default=None, help="checkpoint key under the store root")
    p.add_argument("--cache-dir", default=default_cache_dir())
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shard_key = args.shards.rstrip("/").rsplit("/", 1)[-1]
    try:
        cfg = read_config(args.config)
        ranks = setup_distributed(cfg)
        store = Store(cfg.storage.root, cfg.storage.storage_options)
        trainer = Trainer(cfg, ranks, materialize(store, shard_key, args.cache_dir), store, shard_key,
                          cache_dir=args.cache_dir)
        if args.resume_from:
            trainer.resume(args.resume_from)
        trainer.fit()
    except Exception as exc:
        report_failure(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
