"""data.engine 'ray' benchmark: ratios against baselines measured in the same run, on the same
corpus, the same tokenizer and the same object store (S3: moto on the cluster's bridge, which
every node reaches; --store file: a local folder every node reads).

    python -m benchmarks.bench_ray_data [--mb 40] [--repeats 3] [--store s3|file] [--smoke]

1. tokens per CPU-second: the Ray engine on a two-node cluster / the local engine    goal >= 0.8
2. the Ray engine's wall time on a one-node cluster / on a two-node cluster           goal >= 1.4
   (each node one CPU, tests.raycluster.RayCluster: Ray nodes in network namespaces)

CPU seconds: the local engine's are user+sys of its process and its worker processes; the
Ray engine's are the driver's plus every process of the cluster's nodes (raylets, GCS, the
Ray Client server, the task workers: the engine's whole cost, sampled from /proc while it
runs) and, for reference, the tasks' own. The object store's CPU is in neither. Wall times
include connecting to the cluster and the shard set's commit. Tokens exclude the end-of-text
ids. The simulated nodes share this host's cores with the driver and the store, so the
scaling ratio is a floor of what separate machines give. Needs root and iproute2 (network
namespaces) and Ray; without them it says why and stops.

--smoke: a 0.3 MB corpus (the tokenizer trained on it too), one build each, and both Ray
columns on one two-node cluster (the test passes its session's: main(cluster=...)); it checks
that the benchmark runs, its figures (the 1-node one above all) mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

VOCAB = 2048
PARTITION_BYTES = 1 << 20
SHARD_TOKENS = 1_000_000
TICK = os.sysconf("SC_CLK_TCK")


# ---- the store ----------------------------------------------------------------------------
class _Moto:
    """moto_server on `host` (the cluster's bridge address: every node reaches it)."""

    def __init__(self, host: str):
        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.proc = subprocess.Popen(
            [exe, "-H", host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.url = f"http://{host}:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((host, self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.1)

    def bucket(self) -> tuple[str, dict]:
        import s3fs

        options = {"endpoint_url": self.url, "skip_instance_cache": True}
        name = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**options).mkdir(name)
        return f"s3://{name}/root", options

    def stop(self) -> None:
        os.killpg(self.proc.pid, 9)
        self.proc.wait()


# ---- children: one measured build each ------------------------------------------------------
def _cpu() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def child_tokenizer(work: str, base: str, tokenizer: str) -> dict:
    """A BPE trained on the 1x corpus, as a file every build loads."""
    from stoker.config import DataConfig, TokenizerConfig
    from stoker.data import prepare
    from stoker.storage.store import Store

    store = Store(os.path.join(work, "store-tokenizer"))
    ds = prepare.download_dataset(DataConfig(source=base, max_bytes=0), store)
    store.get_file(prepare.train_tokenizer(ds, TokenizerConfig(vocab_size=VOCAB), store).key, tokenizer)
    return {"tokenizer": tokenizer}


def child_prepare(root: str, options: str, corpus: str, tokenizer: str) -> dict:
    """The dataset and the tokenizer in the store."""
    from stoker.config import DataConfig, TokenizerConfig
    from stoker.data import prepare
    from stoker.storage.store import Store

    store = Store(root, json.loads(options))
    ds = prepare.download_dataset(DataConfig(source=corpus, max_bytes=0), store)
    tk = prepare.train_tokenizer(ds, TokenizerConfig(path=tokenizer, vocab_size=VOCAB), store)
    return {"dataset": dataclasses.asdict(ds), "tokenizer": dataclasses.asdict(tk)}


def child_build(root: str, options: str, prepared: str, engine: str, address: str) -> dict:
    """tokenize_and_shard into a store without shards, measured."""
    from stoker.config import DataConfig, RayConfig
    from stoker.contracts.results import DatasetInfo, TokenizerInfo
    from stoker.data import prepare
    from stoker.storage.store import Store

    store = Store(root, json.loads(options))
    store.rm("shards")
    info = json.loads(prepared)
    ds, tk = DatasetInfo(**info["dataset"]), TokenizerInfo(**info["tokenizer"])
    data = DataConfig(source="unused", max_bytes=0, num_workers=2, shard_tokens=SHARD_TOKENS, engine=engine)
    seen: dict = {}

    class Catch(logging.Handler):
        def emit(self, record):
            seen.update(
                nodes=getattr(record, "ray_nodes", seen.get("nodes")),
                task_cpu_s=getattr(record, "ray_task_cpu_s", seen.get("task_cpu_s")),
            )

    logging.getLogger("stoker.data").addHandler(Catch())
    logging.getLogger("stoker.data").setLevel(logging.INFO)
    cpu0, wall0 = _cpu(), time.perf_counter()
    shards = prepare.tokenize_and_shard(
        ds, tk, data, store, partition_bytes=PARTITION_BYTES, ray=RayConfig(address=address or None)
    )
    cpu, wall = _cpu() - cpu0, time.perf_counter() - wall0
    manifest = store.read_json(f"{shards.key}/manifest.json")
    docs = sum(manifest["num_docs"].values())
    return {
        "tokens": shards.num_train_tokens + shards.num_val_tokens - docs,
        "cpu_s": cpu,
        "wall_s": wall,
        "files": {n: e["sha256"] for n, e in manifest["files"].items()},
        "nodes": len(seen.get("nodes") or []),
        "task_cpu_s": seen.get("task_cpu_s"),
    }


CHILDREN = {"tokenizer": child_tokenizer, "prepare": child_prepare, "build": child_build}


def _run_child(kind: str, *args: str) -> dict:
    from benchmarks._child import run_child

    return run_child("benchmarks.bench_ray_data", [kind, *args], kind, RAY_USAGE_STATS_ENABLED="0")


# ---- the cluster's CPU ---------------------------------------------------------------------
class _ClusterCpu:
    """CPU seconds of every process in the cluster's namespaces while it runs: /proc sampled
    every 0.25 s, so a process that ends between samples loses at most its last 0.25 s."""

    def __init__(self, cluster):
        self.cluster, self.first, self.last = cluster, {}, {}
        self.stop_flag = threading.Event()

    def _sample(self) -> None:
        for node in range(len(self.cluster.nodes.addresses)):
            for pid in self.cluster.nodes.pids(node):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                used = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
                self.first.setdefault(pid, used if not self.started else 0.0)
                self.last[pid] = used

    def __enter__(self):
        self.started = False
        self._sample()
        self.started = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop_flag.wait(0.25):
            self._sample()

    def __exit__(self, *exc):
        self.stop_flag.set()
        self.thread.join()
        self._sample()
        self.cpu_s = sum(self.last[p] - self.first[p] for p in self.last)


# ---- main ----------------------------------------------------------------------------------
def _cluster(num_nodes: int):
    from tests.raycluster import RayCluster

    return RayCluster(num_nodes=num_nodes, cpus_per_node=1).up()


def _store_root(cluster, kind: str, work: str) -> tuple[str, dict, object]:
    if kind == "file":
        folder = os.path.join(work, f"store-{uuid.uuid4().hex[:6]}")
        return "file://" + folder, {}, None
    moto = _Moto(cluster.bridge_address)
    root, options = moto.bucket()
    return root, options, moto


def _ray_runs(cluster, root: str, options: dict, prepared: str, repeats: int, local: list | None) -> list[dict]:
    """`repeats` Ray builds on `cluster`, each with its cluster CPU; a local build after each
    when `local` is a list (interleaved: this machine is shared and noisy)."""
    runs = []
    for _ in range(repeats):
        with _ClusterCpu(cluster) as usage:
            run = _run_child("build", root, json.dumps(options), prepared, "ray", cluster.client_address)
        run["cluster_cpu_s"] = usage.cpu_s
        runs.append(run)
        if local is not None:
            local.append(_run_child("build", root, json.dumps(options), prepared, "local", ""))
    return runs


def _line(label: str, value: float, goal: str, met: bool) -> None:
    print(f"  {label:<66} {value:6.2f}  goal {goal:<7} {'MET' if met else 'NOT MET'}", flush=True)


def _report(mb: float, one: list[dict], two: list[dict], local: list[dict], store: str) -> None:
    files = {json.dumps(r["files"], sort_keys=True) for r in one + two + local}
    assert len(files) == 1, "the shard files differ between runs"
    tokens = local[0]["tokens"]
    assert all(r["tokens"] == tokens for r in one + two), "token counts differ"

    def whole(r):
        return r["cpu_s"] + r["cluster_cpu_s"]

    best_local = min(local, key=lambda r: r["cpu_s"])
    best_ray = min(two, key=whole)
    rate_local, rate_ray = tokens / best_local["cpu_s"], tokens / whole(best_ray)
    wall1, wall2 = min(r["wall_s"] for r in one), min(r["wall_s"] for r in two)
    print(
        f"  corpus {mb:.1f} MB, {tokens:,} tokens; store {store}; identical shard files in all "
        f"{len(one) + len(two) + len(local)} builds; best of {len(local)} each:"
    )
    print(
        f"  local engine    {rate_local / 1e6:.2f} M tok/CPU-s ({best_local['cpu_s']:.1f} CPU-s, "
        f"{best_local['wall_s']:.1f} s wall, num_workers=2)"
    )
    print(
        f"  ray, 2 nodes    {rate_ray / 1e6:.2f} M tok/CPU-s ({whole(best_ray):.1f} CPU-s: "
        f"{best_ray['cpu_s']:.1f} driver + {best_ray['cluster_cpu_s']:.1f} cluster, of which "
        f"{best_ray['task_cpu_s']:.1f} in tasks; {best_ray['wall_s']:.1f} s wall, "
        f"tasks on {best_ray['nodes']} node(s))"
    )
    print(f"  ray, 1 node     {wall1:.1f} s wall; 2 nodes {wall2:.1f} s wall")
    print(
        "  (every run, wall s: local "
        + ", ".join(f"{r['wall_s']:.1f}" for r in local)
        + "; ray 1 node "
        + ", ".join(f"{r['wall_s']:.1f}" for r in one)
        + "; ray 2 nodes "
        + ", ".join(f"{r['wall_s']:.1f}" for r in two)
        + ")"
    )
    r1, r2 = rate_ray / rate_local, wall1 / wall2
    in_tasks = tokens / best_ray["task_cpu_s"] / rate_local
    _line("tokens/CPU-s, ray engine (2 nodes, whole cluster) / local engine", r1, ">= 0.8", r1 >= 0.8)
    print(f"    (counting the tasks' own CPU only: {in_tasks:.2f})")
    _line("ray engine wall time, 1 node / 2 nodes (1 CPU each)", r2, ">= 1.4", r2 >= 1.4)


SMOKE_MB, SMOKE_BASE_BYTES = 0.3, 300_000


def main(argv: list[str] | None = None, cluster=None) -> None:
    """`cluster`: a two-node tests.raycluster.RayCluster already up, for a smoke run (both
    columns run on it; it is left up)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=40, help="corpus size in MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", choices=("s3", "file"), default="s3")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny corpus, one build each, one cluster: checks the benchmark runs"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    assert cluster is None or args.smoke, "a cluster is handed in for a smoke run only"
    base_bytes = 5_000_000
    if args.smoke:
        args.mb, args.repeats, base_bytes = SMOKE_MB, 1, SMOKE_BASE_BYTES
    from tests.raycluster import ray_unavailable

    why = ray_unavailable()
    if why:
        print(f"  skipped: {why}")
        return
    from benchmarks.bench_data import _scale_corpus, _write_corpus

    if args.store == "s3":  # before the nodes start: they take their credentials from their environment
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")

    with tempfile.TemporaryDirectory(prefix="stoker-bench-ray-data-", dir="/tmp") as work:
        base, corpus = os.path.join(work, "base.jsonl"), os.path.join(work, "corpus.jsonl")
        _write_corpus(base, base_bytes)
        _scale_corpus(base, corpus, max(1, round(args.mb / (os.path.getsize(base) / 1e6))))
        mb = os.path.getsize(corpus) / 1e6
        tokenizer = _run_child("tokenizer", work, base, os.path.join(work, "tokenizer.json"))["tokenizer"]
        print(
            f"corpus: Python stdlib sources as JSON lines, {mb:.1f} MB; partitions of "
            f"{PARTITION_BYTES >> 20} MiB; {os.cpu_count()} cores",
            flush=True,
        )
        results = {}
        shared = cluster if cluster is not None else _cluster(2) if args.smoke else None
        try:
            for nodes in (1, 2):
                on = shared if shared is not None else _cluster(nodes)
                moto = None
                try:
                    root, options, moto = _store_root(on, args.store, work)
                    prepared = json.dumps(_run_child("prepare", root, json.dumps(options), corpus, tokenizer))
                    local = [] if nodes == 2 else None
                    results[nodes] = _ray_runs(on, root, options, prepared, args.repeats, local)
                    if local is not None:
                        results["local"] = local
                finally:
                    if moto is not None:
                        moto.stop()
                    if shared is None:
                        on.down()
        finally:
            if shared is not None and cluster is None:
                shared.down()
    _report(mb, results[1], results[2], results["local"], args.store)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(CHILDREN[sys.argv[2]](*sys.argv[3:])))
    else:
        main()
