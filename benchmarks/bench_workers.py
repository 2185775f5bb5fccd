"""Tokenizer workers on this host: wall time of tokenize_and_shard with 1 worker (in-process,
the tokenizer's own threads) and with one single-threaded process per core, alternated, on
the built-in corpus. This is the measurement behind data.num_workers: 'auto' (1 on up to 2
cores). Prints the ratio processes/in-process (> 1: processes are slower here)."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time


def main() -> None:
    from stoker.core.config import DataConfig, TokenizerConfig
    from stoker.data import prepare
    from stoker.storage.store import Store

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    work = tempfile.mkdtemp(prefix="stoker-bench-workers-")
    try:
        store = Store("file://" + work)
        base = DataConfig(source="builtin:stdlib", max_bytes=12_000_000, num_workers=1)
        dataset = prepare.download_dataset(base, store)
        tokenizer = prepare.train_tokenizer(dataset, TokenizerConfig(vocab_size=2048), store)
        times: dict[int, list[float]] = {1: [], max(2, cores): []}
        for rep in range(3):
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
            f"{many:.2f}s (medians of 3)"
        )
        print(
            f"  RATIO {n} processes / 1 worker wall time = {many / one:.2f}  ('auto' picks "
            f"{DataConfig().resolved_workers()} here)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
