"""data.dedup 'near' + decontamination as units on Ray: the four stages' wall time on a
one-node cluster against a two-node one (tests.raycluster.RayCluster: Ray nodes in network
namespaces, one CPU each, the store on moto S3 that every node reaches), the same removals as
the local engine, and the nodes the units ran on.                     goal: 1 node / 2 nodes >= 1.4

    python -m benchmarks.bench_ray_dedup [--docs 200000] [--smoke]

The simulated nodes share this host's cores with the driver and the store, so the ratio is a
floor of what separate machines give. Needs root and iproute2 (network namespaces) and Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time


def child(root: str, options: str, corpus: str, engine: str, address: str) -> dict:
    """The dedup stage of one source into a store without decisions, measured."""
    from stoker.config import DataConfig, EvalConfig, RayConfig
    from stoker.data import dedup
    from stoker.data.prepare import download_dataset
    from stoker.storage.store import Store

    store = Store(root, json.loads(options))
    cfg = DataConfig(source=corpus, max_bytes=0, dedup="near", engine=engine, num_workers=2)
    ds = download_dataset(cfg, store)
    store.rm("dedup")
    nodes: set = set()

    class Catch(logging.Handler):
        def emit(self, record):
            nodes.update(getattr(record, "ray_nodes", ()))

    logging.getLogger("stoker.data").addHandler(Catch())
    logging.getLogger("stoker.data").setLevel(logging.INFO)
    t0 = time.perf_counter()
    [(_, info)] = dedup.dedup_sources([ds], [("main", cfg)], store, EvalConfig(), RayConfig(address=address or None))
    return {
        "wall_s": time.perf_counter() - t0,
        "nodes": len(nodes),
        "removed": [info.num_exact, info.num_near, info.num_contaminated, info.num_docs_out],
    }


def _run_child(*args: str) -> dict:
    from benchmarks._child import run_child

    return run_child("benchmarks.bench_ray_dedup", list(args), args[3], RAY_USAGE_STATS_ENABLED="0")


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=200_000)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--child", nargs=5)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return None
    from benchmarks.bench_data_scale import _corpus
    from benchmarks.bench_ray_data import _cluster, _Moto
    from tests.raycluster import ray_unavailable

    why = ray_unavailable()
    if why:
        print(f"  skipped: {why}")
        return None
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    docs = 2_000 if args.smoke else args.docs
    out: dict = {"docs": docs}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-ray-dedup-", dir="/tmp") as work:
        corpus = os.path.join(work, "corpus.jsonl")
        out["corpus_mb"] = _corpus(corpus, docs) / 1e6
        for nodes in (1, 2):
            cluster = _cluster(nodes)
            moto = None
            try:
                moto = _Moto(cluster.bridge_address)
                root, options = moto.bucket()
                out[f"ray_{nodes}"] = _run_child(root, json.dumps(options), corpus, "ray", cluster.client_address)
                if nodes == 1:
                    out["local"] = _run_child(root, json.dumps(options), corpus, "local", "")
            finally:
                if moto is not None:
                    moto.stop()
                cluster.down()
    assert out["ray_1"]["removed"] == out["ray_2"]["removed"] == out["local"]["removed"], out
    ratio = out["ray_1"]["wall_s"] / out["ray_2"]["wall_s"]
    out["ratio_1_over_2_nodes"] = ratio
    print(json.dumps(out, indent=2))
    print(
        f"RATIO dedup stage wall time on Ray, 1 node / 2 nodes (1 CPU each), {docs:,} documents: {ratio:.2f} "
        f"(goal >= 1.4); units on {out['ray_2']['nodes']} node(s); the same removals as the local engine"
    )
    return out


if __name__ == "__main__":
    main()
