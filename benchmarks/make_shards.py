"""Build a shard set for GPU runs here (the GPU host has no Prefect and no datasets), to carry
to it: the data stage of a recipe (download, tokenizer, shards) into a local store, with the
raw corpus and tokenizer folders left out of what travels.

    python -m benchmarks.make_shards --recipe gpt2-124m-1gpu --max-bytes 30000000 --out .gpu/store

The built-in corpus is too small for a 50k BPE: trained on it, the tokenizer stops at 26,381
tokens (39,082 with min_frequency 1), and the "GPT-2 124M" built on it has 106M parameters,
with a smaller output matmul than the real model's. So the trained tokenizer gets unused
special tokens up to ``--vocab`` (GPT-2's 50,257 by default; the recipe pads the model to
50,304): the model is GPT-2 124M's size, the ids of the real tokens are unchanged, and
throughput does not depend on which tokens the shards hold. ``--vocab 0`` keeps the trained
tokenizer as it is.

Prints the shard key, the vocabulary and the model's size; ``{out}/shards/<key>`` is the
folder to carry (name ``.gpu`` in carry).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

GPT2_VOCAB = 50257


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="gpt2-124m-1gpu")
    p.add_argument("--max-bytes", type=int, default=30_000_000)
    p.add_argument("--out", default=".gpu/store")
    p.add_argument(
        "--vocab",
        type=int,
        default=GPT2_VOCAB,
        help="pad the trained tokenizer with unused special tokens to this many ids (0: no padding)",
    )
    args = p.parse_args(argv)

    from stoker.config import load_config
    from stoker.data import prepare
    from stoker.storage.store import Store

    out = os.path.abspath(args.out)
    cfg = load_config(
        args.recipe,
        **{"storage.root": "file://" + out, "data.max_bytes": args.max_bytes, "data.shard_tokens": 5_000_000},
    )
    store = Store(cfg.storage.root)
    dataset = prepare.download_dataset(cfg.data, store)
    tokenizer = prepare.train_tokenizer(dataset, cfg.tokenizer, store)
    if tokenizer.vocab_size < args.vocab:
        path = os.path.join(tempfile.mkdtemp(dir=out), "tokenizer.json")
        pad_tokenizer(store.local_path(tokenizer.key), args.vocab, path)
        cfg = cfg.model_copy(update={"tokenizer": cfg.tokenizer.model_copy(update={"path": path})})
        tokenizer = prepare.train_tokenizer(dataset, cfg.tokenizer, store)
        shutil.rmtree(os.path.dirname(path))
    shards = prepare.tokenize_and_shard(dataset, tokenizer, cfg.data, store)
    for folder in ("datasets", "tokenizers"):  # only the shards travel
        shutil.rmtree(os.path.join(out, folder), ignore_errors=True)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"shards {shards.key}: {shards.num_train_tokens} train tokens, {size / 2**20:.1f} MiB under {out}")
    print(model_line(cfg, tokenizer.vocab_size))


def pad_tokenizer(src: str, vocab: int, dst: str) -> None:
    """A copy of the tokenizer at src with unused special tokens appended up to `vocab` ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(src)
    have = tok.get_vocab_size()
    tok.add_special_tokens([f"<|unused-{i}|>" for i in range(vocab - have)])
    tok.save(dst)


def model_line(cfg, vocab_size: int) -> str:
    """The model a recipe builds on a vocabulary: its parameters, and whether it is smaller
    than the recipe's tokenizer.vocab_size makes it."""
    import torch

    from stoker.families.gpt2.model import GPT
    from stoker.families.layers import padded_vocab

    with torch.device("meta"):
        n = GPT(cfg.model, vocab_size, seed=None).num_params()
    small = padded_vocab(vocab_size, cfg.model.vocab_pad_multiple) < cfg.tokenizer.vocab_size
    return (
        f"vocabulary {vocab_size:,} (recipe: {cfg.tokenizer.vocab_size:,}); the model has "
        f"{n / 1e6:.1f}M parameters" + (" -- smaller than the recipe's model" if small else "")
    )


if __name__ == "__main__":
    main()
