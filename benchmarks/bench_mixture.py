"""The data wait of a mixture: the time a rank spends reading its batches per step when they
come from three sources (data.sources, quotas and per-source epochs of arithmetic.mixture) against
one source holding the same tokens. Each step reads the whole global batch (what every rank
together reads) through training.data.Batches, as the training loop does, from memory-mapped
shard files warmed into the page cache.                                      goal <= 1.05

    python -m benchmarks.bench_mixture [--tokens 60000000 --block 1024 --batch 64 --steps 200] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import numpy as np
import torch


def _shard_set(folder: str, tokens: int, file_tokens: int, seed: int) -> str:
    """A shard set of random uint16 tokens in files of file_tokens, with a manifest the training
    side reads (training.data.TokenStream)."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    names, left, i = [], tokens, 0
    while left > 0:
        n = min(file_tokens, left)
        name = f"train-{i:05d}.bin"
        rng.integers(0, 50_000, size=n, dtype=np.uint16).tofile(os.path.join(folder, name))
        names.append(name)
        left, i = left - n, i + 1
    np.zeros(4096, dtype=np.uint16).tofile(os.path.join(folder, "val-00000.bin"))
    manifest = {"vocab_size": 50_304, "eot_id": 0, "dtype": "<u2", "splits": {"train": names, "val": ["val-00000.bin"]}}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    for name in names:  # into the page cache, as a second epoch finds them
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(1 << 24):
                pass
    return folder


def _wait_per_step(windows, batch: int, steps: int, micro: int) -> list[float]:
    from stoker.training.data import Batches

    batches = Batches(
        windows, micro_batch=micro, rank=0, accum=batch // micro, device=torch.device("cpu"), prefetch=False
    )
    out = []
    for step in range(steps):
        before = batches.wait_seconds
        for m in range(batch // micro):
            batches.get(step, m)
        out.append(batches.wait_seconds - before)
    return out


def run(tokens: int, block: int, batch: int, steps: int, file_tokens: int, micro: int, rounds: int) -> dict:
    from stoker.arithmetic.mixture import Mixture
    from stoker.training.data import TokenStream, TrainWindows

    with tempfile.TemporaryDirectory(prefix="stoker-bench-mixture-") as tmp:
        one = TokenStream(_shard_set(os.path.join(tmp, "one"), tokens, file_tokens, 0), "train")
        three = [
            TokenStream(_shard_set(os.path.join(tmp, f"s{i}"), tokens // 3, file_tokens, i + 1), "train")
            for i in range(3)
        ]
        single = TrainWindows.one(one, block, seed=0, global_batch=batch)
        names = ["domain", "web", "code"]
        mixture = Mixture(names, [0.5, 0.3, 0.2], [], batch, 0, [s.num_windows(block) for s in three])
        mixed = TrainWindows(three, mixture, block)
        one_s, three_s = [], []
        for _ in range(rounds):  # interleaved, so drift of the machine hits both alike
            one_s += _wait_per_step(single, batch, steps, micro)
            three_s += _wait_per_step(mixed, batch, steps, micro)
    a, b = statistics.median(one_s), statistics.median(three_s)
    return {
        "tokens": tokens,
        "block_size": block,
        "global_batch": batch,
        "steps": steps * rounds,
        "one_source_ms_per_step": round(1000 * a, 3),
        "three_sources_ms_per_step": round(1000 * b, 3),
        "ratio": round(b / a, 3),
        "mixture": mixture.describe(),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=60_000_000, help="tokens in all (one source, or three of a third)")
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64, help="global batch, in sequences")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--file-tokens", type=int, default=8_000_000)
    p.add_argument("--smoke", action="store_true", help="a tiny run that checks the benchmark works")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.block, args.batch, args.micro, args.steps, args.rounds, args.file_tokens = (
            300_000,
            64,
            8,
            4,
            5,
            1,
            40_000,
        )
    result = run(args.tokens, args.block, args.batch, args.steps, args.file_tokens, args.micro, args.rounds)
    print(json.dumps(result, indent=2))
    print(
        f"RATIO three sources / one source (data wait per step): {result['ratio']:.3f} "
        f"({result['three_sources_ms_per_step']:.2f} ms vs {result['one_source_ms_per_step']:.2f} ms; goal <= 1.05)"
    )
    return result


if __name__ == "__main__":
    main()
