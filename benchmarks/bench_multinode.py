"""Training tokens/s at one world size (2 ranks), launched three ways:

- 1x2: one torchrun agent on this host with 2 ranks (gloo over loopback): the baseline;
- 2x1: two torchrun agents with 1 rank each, each in a network namespace of its own
  (tests.netutil.NetnsNodes), placed by launch.nodes and launch.rdzv_port through
  launch.make_launcher, as the flow does: rendezvous and gloo cross veth interfaces and a bridge;
- 2x1-here: the same two agents both on this host over loopback (launch.num_nodes 2, no
  launch.nodes): what the veth hop costs apart from the rank layout;
- ray: launch.launcher 'ray', 2 workers on a two-node Ray cluster (tests.raycluster.RayCluster,
  one CPU per node), reached by Ray Client at ray.address.

Same model, config and shard set (a file:// store every namespace reads); only launch and ray
differ. Tokens/s comes from rank 0's own train events (each gives the seconds per step over its
log interval, measured in the rank) for the steps after --warmup: start-up, the step-0 and final
evaluations and the final checkpoint are not in it. The columns run in turn, --rounds times;
each prints its median and its ratio to the 1x2 baseline of the same run.

Simulated nodes share this host's cores. Left to itself a rank takes cpu_count / ranks of its
agent threads (training.distributed): the launcher corrects that for agents it knows share this host
(2x1-here), but an agent behind a prefix (2x1's `ip netns exec`) is another machine to it, so
its rank would take both cores: 4 threads on 2 cores, which measures oversubscription rather
than the launch (0.09 of 1x2 when measured so). So every rank gets --threads (STOKER_CPU_THREADS,
default 1; a Ray worker takes ray.cpus_per_worker, 1 here); --threads 0 leaves the choice to the
launcher and the ranks. Needs root and iproute2 for the namespaces and Ray for the Ray column; a
column that cannot run says why.

    python -m benchmarks.bench_multinode [--rounds 2] [--steps 35] [--warmup 10] [--threads 1] [--smoke]

--smoke: a 300 KB corpus, a 2-layer model of width 32, 3 steps logged one by one, the first
left out, one round (with --columns, the columns it names: 1x2 is always one); it checks that
the benchmark runs, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

BLOCK, GLOBAL_BATCH, LOG_INTERVAL = 128, 16, 5
# --smoke: what it changes in the config, and its steps, warm-up steps and rounds
SMOKE = {
    "data": {"max_bytes": 300_000},
    "tokenizer": {"vocab_size": 384},
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    "train": {"warmup_steps": 1, "log_interval": 1, "global_batch_size": 8},
}
SMOKE_STEPS, SMOKE_WARMUP, SMOKE_ROUNDS = 3, 1, 1


def _config(root: str, run: str, steps: int, launch: dict | None = None, ray: dict | None = None, smoke: bool = False):
    from stoker.config import load_config

    sections = {
        "run_name": run,
        "storage": {"root": root},
        "data": {"max_bytes": 2_000_000},
        "tokenizer": {"vocab_size": 2048},
        "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": BLOCK},
        "train": {
            "max_steps": steps,
            "warmup_steps": 2,
            "log_interval": LOG_INTERVAL,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": 4,
        },
        "checkpoint": {"interval_steps": 100_000},  # the last step's only, after the measured ones
        "eval": {"interval_steps": 100_000, "num_batches": 1, "per_checkpoint_enabled": False},
        "launch": {
            "timeout_seconds": 900,
            "max_attempts": 1,
            "max_restarts": 0,
            "hang_timeout_seconds": 300,
            **(launch or {}),
        },
        "ray": ray or {},
    }
    for section, values in (SMOKE if smoke else {}).items():
        sections[section] = {**sections[section], **values}
    return load_config(sections)


def _measure(cfg, store, shard_key: str, warmup: int) -> tuple[float, float, int]:
    """Launch one run with launch.make_launcher: (tokens/s after warm-up, start-up seconds to
    rank 0's first train event, steps measured)."""
    from stoker.contracts import events
    from stoker.launch import make_launcher

    run = cfg.resolved_run_name()
    store.write_bytes(f"runs/{run}/config.json", cfg.to_json().encode())
    launcher = make_launcher(cfg, store.url(f"runs/{run}/config.json"), shard_key, None)
    trains: dict[int, events.Train] = {}
    first: list[float] = []
    t0 = time.perf_counter()

    def on_event(e: events.Event) -> None:
        if isinstance(e, events.Train):
            trains[e.step] = e  # rank 0's; a step logged twice counts once
            if not first:
                first.append(time.perf_counter() - t0)

    result = launcher.run(lambda line: None, on_event)
    if result.reason != "completed":
        said = [line for line in result.tail if "STOKER_METRIC" not in line]  # the rest is steps
        raise RuntimeError(f"{run} ended {result.reason}:\n" + "\n".join(said[-20:]))
    steps = tokens = seconds = 0.0
    previous = 0
    for step in sorted(trains):
        n = step - previous  # each train event covers the steps since the previous log step
        if previous >= warmup:
            steps, tokens = steps + n, tokens + n * cfg.train.global_batch_size * cfg.model.block_size
            seconds += n * trains[step].step_seconds
        previous = step
    return tokens / seconds, first[0], int(steps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=35)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the measure")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank; 0: the ranks' choice")
    p.add_argument("--columns", default="1x2,2x1,2x1-here,ray", help="which, comma-separated")
    p.add_argument(
        "--smoke", action="store_true", help="a tiny model, a few steps, one round: checks the benchmark runs"
    )
    args = p.parse_args(argv if argv is not None else sys.argv[1:])
    if args.smoke:
        args.steps, args.warmup, args.rounds = SMOKE_STEPS, SMOKE_WARMUP, SMOKE_ROUNDS

    from stoker.data import prepare
    from stoker.storage.store import Store
    from tests.netutil import NetnsNodes

    work = tempfile.mkdtemp(prefix="stoker-bench-multinode-")
    os.environ["STOKER_CACHE"] = os.path.join(work, "cache-host")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.threads:
        os.environ["STOKER_CPU_THREADS"] = str(args.threads)  # inherited by every torchrun rank
    root = "file://" + os.path.join(work, "store")
    store = Store(root)
    base = _config(root, "base", args.steps, smoke=args.smoke)
    dataset = prepare.download_dataset(base.data, store)
    tokenizer = prepare.train_tokenizer(dataset, base.tokenizer, store)
    shards = prepare.tokenize_and_shard(dataset, tokenizer, base.data, store)

    wanted = args.columns.split(",")
    columns: dict[str, object] = {
        "1x2": lambda run: _config(
            root, run, args.steps, launch={"num_nodes": 1, "nproc_per_node": 2}, smoke=args.smoke
        )
    }
    why_not: dict[str, str] = {}
    netns = ray_cluster = None
    try:
        why = NetnsNodes.unavailable()
        if "2x1" not in wanted:
            pass
        elif why is None:
            netns = NetnsNodes(2).up()
            ports = iter(range(29500, 29600))  # fresh namespaces: every port is free there
            nodes = [
                {
                    "prefix": list(netns.exec_prefix(i)),
                    "address": netns.addresses[i],
                    "env": {
                        "GLOO_SOCKET_IFNAME": netns.ifnames[i],
                        "STOKER_CACHE": os.path.join(work, f"cache-node-{i}"),
                    },
                }
                for i in range(2)
            ]
            columns["2x1"] = lambda run: _config(
                root,
                run,
                args.steps,
                launch={
                    "num_nodes": 2,
                    "nproc_per_node": 1,
                    "nodes": nodes,
                    "rdzv_host": netns.addresses[0],
                    "rdzv_port": next(ports),
                },
                smoke=args.smoke,
            )
        else:
            why_not["2x1"] = why
        columns["2x1-here"] = lambda run: _config(
            root, run, args.steps, launch={"num_nodes": 2, "nproc_per_node": 1}, smoke=args.smoke
        )
        ray_cluster, why = _ray_cluster(work) if "ray" in wanted else (None, "not asked for")
        if ray_cluster is not None:
            columns["ray"] = lambda run: _config(
                root,
                run,
                args.steps,
                launch={"launcher": "ray", "num_nodes": 2, "nproc_per_node": 1},
                ray={"address": ray_cluster.client_address, "cpus_per_worker": 1},
                smoke=args.smoke,
            )
        else:
            why_not["ray"] = why

        columns = {name: make for name, make in columns.items() if name in wanted or name == "1x2"}
        measured: dict[str, list[tuple[float, float, int]]] = {name: [] for name in columns}
        for rnd in range(args.rounds):
            for name, make in list(columns.items()):
                try:
                    measured[name].append(_measure(make(f"bench-mn-{name}-{rnd}"), store, shards.key, args.warmup))
                except Exception as err:  # a round that fails is reported, not fatal
                    why_not[name] = f"round {rnd + 1}: {type(err).__name__}: {err}"[-2500:]
        model, train = base.model, base.train
        accum = train.global_batch_size // (2 * train.micro_batch_size)
        print(
            f"  model {model.n_layer} x {model.n_embd}, block {model.block_size}, global batch "
            f"{train.global_batch_size} (2 ranks x micro {train.micro_batch_size} x accum {accum}), {args.steps} steps, tokens/s over steps {args.warmup + 1}-{args.steps}; "
            f"{os.cpu_count()} cores; {args.threads or 'default'} thread(s) per rank; medians of {args.rounds}"
        )
        baseline = statistics.median(t for t, _, _ in measured["1x2"]) if measured.get("1x2") else None
        for name in [n for n in ("1x2", "2x1", "2x1-here", "ray") if n in wanted or n == "1x2"]:
            if not measured.get(name):
                print(f"  {name}: not measured: {why_not.get(name, 'skipped')}")
                continue
            if name in why_not:
                print(f"  {name}: a round failed ({why_not[name]})")
            tps = statistics.median(t for t, _, _ in measured[name])
            start = statistics.median(s for _, s, _ in measured[name])
            each = ", ".join(f"{t:.0f}" for t, _, _ in measured[name])
            print(f"  {name}: {tps:.0f} tokens/s (rounds: {each}); launch to first step {start:.1f}s")
            if baseline and name != "1x2":
                print(f"  RATIO {name} / 1x2 tokens/s = {tps / baseline:.2f}")
    finally:
        if ray_cluster is not None:
            ray_cluster.down()
        if netns is not None:
            netns.down()
        shutil.rmtree(work, ignore_errors=True)


def _ray_cluster(work: str):
    """(a two-node Ray cluster, None) or (None, why there is none)."""
    try:
        from stoker.launch.ray import RayLauncher  # noqa: F401  (the launcher behind launch.launcher 'ray')
    except ImportError as err:
        return None, f"ray launcher not available ({err})"
    from tests.raycluster import RayCluster, ray_unavailable

    why = ray_unavailable()
    if why:
        return None, why
    cluster = RayCluster(num_nodes=2, cpus_per_node=1)
    try:
        return cluster.up(), None
    except Exception:  # up() took down what it made
        return None, "the Ray cluster did not start:\n" + traceback.format_exc(limit=2)[-1500:]


if __name__ == "__main__":
    main()
