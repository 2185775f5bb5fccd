"""The whole data stage (download, data.dedup near, decontamination against the default
evaluation sets, a trained tokenizer, tokenize and shard) at 1x and 10x documents of generated
text, each in a fresh process: the peak RSS of the flow's process and of the largest unit
process, and CPU-seconds per document (the process and its children together).
goals: peak RSS at 10x <= 1.1 x at 1x (every process); CPU-s per document at 10x <= 1.1 x at 1x

    python -m benchmarks.bench_data_scale [--docs 20000] [--scale 10] [--workers 2] [--smoke]

The units run in worker processes at both sizes (dedup.IN_PROCESS_BYTES 0), so the flow's
process holds what it holds at any size: the partitions' and buckets' bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

WORDS = 20_000


def _corpus(path: str, num_docs: int, seed: int = 0) -> int:
    """JSON lines of generated documents (60-140 words of a Zipf-like vocabulary), 2% exact
    copies and 2% near copies (3 words changed) of earlier ones; returns the bytes written."""
    rng = random.Random(seed)
    vocab = [f"w{i}x{rng.randrange(10**6)}" for i in range(WORDS)]
    weights = [1.0 / (i + 1) for i in range(WORDS)]
    recent: list[str] = []
    with open(path, "w") as f:
        for _ in range(num_docs):
            r = rng.random()
            if recent and r < 0.02:
                doc = rng.choice(recent)
            elif recent and r < 0.04:
                ws = rng.choice(recent).split()
                for i in rng.sample(range(len(ws)), 3):
                    ws[i] = rng.choice(vocab)
                doc = " ".join(ws)
            else:
                doc = " ".join(rng.choices(vocab, weights, k=rng.randint(60, 140)))
            recent = (recent + [doc])[-1000:]  # copies of the recent documents: bounded memory here too
            f.write(json.dumps({"text": doc}) + "\n")
    return os.path.getsize(path)


CHILD = """
import json, resource, sys, time
from stoker.config import DataConfig, EvalConfig, TokenizerConfig
from stoker.data import dedup, prepare
from stoker.storage.store import Store
dedup.IN_PROCESS_BYTES = 0
path, root, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = DataConfig(source=path, max_bytes=0, dedup="near", num_workers=workers, val_fraction=0.01)
t0 = time.perf_counter()
shards = prepare.prepare_all(cfg, TokenizerConfig(vocab_size=4096), Store(root), evaluation=EvalConfig())
wall = time.perf_counter() - t0
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
d = shards.dedup[0]
print(json.dumps({
    "wall_s": wall,
    "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
    "flow_peak_mb": me.ru_maxrss / 1024, "unit_peak_mb": kids.ru_maxrss / 1024,
    "docs_in": d.num_docs_in, "exact": d.num_exact, "near": d.num_near, "contaminated": d.num_contaminated,
    "train_tokens": shards.sets[0].num_train_tokens,
}))
"""


def _point(num_docs: int, workers: int, tmp: str) -> dict:
    path = os.path.join(tmp, f"corpus-{num_docs}.jsonl")
    size = _corpus(path, num_docs)
    root = os.path.join(tmp, f"store-{num_docs}")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, path, f"file://{root}", str(workers)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got.update(num_docs=num_docs, corpus_mb=size / 1e6, cpu_s_per_kdoc=1000 * got["cpu_s"] / num_docs)
    return got


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=20_000)
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny size, to check the benchmark runs")
    args = p.parse_args(argv)
    docs, scale = (400, 3) if args.smoke else (args.docs, args.scale)
    with tempfile.TemporaryDirectory(prefix="bench-data-scale-") as tmp:
        t0 = time.perf_counter()
        one = _point(docs, args.workers, tmp)
        ten = _point(docs * scale, args.workers, tmp)
    result = {
        "1x": one,
        f"{scale}x": ten,
        "flow_peak_ratio": ten["flow_peak_mb"] / one["flow_peak_mb"],
        "unit_peak_ratio": ten["unit_peak_mb"] / max(one["unit_peak_mb"], 1e-9),
        "cpu_per_doc_ratio": ten["cpu_s_per_kdoc"] / one["cpu_s_per_kdoc"],
        "bench_s": time.perf_counter() - t0,
        "host_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps(result, indent=2))
    for name, key in (
        ("flow process peak RSS", "flow_peak_ratio"),
        ("largest unit process peak RSS", "unit_peak_ratio"),
        ("CPU-s per document", "cpu_per_doc_ratio"),
    ):
        print(f"RATIO {name}, {scale}x against 1x documents: {result[key]:.3f} (goal <= 1.1)")
    return result


if __name__ == "__main__":
    main()
