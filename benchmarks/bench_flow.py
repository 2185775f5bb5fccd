"""What Prefect costs: the whole train_pipeline flow (data on a cache hit, launch, N steps,
evaluation of the final checkpoint, report) against the same stages called as plain functions
and processes without Prefect, in one run, on one Prefect server started beforehand (as a
user's is). Rounds alternate ABBA (plain, flow, flow, plain) so drift hits both sides.

Goal: flow <= 1.05 x plain + 10 s. Prints the ratio of the medians and the fixed overhead in
seconds (flow - plain).

    python -m benchmarks.bench_flow [--smoke] [--on-current-server]

--smoke: 4 steps on one rank, one round of each side (plain, then flow) and no warm-up; it
checks that the benchmark runs, its figures mean nothing. --on-current-server: the Prefect
server this process is already set to (PREFECT_API_URL, or a test's harness) instead of a
harness of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
import uuid

from stoker.config import load_config

STEPS = 60
SMOKE_STEPS = 4


def _config(root: str, run: str, smoke: bool = False):
    steps = SMOKE_STEPS if smoke else STEPS
    one_rank = {"nproc_per_node": 1} if smoke else {}
    return load_config(
        {
            "run_name": run,
            "storage": {"root": root},
            "data": {"max_bytes": 300_000, "val_fraction": 0.1},
            "tokenizer": {"vocab_size": 384},
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
            "train": {
                "max_steps": steps,
                "warmup_steps": 1 if smoke else 5,
                "log_interval": 10,
                "global_batch_size": 8,
                "micro_batch_size": 4,
            },
            "checkpoint": {"interval_steps": steps},
            "eval": {"interval_steps": steps, "num_batches": 2, "per_checkpoint_enabled": False},
            "launch": {"max_attempts": 1, **one_rank},
        }
    )


def plain(root: str, smoke: bool = False) -> float:
    """The flow's stages without Prefect: the same functions and processes, in order."""
    from stoker.data import prepare
    from stoker.launch.env import child_env
    from stoker.launch.gang import run_gang
    from stoker.launch.torchrun import free_port, torchrun_commands
    from stoker.storage.checkpoints import find_latest_valid, list_checkpoints
    from stoker.storage.runs import pin_run_folder
    from stoker.storage.store import Store
    from stoker.tasks.evaluation import run_evaluation

    t0 = time.perf_counter()
    cfg = _config(root, "plain-" + uuid.uuid4().hex[:6], smoke).check()
    store = Store(cfg.storage.root)
    # the data stage as plain calls: a DataShards, as the flow's (pin_run_folder takes one)
    shards = prepare.prepare_all(cfg.data, cfg.tokenizer, store, run=cfg.resolved_run_name())
    config_url = pin_run_folder(store, cfg, shards)
    assert find_latest_valid(store, cfg.resolved_run_name()).checkpoint is None
    cmds = torchrun_commands(cfg, config_url, shards.key, None, free_port())
    gang = run_gang(
        cmds,
        child_env(cfg),
        cfg.launch.nproc_per_node,
        on_line=lambda line: None,
        on_event=lambda event: None,
        timeout=cfg.launch.timeout_seconds,
    )
    assert all(rc == 0 for rc in gang.returncodes), gang.tail[-20:]
    newest = list_checkpoints(store, cfg.resolved_run_name())[0]
    run_evaluation(cfg, config_url, newest.key, shards.key)
    return time.perf_counter() - t0


def flow(root: str, smoke: bool = False) -> float:
    from stoker.flows.pipeline import train_pipeline

    t0 = time.perf_counter()
    result = train_pipeline(_config(root, "flow-" + uuid.uuid4().hex[:6], smoke))
    assert result.final_step == (SMOKE_STEPS if smoke else STEPS) and result.last_val_loss is not None
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few steps, one round: checks the benchmark runs")
    p.add_argument(
        "--on-current-server", action="store_true", help="the Prefect server already set, not a harness of its own"
    )
    args = p.parse_args(argv)
    steps = SMOKE_STEPS if args.smoke else STEPS  # for the report

    from prefect.testing.utilities import prefect_test_harness

    logging.getLogger("prefect").setLevel(logging.WARNING)
    server = contextlib.nullcontext() if args.on_current_server else prefect_test_harness(server_startup_timeout=120)
    with tempfile.TemporaryDirectory() as tmp, server:
        root = f"file://{tmp}/store"
        if not args.smoke:
            flow(root)  # warm-up: the server's first flow run, the data built once for both sides
        times: dict[str, list[float]] = {"plain": [], "flow": []}
        for side in ("plain", "flow") if args.smoke else ("plain", "flow", "flow", "plain"):
            seconds = (plain if side == "plain" else flow)(root, args.smoke)
            times[side].append(seconds)
            print(f"  {side:5s} {seconds:6.1f} s", flush=True)
    p, f = statistics.median(times["plain"]), statistics.median(times["flow"])
    print(
        f"whole flow vs plain stages ({steps} steps, data cache hit, final evaluation): "
        f"{f:.1f} s vs {p:.1f} s -> ratio {f / p:.2f}, fixed overhead {f - p:+.1f} s "
        f"(goal: flow <= 1.05 x plain + 10 s: {'met' if f <= 1.05 * p + 10 else 'NOT met'})"
    )


if __name__ == "__main__":
    sys.exit(main())
