"""The goodput ledger's cost against the training it accounts for: a run's report reads its
metrics.jsonl and attempts.jsonl and computes the ledger (observe.ledger) once per flow run.

A synthetic run of --steps steps is written to a local store as the ranks and the launcher
would: one Train record per step (log_interval 1, the most records a run can have), an
evaluation and a checkpoint every 1000 steps, two launches with a restart and lost work in
the middle. The ledger of it (read_records + compute_ledger, as tasks/report.py does) is
timed, median of --repeats. The baseline, measured in the same run: one optimizer step of the
tiny-cpu recipe's model on this CPU (one rank's share of the global batch).

Prints RATIO ledger / training = ledger seconds / (steps x step seconds); goal <= 0.01.

    python -m benchmarks.bench_ledger [--steps 100000 --repeats 5] [--smoke]

--smoke: a run of 2,000 steps (a restart and lost work in it), one repeat, one timed training
step; it checks that the benchmark runs, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time


def _synthetic_run(num_steps: int, step_seconds: float = 0.05) -> tuple[list[str], list[dict]]:
    """(metrics.jsonl lines, attempts) of a run killed at 60% and resumed from its last commit."""
    lines, t = [], 1_000_000.0
    crash = int(num_steps * 0.6) + 500  # 500 steps past its last commit
    resume = crash // 1000 * 1000
    attempts = [{"flow_run_id": "f", "attempt": 1, "started_at": t, "resumed_from_step": 0}]
    t += 10
    lines.append(json.dumps({"event": "eval", "step": 0, "time": t, "seconds": 2.0, "val_loss": 7.0, "val_ppl": 1e3}))

    def run(first: int, last: int, t: float) -> float:
        for step in range(first + 1, last + 1):
            since, ev, ck = t, 0.0, 0.0
            if (step - 1) % 1000 == 0 and step > 1:  # the evaluation and checkpoint of step - 1
                ev, ck = 1.0, 0.3
            t += step_seconds + ev
            train = {
                "event": "train",
                "step": step,
                "loss": 3.0,
                "lr": 1e-3,
                "step_seconds": step_seconds + ck,
                "tokens_seen": 2048 * step,
                "tokens_per_second": 40000.0,
                "data_wait_share": 0.02,
                "time": t,
                "since": since,
                "since_step": step - 1,
                "eval_seconds": ev,
                "checkpoint_seconds": ck,
            }
            lines.append(json.dumps(train, sort_keys=True))
            if step % 1000 == 0:
                lines.append(json.dumps({"event": "eval", "step": step, "time": t + 1, "val_loss": 3.0, "seconds": 1}))
                lines.append(json.dumps({"event": "checkpoint_staged", "step": step, "time": t + 1.2, "seconds": 0.2}))
        return t

    t = run(0, crash, t)
    attempts[0].update(ended_at=t + 5, reached_step=crash, committed_step=resume, outcome="lost-rank")
    t += 10
    attempts.append({"flow_run_id": "f", "attempt": 2, "started_at": t, "resumed_from_step": resume})
    t += 5
    lines.append(json.dumps({"event": "resumed", "step": resume, "time": t, "checkpoint": "c"}))
    t = run(resume, num_steps, t)
    lines.append(json.dumps({"event": "done", "step": num_steps, "time": t + 1, "since": t, "since_step": num_steps}))
    attempts[1].update(ended_at=t + 3, reached_step=num_steps, committed_step=num_steps, outcome="completed")
    return lines, attempts


def _step_seconds(repeats: int = 10) -> float:
    """One optimizer step of the tiny-cpu recipe's model, one rank's share (median), on the
    threads a rank gets (training.distributed: the cores over the ranks of a node)."""
    import os

    import torch

    from stoker.config import load_config
    from stoker.families.gpt2.model import GPT

    cfg = load_config("tiny-cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.launch.nproc_per_node))
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.tokenizer.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro, accum = cfg.train.micro_batch_size, cfg.grad_accum_steps
    x = torch.randint(0, cfg.tokenizer.vocab_size, (micro, cfg.model.block_size))
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        for _ in range(accum):
            _, loss = model(x, x)
            (loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # warm-up steps left out
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="steps of the synthetic run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a short run, one repeat: checks the benchmark runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats = 2000, 1

    from stoker.observe.ledger import FlowTimes, compute_ledger, read_records
    from stoker.storage.store import Store

    work = tempfile.mkdtemp(prefix="stoker-bench-ledger-")
    try:
        store = Store("file://" + work)
        lines, attempts = _synthetic_run(args.steps)
        store.write_bytes("runs/bench/metrics.jsonl", ("\n".join(lines) + "\n").encode())
        size_mb = store.size("runs/bench/metrics.jsonl") / 2**20
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ledger = compute_ledger(
                read_records(store, "bench"),
                attempts,
                FlowTimes(start=attempts[0]["started_at"] - 30, end=attempts[1]["ended_at"] + 5),
                accelerators=2,
                price_per_accelerator_hour=2.0,
            )
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        attributed = ledger["wall_seconds"] - ledger["seconds"]["unattributed"]
        assert abs(attributed - ledger["wall_seconds"]) < 1e-3 * ledger["wall_seconds"], ledger
        step = _step_seconds(1 if args.smoke else 10)
        print(
            f"  ledger of {args.steps} steps ({len(lines)} records, {size_mb:.1f} MiB metrics.jsonl): "
            f"{seconds:.3f} s (median of {args.repeats}); goodput {ledger['goodput']:.3f}, "
            f"{ledger['lost_steps']} steps lost"
        )
        print(f"  one step of the tiny-cpu recipe's model (one rank, this CPU): {1000 * step:.1f} ms")
        ratio = seconds / (args.steps * step)
        print(
            f"  RATIO ledger / training = {ratio:.2e}  ({1e6 * seconds / args.steps:.1f} us per step "
            f"against {1000 * step:.1f} ms; goal <= 0.01: {'met' if ratio <= 0.01 else 'NOT met'})"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
