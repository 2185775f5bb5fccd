"""What the run's Prefect events cost per training step, against the step time of the tiny-cpu
recipe's model measured in the same run.

    python -m benchmarks.bench_events [--smoke] [--on-current-server]

Measured, on a real Prefect server (``prefect_test_harness``'s, a subprocess):
- the stream loop's share: feeding one ``Step`` record to the launch's event sink
  (``orchestration.prefect_events.LaunchEvents.sink``), which most of the time only checks the rate bound;
- one event's whole cost in the launching process: the process CPU time (every thread: the
  sender thread, ``prefect.events.emit_event``, Prefect's EventsWorker serializing and sending
  it over its websocket) of N events, until Prefect's worker queue is empty, over N;
- the baseline: the CPU time of a training step of the tiny-cpu recipe's model, on a rank's
  threads (grad_accum_steps forward/backward passes of micro_batch_size sequences, then AdamW),
  the median of STEPS. CPU time on both sides: a loaded machine stretches wall time, not work.

Per step: the sink call + one heartbeat's cost x (step time / events.step_interval_seconds,
at most 1) + one checkpoint event's cost / checkpoint.interval_steps. Printed as a ratio to the
step time for the default interval, the smallest one allowed (1 s), and a heartbeat at every
step (no bound), for reference. Goal: <= 1% of the step time at the default.

--smoke: one timed training step, a thousand sink calls, five events of each kind; it checks
that the benchmark runs, its figures mean nothing. --on-current-server: the Prefect server this
process is already set to (PREFECT_API_URL, or a test's harness) instead of a harness of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time

STEPS = 10  # timed training steps (after 3 warm-up steps)
EVENTS = 200  # events whose cost is measured (within the sender queue, MAX_PENDING)
SINK_CALLS = 200_000


def step_seconds(cfg, steps: int = STEPS) -> float:
    """Median CPU seconds of one optimizer step of the recipe's model, on the threads a rank of
    the recipe gets (the CPUs over nproc_per_node, as training.distributed sets them). CPU time,
    like the events' side: a loaded machine stretches wall time, not the work done."""
    import os

    import torch

    from stoker.families.gpt2.model import GPT

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.launch.nproc_per_node))

    vocab = cfg.tokenizer.vocab_size
    model = GPT(cfg.model, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    micro, block = cfg.train.micro_batch_size, cfg.model.block_size
    x = torch.randint(0, vocab, (micro, block))  # (B, T)
    times = []
    for i in range(steps + 3):
        t0 = time.process_time()
        for _ in range(cfg.grad_accum_steps):
            _, loss = model(x, x)
            (loss / cfg.grad_accum_steps).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.process_time() - t0)
    return statistics.median(times)


def _launch_events(cfg, root: str, interval: float):
    from stoker.orchestration.prefect_events import LaunchEvents
    from stoker.storage.store import Store

    cfg = cfg.model_copy(update={"events": cfg.events.model_copy(update={"step_interval_seconds": interval})})
    return LaunchEvents(cfg, 1, Store(root), logging.getLogger("bench"))


def sink_seconds(cfg, root: str, calls: int = SINK_CALLS) -> float:
    """One Step record through the sink, rate-bounded (almost never an event)."""
    from stoker.contracts import events

    launch = _launch_events(cfg, root, cfg.events.step_interval_seconds)
    records = [events.Step(step=i) for i in range(1000)]
    t0 = time.perf_counter()
    for i in range(calls):
        launch.sink(records[i % 1000])
    took = (time.perf_counter() - t0) / calls
    launch.ended(None)
    return took


def event_cpu_seconds(cfg, root: str, what: str, count: int = EVENTS) -> float:
    """Process CPU seconds (all threads) per event sent to the server: heartbeats, or committed
    checkpoints (each also reads and hashes a commit manifest from the store)."""
    from prefect.events.worker import EventsWorker

    from stoker.contracts import events
    from stoker.storage.store import Store

    store = Store(root)
    key = "runs/bench/checkpoints/step-00000100"
    store.write_json(
        f"{key}/commit.json", {"files": {f"__{i}_0.distcp": {"size": 1, "sha256": "0" * 64} for i in range(8)}}
    )
    launch = _launch_events(cfg, root, 0.0)  # no rate bound: one event per record
    launch.sink(events.Step(step=0))  # the first one starts Prefect's worker: not timed
    launch.sender.close(30)
    EventsWorker.instance().wait_until_empty()
    launch = _launch_events(cfg, root, 0.0)
    if what == "checkpoint":
        record = events.CheckpointCommitted(
            step=100, key=key, uri=store.url(key), bytes=1, stage_seconds=0, upload_seconds=0, commit_seconds=0
        )
        records = [record] * count
    else:
        records = [events.Step(step=i) for i in range(count)]
    c0 = time.process_time()
    for r in records:
        launch.sink(r)
    assert launch.sender.close(120), "events not handed over"
    EventsWorker.instance().wait_until_empty()
    cpu = (time.process_time() - c0) / count
    assert launch.sender.failures == 0 and launch.sender.dropped == 0
    return cpu


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few steps, calls and events: checks the benchmark runs")
    p.add_argument(
        "--on-current-server", action="store_true", help="the Prefect server already set, not a harness of its own"
    )
    args = p.parse_args(argv)
    steps, calls, count = (1, 1000, 5) if args.smoke else (STEPS, SINK_CALLS, EVENTS)

    from prefect.testing.utilities import prefect_test_harness

    import stoker.flows  # noqa: F401  (Prefect's settings as stoker sets them: no telemetry)
    from stoker.config import load_config

    logging.getLogger("prefect").setLevel(logging.WARNING)
    cfg = load_config("tiny-cpu")
    t0 = time.perf_counter()
    step = step_seconds(cfg, steps)
    print(f"  (step time measured in {time.perf_counter() - t0:.0f} s)", flush=True)
    server = contextlib.nullcontext() if args.on_current_server else prefect_test_harness(server_startup_timeout=120)
    with tempfile.TemporaryDirectory() as tmp, server:
        root = f"file://{tmp}/store"
        sink = sink_seconds(cfg, root, calls)
        beat = event_cpu_seconds(cfg, root, "step", count)
        ckpt = event_cpu_seconds(cfg, root, "checkpoint", count)
    print(
        f"tiny-cpu step {1000 * step:.1f} ms CPU; sink call {1e9 * sink:.0f} ns; one heartbeat "
        f"{1e6 * beat:.0f} us CPU; one checkpoint event {1e6 * ckpt:.0f} us CPU"
    )
    per_ckpt = ckpt / cfg.checkpoint.interval_steps
    for label, interval in (
        (f"default step_interval_seconds={cfg.events.step_interval_seconds:g}", cfg.events.step_interval_seconds),
        ("step_interval_seconds=1 (the least allowed)", 1.0),
        ("a heartbeat every step (no bound)", 0.0),
    ):
        beats_per_step = 1.0 if interval <= 0 else min(1.0, step / interval)
        cost = sink + beat * beats_per_step + per_ckpt
        ratio = cost / step
        print(
            f"RATIO event cost / step time, {label}: {100 * ratio:.3f}% "
            f"({1e6 * cost:.1f} us per {1000 * step:.1f} ms step; goal <= 1%: {'met' if ratio <= 0.01 else 'NOT met'})"
        )


if __name__ == "__main__":
    sys.exit(main())
