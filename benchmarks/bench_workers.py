"""Tokenizer workers on this host: wall time of tokenize_and_shard with 1 worker (in-process,
the tokenizer's own threads) and with one single-threaded process per core, alternated, on
the built-in corpus. This is the measurement behind data.num_workers: 'auto' (1 on up to 2
cores). Prints the ratio processes/in-process (> 1: processes are slower here).

    python -m benchmarks.bench_workers [--smoke]

--smoke: a 300 KB corpus, a 384-id tokenizer, one run each; it checks that the benchmark runs,
its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny corpus, one run each: checks the benchmark runs")
    args = p.parse_args(argv)
    max_bytes, vocab, reps = (300_000, 384, 1) if args.smoke else (12_000_000, 2048, 3)

    from stoker.config import DataConfig, TokenizerConfig
    from stoker.data import prepare
    from stoker.storage.store import Store

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    work = tempfile.mkdtemp(prefix="stoker-bench-workers-")
    try:
        store = Store("file://" + work)
        base = DataConfig(source="builtin:stdlib", max_bytes=max_bytes, num_workers=1)
        dataset = prepare.download_dataset(base, store)
        tokenizer = prepare.train_tokenizer(dataset, TokenizerConfig(vocab_size=vocab), store)
        times: dict[int, list[float]] = {1: [], max(2, cores): []}
        for rep in range(reps):
            for n in times:
                # another shard size per run: a fresh cache key, so every run tokenizes
                cfg = base.model_copy(update={"num_workers": n, "shard_tokens": 2_000_000 + 10 * rep + n})
                t0 = time.perf_counter()
                info = prepare.tokenize_and_shard(dataset, tokenizer, cfg, store)
                times[n].append(time.perf_counter() - t0)
                assert not info.cache_hit
        one, many = (statistics.median(v) for v in times.values())
        n = max(times)
        print(
            f"  {info.num_train_tokens} tokens on {cores} cores: 1 worker {one:.2f}s, {n} processes "
            f"{many:.2f}s (medians of {reps})"
        )
        print(
            f"  RATIO {n} processes / 1 worker wall time = {many / one:.2f}  ('auto' picks "
            f"{DataConfig().resolved_workers()} here)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
