"""Build a shard set for GPU runs here (the GPU host has no Prefect and no datasets), to carry
to it: the data stage of a recipe (download, tokenizer, shards) into a local store, with the
raw corpus and tokenizer folders left out of what travels.

    python -m benchmarks.make_shards --recipe gpt2-124m-1gpu --max-bytes 30000000 --out .gpu/store

Prints the shard key; ``{out}/shards/<key>`` is the folder to carry (name ``.gpu`` in carry).
"""

from __future__ import annotations

import argparse
import os
import shutil


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="gpt2-124m-1gpu")
    p.add_argument("--max-bytes", type=int, default=30_000_000)
    p.add_argument("--out", default=".gpu/store")
    args = p.parse_args(argv)

    from core.config import load_config
    from data import prepare
    from storage.store import Store

    out = os.path.abspath(args.out)
    cfg = load_config(args.recipe, **{"storage.root": "file://" + out, "data.max_bytes": args.max_bytes,
                                      "data.shard_tokens": 5_000_000})
    store = Store(cfg.storage.root)
    dataset = prepare.download_dataset(cfg.data, store)
    tokenizer = prepare.train_tokenizer(dataset, cfg.tokenizer, store)
    shards = prepare.tokenize_and_shard(dataset, tokenizer, cfg.data, store)
    for folder in ("datasets", "tokenizers"):  # only the shards travel
        shutil.rmtree(os.path.join(out, folder), ignore_errors=True)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"shards {shards.key}: {shards.num_train_tokens} train tokens, {size / 2**20:.1f} MiB under {out}")


if __name__ == "__main__":
    main()
