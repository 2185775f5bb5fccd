"""What Prefect costs: the whole train_pipeline flow (data on a cache hit, launch, N steps,
evaluation of the final checkpoint, report) against the same stages called as plain functions
and processes without Prefect, in one run, on one Prefect server started beforehand (as a
user's is). Rounds alternate ABBA (plain, flow, flow, plain) so drift hits both sides.

Goal: flow <= 1.05 x plain + 10 s. Prints the ratio of the medians and the fixed overhead in
seconds (flow - plain).
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
import uuid

from stoker.core.config import load_config

STEPS = 60


def _config(root: str, run: str):
    return load_config(
        {
            "run_name": run,
            "storage": {"root": root},
            "data": {"max_bytes": 300_000, "val_fraction": 0.1},
            "tokenizer": {"vocab_size": 384},
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
            "train": {
                "max_steps": STEPS,
                "warmup_steps": 5,
                "log_interval": 10,
                "global_batch_size": 8,
                "micro_batch_size": 4,
            },
            "checkpoint": {"interval_steps": STEPS},
            "eval": {"interval_steps": STEPS, "num_batches": 2, "per_checkpoint_enabled": False},
            "launch": {"max_attempts": 1},
        }
    )


def plain(root: str) -> float:
    """The flow's stages without Prefect: the same functions and processes, in order."""
    from stoker.data import prepare
    from stoker.launch.env import child_env
    from stoker.launch.gang import run_gang
    from stoker.launch.torchrun import free_port, torchrun_commands
    from stoker.storage.checkpoints import find_latest_valid, list_checkpoints
    from stoker.storage.runs import pin_run_folder
    from stoker.storage.store import Store
    from stoker.tasks.evaluate import run_evaluation

    t0 = time.perf_counter()
    cfg = _config(root, "plain-" + uuid.uuid4().hex[:6]).check()
    store = Store(cfg.storage.root)
    dataset = prepare.download_dataset(cfg.data, store)
    tok = prepare.train_tokenizer(dataset, cfg.tokenizer, store)
    shards = prepare.tokenize_and_shard(dataset, tok, cfg.data, store)
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


def flow(root: str) -> float:
    from stoker.flows.pipeline import train_pipeline

    t0 = time.perf_counter()
    result = train_pipeline(_config(root, "flow-" + uuid.uuid4().hex[:6]))
    assert result.final_step == STEPS and result.last_val_loss is not None
    return time.perf_counter() - t0


def main() -> None:
    from prefect.testing.utilities import prefect_test_harness

    logging.getLogger("prefect").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=120):
        root = f"file://{tmp}/store"
        flow(root)  # warm-up: the server's first flow run, the data built once for both sides
        times: dict[str, list[float]] = {"plain": [], "flow": []}
        for side in ("plain", "flow", "flow", "plain"):
            seconds = (plain if side == "plain" else flow)(root)
            times[side].append(seconds)
            print(f"  {side:5s} {seconds:6.1f} s", flush=True)
    p, f = statistics.median(times["plain"]), statistics.median(times["flow"])
    print(
        f"whole flow vs plain stages ({STEPS} steps, data cache hit, final evaluation): "
        f"{f:.1f} s vs {p:.1f} s -> ratio {f / p:.2f}, fixed overhead {f - p:+.1f} s "
        f"(goal: flow <= 1.05 x plain + 10 s: {'met' if f <= 1.05 * p + 10 else 'NOT met'})"
    )


if __name__ == "__main__":
    sys.exit(main())
