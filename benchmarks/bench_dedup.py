"""data.dedup 'near' + data.decontaminate: documents per CPU-second of the whole dedup stage
(features, decision, kept corpus published) against datasketch's own MinHash alone on the same
documents; peak memory on a 10x corpus; the stage's cost on a cached rerun, and its share of a
cached rerun of the whole data stage.

    python -m benchmarks.bench_dedup            # the standard library, all of it (4.7 MB)
    python -m benchmarks.bench_dedup --scale 10 # ten copies, each word-shuffled per line (47 MB)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile
import time

from datasketch import MinHash

from stoker.config import DataConfig, EvalConfig, TokenizerConfig
from stoker.data import dedup, minhash
from stoker.data.prepare import download_dataset, iter_corpus, prepare_all
from stoker.storage.store import Store


def _scaled(store: Store, scale: int, tmp: str) -> DataConfig:
    cfg = DataConfig(max_bytes=0, dedup="near")
    if scale == 1:
        return cfg
    ds = download_dataset(cfg, store)
    rng = random.Random(0)
    path = os.path.join(tmp, "scaled.jsonl")
    with open(path, "w") as f:  # each copy's lines shuffled in words: new documents, same sizes
        for copy in range(scale):
            for doc in iter_corpus(store, ds):
                if copy:
                    lines = doc.split("\n")
                    lines = [" ".join(rng.sample(ln.split(), len(ln.split()))) for ln in lines]
                    doc = "\n".join(lines)
                f.write(json.dumps({"text": doc}) + "\n")
    return DataConfig(source=path, max_bytes=0, dedup="near")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=int, default=1)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-dedup-")
    store = Store(f"file://{tmp}/store")
    cfg = _scaled(store, args.scale, tmp)
    ds = download_dataset(cfg, store)
    t0 = time.process_time()
    info = dedup.dedup_sources([ds], [("main", cfg)], store, EvalConfig())[0][1]
    stage = time.process_time() - t0
    t0 = time.process_time()
    dedup.dedup_sources([ds], [("main", cfg)], store, EvalConfig())
    rerun = time.process_time() - t0
    out = {
        "docs": ds.num_docs,
        "MB": round(ds.num_bytes / 1e6, 1),
        "stage_cpu_s": round(stage, 2),
        "stage_docs_per_cpu_s": round(ds.num_docs / stage, 1),
        "cached_rerun_cpu_s": round(rerun, 3),
        "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "removed": [info.num_exact, info.num_near, info.num_contaminated],
    }
    if args.scale == 1:  # the library alone: its MinHash of the same 5-word shingles
        docs = list(iter_corpus(store, ds))
        t0 = time.process_time()
        for k in range(0, len(docs), minhash.MINHASH_BATCH):
            batch = [minhash.shingles(minhash.words(d), 5) for d in docs[k : k + minhash.MINHASH_BATCH]]
            MinHash.bulk(batch, num_perm=minhash.NUM_PERM, seed=minhash.MINHASH_SEED, scheme=minhash.MINHASH_SCHEME)
        alone = time.process_time() - t0
        out["minhash_alone_docs_per_cpu_s"] = round(len(docs) / alone, 1)
        out["ratio"] = round(alone / stage, 2)
        # the stage's share of a cached rerun of the whole data stage (download, dedup,
        # tokenizer, shards: every one a hit in the store)
        tokenizer = TokenizerConfig(vocab_size=2048)
        prepare_all(cfg, tokenizer, store, evaluation=EvalConfig())
        t0 = time.process_time()
        prepare_all(cfg, tokenizer, store, evaluation=EvalConfig())
        whole = time.process_time() - t0
        out["cached_data_stage_cpu_s"] = round(whole, 3)
        out["dedup_share_of_cached_rerun"] = round(rerun / whole, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
