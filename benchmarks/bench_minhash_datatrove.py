"""stoker's near dedup (data.dedup 'near', its units in this process) against datatrove's own
MinHash pipeline (its four stages, MinhashDedupSignature -> Buckets -> Cluster -> Filter, on its
LocalPipelineExecutor, one task and worker per stage, its default 5-gram, 14 x 8 config), on the
same generated corpus, each in a fresh process: documents per CPU-second (the process and its
children), and recall at the threshold: planted pairs at exact 5-gram Jaccard 0.849 (0.05 above
stoker's 0.8) and 0.647 (0.15 below), the share of each removed.
goal: stoker's documents per CPU-second >= 1.0 x datatrove's; 0.849 pairs removed >= 0.95, 0.647
pairs removed <= 0.01

datatrove's English word splitter is spaCy's, not installed here: its signature stage is given a
whitespace splitter (the generated words are separated by spaces), which costs it less than
spaCy would; stoker's own splitter (a regex over the NFC text) stays in its figure.

    python -m benchmarks.bench_minhash_datatrove [--docs 20000] [--pairs 1000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time

from benchmarks._child import run_child


def _corpus(folder: str, docs: int, pairs: int, seed: int = 0) -> None:
    """`docs` documents of 200 distinct words, among them `pairs` pairs at Jaccard 0.849 and
    `pairs` at 0.647 (the second of each pair sharing the first's first 184 or 158 words)."""
    rng = random.Random(seed)
    pool = [_letters(i) for i in range(200_000)]  # letters only: datatrove's normalization drops digits
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "c.jsonl"), "w") as f:
        n = 0
        for kind, shared in (("hi", 184), ("lo", 158)):
            for i in range(pairs):
                ws = rng.sample(pool, 400 - shared)
                f.write(json.dumps({"text": " ".join(ws[:200]), "id": f"{kind}a{i}"}) + "\n")
                f.write(json.dumps({"text": " ".join(ws[:shared] + ws[200:]), "id": f"{kind}b{i}"}) + "\n")
                n += 2
        while n < docs:
            f.write(json.dumps({"text": " ".join(rng.sample(pool, 200)), "id": f"x{n}"}) + "\n")
            n += 1


def _letters(i: int) -> str:
    word = ""
    while True:
        i, d = divmod(i, 26)
        word += chr(97 + d)
        if not i:
            return word + "x"


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child_stoker(folder: str, work: str) -> dict:
    from stoker.config import DataConfig, EvalConfig
    from stoker.data import dedup, dedup_units
    from stoker.data.prepare import download_dataset
    from stoker.storage.store import Store, join

    store = Store(f"file://{work}/store")
    cfg = DataConfig(source=os.path.join(folder, "c.jsonl"), dedup="near", decontaminate=False, max_bytes=0)
    ds = download_dataset(cfg, store)  # not measured: datatrove reads the file as it is
    c0 = _cpu()
    [(_, info)] = dedup.dedup_sources([ds], [("main", cfg)], store, EvalConfig())
    cpu = _cpu() - c0
    import numpy as np

    removed = set(np.load(store.local_path(join(info.key, dedup_units.REMOVED_DOCS)))["removed"].tolist())
    ids = [json.loads(line)["id"] for line in open(os.path.join(folder, "c.jsonl"))]
    gone = {ids[k] for k in removed}
    return {"cpu_s": cpu, "docs": len(ids), "removed": sorted(gone)}


def child_datatrove(folder: str, work: str) -> dict:
    import datatrove.pipeline.dedup.minhash as minhash
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    class Whitespace:
        def word_tokenize(self, text: str, language=None) -> list[str]:
            return text.split()

    minhash.load_word_tokenizer = lambda language: Whitespace()
    from datatrove.utils.logging import logger

    logger.remove()  # its per-task stats on stderr
    import datatrove.utils.hashes.xxhash as dt_xxhash
    import xxhash

    def encoded(fn):  # datatrove 0.10.1 hashes str, which the xxhash installed here refuses
        return lambda data: fn(data.encode("utf-8") if isinstance(data, str) else data)

    dt_xxhash.xxhash64 = encoded(xxhash.xxh64_intdigest)
    dt_xxhash.xxhash32 = encoded(xxhash.xxh32_intdigest)
    cfg = MinhashConfig()

    def read():
        return JsonlReader(folder, glob_pattern="*.jsonl")

    stages = [
        [read(), MinhashDedupSignature(output_folder=f"{work}/sigs", config=cfg)],
        [MinhashDedupBuckets(input_folder=f"{work}/sigs", output_folder=f"{work}/buckets", config=cfg)],
        [MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/remove_ids", config=cfg)],
        [
            read(),
            MinhashDedupFilter(input_folder=f"{work}/remove_ids", exclusion_writer=JsonlWriter(f"{work}/removed")),
            JsonlWriter(f"{work}/kept"),
        ],
    ]
    c0 = _cpu()
    for i, pipeline in enumerate(stages):
        tasks = cfg.num_buckets if i == 1 else 1
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=f"{work}/logs-{i}").run()
    cpu = _cpu() - c0
    import gzip

    gone = set()
    for name in os.listdir(f"{work}/removed"):
        with gzip.open(os.path.join(work, "removed", name), "rt") as f:
            gone |= {json.loads(line)["id"] for line in f}
    docs = sum(1 for _ in open(os.path.join(folder, "c.jsonl")))
    return {"cpu_s": cpu, "docs": docs, "removed": sorted(gone)}


def _share(removed: set[str], kind: str, pairs: int) -> float:
    return sum(f"{kind}b{i}" in removed or f"{kind}a{i}" in removed for i in range(pairs)) / pairs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=20_000)
    p.add_argument("--pairs", type=int, default=1000)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--child", nargs=3, metavar=("WHO", "FOLDER", "WORK"))
    args = p.parse_args(argv)
    if args.child:
        who, folder, work = args.child
        print(json.dumps((child_stoker if who == "stoker" else child_datatrove)(folder, work)))
        return {}
    docs, pairs = (600, 50) if args.smoke else (args.docs, args.pairs)
    with tempfile.TemporaryDirectory(prefix="bench-minhash-") as tmp:
        _corpus(os.path.join(tmp, "src"), docs, pairs)
        t0 = time.perf_counter()
        got = {
            who: run_child(
                "benchmarks.bench_minhash_datatrove", [who, os.path.join(tmp, "src"), os.path.join(tmp, who)], who
            )
            for who in ("stoker", "datatrove")
        }
    out = {"bench_s": time.perf_counter() - t0}
    for who, r in got.items():
        removed = set(r["removed"])
        out[who] = {
            "docs_per_cpu_s": r["docs"] / r["cpu_s"],
            "cpu_s": r["cpu_s"],
            "removed_at_0.849": _share(removed, "hi", pairs),
            "removed_at_0.647": _share(removed, "lo", pairs),
            "removed_unplanted": sum(k.startswith("x") for k in removed),
        }
        o = out[who]
        print(
            f"{who}: {o['docs_per_cpu_s']:.0f} docs/CPU-s ({o['cpu_s']:.1f} CPU-s); pairs removed at 0.849: "
            f"{o['removed_at_0.849']:.3f}, at 0.647: {o['removed_at_0.647']:.3f}; unplanted removed {o['removed_unplanted']}",
            flush=True,
        )
    out["ratio"] = out["stoker"]["docs_per_cpu_s"] / out["datatrove"]["docs_per_cpu_s"]
    print(f"RATIO stoker / datatrove documents per CPU-second: {out['ratio']:.3f} (goal >= 1.0)")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
