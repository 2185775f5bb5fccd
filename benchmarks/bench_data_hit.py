"""A data-stage cache hit on S3: bytes the flow process reads, and its wall time, against the old
deep check (every shard hashed, so downloaded, in the flow process) measured in the same run.

    python -m benchmarks.bench_data_hit --size-mb 1024

The shard set: the data stage's own set of a small corpus on a real S3 endpoint (moto_server on
127.0.0.1), grown to --size-mb with listed files of random bytes (each with its size and sha256
in the manifest, so a full check must read them all). Then, on the same set:

- new: ``tokenize_and_shard`` as it is (manifest, sizes, invalid marker; no shard byte read);
- old: the same call with the cache-hit check made deep, as before (``validate_shard_set(...,
  deep=True)``).

Bytes read are the sizes of every GET the flow process's S3 client makes (s3fs's ``_call_s3``
wrapped, nothing else changed). The full check still happens, once per host that uses the bytes
(``storage.shards.materialize``); this measures only what the choice costs the flow process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import statistics
import tempfile
import time

FILE_MB = 64  # size of each padding file, like a large shard
REPEATS = 3  # of the new (cheap) check; the old one runs once


@contextlib.contextmanager
def _counting_s3(counts: dict):
    """While open, count every S3 request by method, and the bytes of every GET."""
    import s3fs

    real = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        out = await real(self, method, *args, **kwargs)
        counts[method] = counts.get(method, 0) + 1
        if method == "get_object":
            counts["get_bytes"] = counts.get("get_bytes", 0) + int(out.get("ContentLength", 0))
        return out

    s3fs.S3FileSystem._call_s3 = counting
    try:
        yield
    finally:
        s3fs.S3FileSystem._call_s3 = real


def _grow(store, shard_key: str, size_mb: float, file_mb: int) -> tuple[int, int]:
    """Add random files to the set until it holds size_mb, each listed in the manifest with its
    size and sha256; returns (number of files, bytes) of the whole set."""
    manifest_key = f"{shard_key}/manifest.json"
    manifest = store.read_json(manifest_key)
    have = sum(e["size"] for e in manifest["files"].values())
    want = int(size_mb * 2**20)
    index = 0
    with tempfile.TemporaryDirectory() as tmp:
        while have < want:
            size = min(file_mb * 2**20, want - have)
            path, digest = os.path.join(tmp, "pad.bin"), hashlib.sha256()
            with open(path, "wb") as f:
                for start in range(0, size, 8 << 20):
                    block = os.urandom(min(8 << 20, size - start))
                    digest.update(block)
                    f.write(block)
            name = f"padding-{index:05d}.bin"
            store.put_file(path, f"{shard_key}/{name}")
            manifest["files"][name] = {"size": size, "sha256": digest.hexdigest()}
            have += size
            index += 1
    store.write_json(manifest_key, manifest)  # manifest last, as a real build
    return len(manifest["files"]), have


def _hit(prepare, ds, tk, cfg, store, counts: dict) -> tuple[float, int, int]:
    """One cache-hit data stage: (seconds, bytes read by GETs, GETs)."""
    counts.clear()
    start = time.perf_counter()
    info = prepare.tokenize_and_shard(ds, tk, cfg, store)
    seconds = time.perf_counter() - start
    assert info.cache_hit, "the benchmark's shard set was rebuilt: not a cache hit"
    return seconds, counts.get("get_bytes", 0), counts.get("get_object", 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="size of the shard set (MiB)")
    parser.add_argument("--file-mb", type=int, default=FILE_MB, help="size of each padding file (MiB)")
    args = parser.parse_args(argv)

    from benchmarks._servers import moto_s3
    from stoker.config import DataConfig, TokenizerConfig
    from stoker.data import prepare
    from stoker.storage.store import Store

    with moto_s3() as (root, options):
        store = Store(root, options)
        cfg = DataConfig(max_bytes=200_000, val_fraction=0.1)
        ds = prepare.download_dataset(cfg, store)
        tk = prepare.train_tokenizer(ds, TokenizerConfig(vocab_size=300), store)
        shards = prepare.tokenize_and_shard(ds, tk, cfg, store)
        start = time.perf_counter()
        num_files, num_bytes = _grow(store, shards.key, args.size_mb, args.file_mb)
        print(
            f"shard set {shards.url}: {num_bytes / 2**20:.1f} MiB in {num_files} files on S3 "
            f"(moto_server, 127.0.0.1), written in {time.perf_counter() - start:.1f} s",
            flush=True,
        )

        counts: dict = {}
        real_check = prepare.validate_shard_set
        with _counting_s3(counts):
            new = [_hit(prepare, ds, tk, cfg, Store(root, options), counts) for _ in range(REPEATS)]
            prepare.validate_shard_set = functools.partial(real_check, deep=True)  # the old code
            try:
                old = _hit(prepare, ds, tk, cfg, Store(root, options), counts)
            finally:
                prepare.validate_shard_set = real_check
        new_s = statistics.median(s for s, _, _ in new)
        new_bytes, new_gets = new[0][1], new[0][2]
        print(
            f"cache hit, manifest + sizes (new): {new_s:.3f} s (median of {REPEATS}), "
            f"{new_bytes} bytes read in {new_gets} GET(s)"
        )
        print(f"cache hit, deep check (old):       {old[0]:.3f} s, {old[1] / 2**20:.1f} MiB read in {old[2]} GET(s)")
        print(
            f"RATIO bytes read new/old: {new_bytes / max(1, old[1]):.2e}   "
            f"RATIO time new/old: {new_s / old[0]:.4f} (old/new {old[0] / max(new_s, 1e-9):.0f}x)"
        )


if __name__ == "__main__":
    main()
