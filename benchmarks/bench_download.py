"""The download stage of a folder of many files: read by data.num_workers processes ahead of the
writer (stoker.data.sources.file_lines) against one reader, measured in the same run.

    python -m benchmarks.bench_download --size-mb 256 --files 64 --workers 2

A folder of --files JSON-lines files of random words (--size-mb in all before compression;
--gzip: .jsonl.gz) is downloaded into a
fresh local store, once with num_workers 1 (the baseline: this process parses every line) and
once with --workers processes (`--memory-files N`: instead, the flow's process's Python peak at N
small files and at 10 N, one reader and read ahead); the datasets' fingerprints must be equal (the same bytes). Prints
each wall time and CPU time of this process, and the ratio one reader / read ahead (the speed-up;
at most the cores the host gives it, less the writer's own share: hashing and writing).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import tempfile
import time


def _folder(path: str, size_mb: float, files: int, compress: bool = False) -> int:
    os.makedirs(path)
    rng = random.Random(0)
    words = [f"w{k}" for k in range(5000)]
    per_file = int(size_mb * 2**20 / files)
    total = 0
    for k in range(files):
        lines, size = [], 0
        while size < per_file:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 400))), "id": size}) + "\n"
            lines.append(line)
            size += len(line)
        text = "".join(lines).encode()
        name = os.path.join(path, f"{k:05d}.jsonl")
        with open(name + ".gz" if compress else name, "wb") as f:
            f.write(gzip.compress(text, compresslevel=6) if compress else text)
        total += size
    return total


def _download(src: str, root: str, workers: int) -> tuple[float, float, str]:
    from stoker.config import DataConfig
    from stoker.data import prepare
    from stoker.storage.store import Store

    cfg = DataConfig(source=src, num_workers=workers, max_bytes=0)
    wall, cpu = time.perf_counter(), time.process_time()
    ds = prepare.download_dataset(cfg, Store("file://" + root))
    return time.perf_counter() - wall, time.process_time() - cpu, ds.fingerprint


def _peak_of_download(files: int, workers: int) -> float:
    """tracemalloc's Python peak (MiB) in this process over a download of a folder of `files`
    small JSON-lines files (10 documents each), read ahead whatever its size."""
    import tracemalloc

    from stoker.data import sources

    threshold, sources.READ_AHEAD_BYTES = sources.READ_AHEAD_BYTES, 0
    try:
        with tempfile.TemporaryDirectory(prefix="bench-download-") as tmp:
            src = os.path.join(tmp, "src")
            os.makedirs(src)
            rng = random.Random(0)
            for k in range(files):
                with open(os.path.join(src, f"{k:06d}.jsonl"), "w") as f:
                    for _ in range(10):
                        f.write(json.dumps({"text": " ".join(f"w{rng.randrange(5000)}" for _ in range(60))}) + "\n")
            tracemalloc.start()
            try:
                _download(src, os.path.join(tmp, "store"), workers)
                return tracemalloc.get_traced_memory()[1] / 2**20
            finally:
                tracemalloc.stop()
    finally:
        sources.READ_AHEAD_BYTES = threshold


def memory(files: int, workers: int) -> dict:
    """The flow's process at 1x and 10x files, one reader and read ahead."""
    _peak_of_download(10, workers)  # what the first download imports is not the folder's
    got = {(n, w): _peak_of_download(n, w) for n in (files, 10 * files) for w in (1, workers)}
    for w in (1, workers):
        print(
            f"{'one reader' if w == 1 else f'read ahead by {w}'}: Python peak {got[files, w]:.2f} MiB at "
            f"{files} files, {got[10 * files, w]:.2f} MiB at {10 * files}; ratio 10x / 1x "
            f"{got[10 * files, w] / got[files, w]:.3f}"
        )
    return {f"{n}x{w}": round(v, 3) for (n, w), v in got.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=256)
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gzip", action="store_true", help="the files gzip-compressed (.jsonl.gz)")
    p.add_argument("--memory-files", type=int, default=0, help="instead: the peak at this many files and 10x")
    p.add_argument("--smoke", action="store_true", help="a tiny folder: that it runs, not its figures")
    args = p.parse_args(argv)
    if args.memory_files:
        return memory(args.memory_files, args.workers)
    if args.smoke:
        args.size_mb, args.files = 2, 4
    from stoker.data import sources

    threshold = sources.READ_AHEAD_BYTES
    if args.smoke:  # a tiny folder read ahead all the same
        sources.READ_AHEAD_BYTES = 0
    try:
        with tempfile.TemporaryDirectory(prefix="bench-download-") as tmp:
            src = os.path.join(tmp, "src")
            total = _folder(src, args.size_mb, args.files, args.gzip)
            one = _download(src, os.path.join(tmp, "one"), 1)
            ahead = _download(src, os.path.join(tmp, "ahead"), args.workers)
    finally:
        sources.READ_AHEAD_BYTES = threshold
    assert one[2] == ahead[2], "the read ahead made another dataset"
    result = {
        "bytes": total,
        "files": args.files,
        "one_reader_s": round(one[0], 2),
        "one_reader_cpu_s": round(one[1], 2),
        "read_ahead_s": round(ahead[0], 2),
        "read_ahead_cpu_s": round(ahead[1], 2),
        "workers": args.workers,
        "speedup": round(one[0] / ahead[0], 3),
    }
    print(
        f"download of {total / 2**20:,.0f} MiB in {args.files} {'gzip ' if args.gzip else ''}files: one reader {one[0]:.2f} s "
        f"({one[1]:.2f} CPU-s here), read ahead by {args.workers} processes {ahead[0]:.2f} s "
        f"({ahead[1]:.2f} CPU-s here); ratio one reader / read ahead: {result['speedup']:.3f} "
        "(the same fingerprint)"
    )
    return result


if __name__ == "__main__":
    main()
