"""What a user runs, timed: ``torchrun --nproc-per-node=1 -m stoker.training.train`` of the
``gpt2-124m-1gpu`` recipe (its process group, its per-step events, its log-step syncs, its
checkpoint), with throughput read from the run's own event stream. Used by bench_gpu.

Steady state: the Train events after ``warmup`` steps (the compile and the first steps are
left out); their tokens/s is the interval's (wall time, evaluation excluded), the median is
reported, and the wall-clock rate over all steady steps beside it.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time

from stoker.config import load_config
from stoker.contracts import events
from stoker.launch.torchrun import AGENT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "gpt2-124m-1gpu"


def parse_variant(spec: str) -> dict:
    """'ddp:none', 'fsdp:selective', 'ddp:none:ce4096' -> engine settings (parallelism,
    activation checkpointing, optionally the chunked cross-entropy of N tokens a chunk)."""
    parallelism, ac, *extra = spec.split(":")
    engine = {"parallelism": parallelism, "activation_checkpointing": ac}
    for e in extra:
        if not e.startswith("ce"):
            raise SystemExit(f"real-run variant {spec!r}: unknown part {e!r} (want ce<tokens>)")
        engine.update(cross_entropy="chunked", cross_entropy_chunk=int(e[2:]))
    return engine


def run_config(
    store_root: str, name: str, micro: int, steps: int, smoke: dict | None, global_batch: int | None = None, **engine
):
    """The recipe as a user runs it, shortened to `steps` steps; only the first evaluation is
    made small (it runs before the first step and is not timed)."""
    over = {
        "storage.root": store_root,
        "run_name": name,
        "train.micro_batch_size": micro,
        "train.max_steps": steps,
        "train.warmup_steps": 1,
        "eval.num_batches": 2,
        "eval.per_checkpoint_enabled": False,
    }
    if global_batch:
        over["train.global_batch_size"] = global_batch
    over.update({f"engine.{k}": v for k, v in engine.items()})
    if smoke is not None:  # a tiny model on CPU ranks (gloo)
        over.update(smoke)
        over.update(
            {"launch.backend": "gloo", "train.log_interval": 2, "train.global_batch_size": global_batch or micro * 2}
        )
    return load_config(RECIPE, **over)


def _launch(config_url: str, shard_key: str, cache_dir: str, timeout: float) -> tuple[list, float | None, str]:
    """torchrun one rank; (events, seconds to the first finished step, the output's tail)."""
    cmd = [
        *AGENT,
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=1",
        "-m",
        "stoker.training.train",
        "--config",
        config_url,
        "--shards",
        shard_key,
        "--cache-dir",
        cache_dir,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    }
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: the side groups' gloo on loopback
    t0 = time.monotonic()
    first_step, seen, tail = None, [], []
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    # a run that hangs prints nothing: a timer ends it (its whole process group)
    watchdog = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in proc.stdout:
            event = events.decode(line)
            if event is None:
                tail = (tail + [line.rstrip()])[-40:]
                continue
            seen.append(event)
            if isinstance(event, events.Step) and first_step is None:
                first_step = time.monotonic() - t0
        proc.wait()
    finally:
        watchdog.cancel()
    if time.monotonic() - t0 >= timeout:
        raise SystemExit(f"real run passed its {timeout:.0f} s limit:\n" + "\n".join(tail))
    if proc.returncode != 0:
        raise SystemExit(f"real run failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return seen, first_step, "\n".join(tail)


def steady_state(seen: list, warmup: int, tokens_per_step: int) -> dict:
    """Throughput after `warmup` steps, from the run's Train events."""
    train = [e for e in seen if isinstance(e, events.Train)]
    steady = [e for e in train if e.step > warmup and e.tokens_per_second]
    if len(steady) < 2:
        raise SystemExit(
            f"real run: {len(steady)} log steps after step {warmup}; give more "
            "--real-steps (at least two log intervals past the warm-up)"
        )
    first = max((e for e in train if e.step <= warmup), key=lambda e: e.step, default=steady[0])
    span = steady[-1].time - first.time
    out = {
        "tokens_per_second": round(statistics.median(e.tokens_per_second for e in steady)),
        "wall_tokens_per_second": round((steady[-1].step - first.step) * tokens_per_step / span) if span > 0 else None,
        "step_seconds": round(statistics.median(e.step_seconds for e in steady), 4),
        "log_steps": [e.step for e in steady],
    }
    mfus = [e.mfu for e in steady if e.mfu is not None]
    out["mfu"] = round(statistics.median(mfus), 4) if mfus else None
    memory = [e.peak_memory_gb for e in steady if e.peak_memory_gb is not None]
    out["peak_memory_gb"] = max(memory) if memory else None
    return out


def model_facts(cfg, vocab_size: int) -> dict:
    """Parameter count (tied output matrix once, no position embeddings) and vocabulary."""
    import torch

    from stoker.families.gpt2.model import GPT
    from stoker.families.layers import padded_vocab

    with torch.device("meta"):
        model = GPT(cfg.model, vocab_size, seed=None)
    return {
        "model_params": model.num_params(),
        "vocab_size": vocab_size,
        "padded_vocab": padded_vocab(vocab_size, cfg.model.vocab_pad_multiple),
    }


def real_run(
    store,
    shard_key: str,
    micro: int,
    *,
    steps: int,
    warmup: int,
    smoke: dict | None,
    global_batch: int | None = None,
    variant: str = "ddp:none",
    timeout: float = 540,
) -> dict:
    """One real 1-rank run of the recipe with the variant's engine settings: its steady-state
    throughput, the time to its first step, and what it ran (model size, vocabulary, batch)."""
    from stoker.storage.layout import CONFIG_FILE, run_file_key
    from stoker.training.data import TokenStream

    name = "bench-gpu-real-" + "".join(c if c.isalnum() else "-" for c in variant)
    cfg = run_config(store.root, name, micro, steps, smoke, global_batch, **parse_variant(variant))
    key = run_file_key(name, CONFIG_FILE)
    store.write_bytes(key, cfg.to_json().encode())
    with tempfile.TemporaryDirectory(prefix="stoker-real-run-") as cache_dir:
        seen, first_step, _ = _launch(store.url(key), shard_key, cache_dir, timeout)
        from stoker.storage.shards import materialize

        vocab = TokenStream(materialize(store, shard_key, cache_dir), "train").vocab_size
    tokens = cfg.train.global_batch_size * cfg.model.block_size
    out = {
        "variant": variant,
        "recipe": RECIPE,
        "micro_batch": micro,
        "global_batch": cfg.train.global_batch_size,
        "tokens_per_step": tokens,
        "steps": steps,
        "warmup_steps": warmup,
        **model_facts(cfg, vocab),
        "seconds_to_first_step": None if first_step is None else round(first_step, 1),
        **steady_state(seen, warmup, tokens),
    }
    print(
        f"  real run {variant} (torchrun, {RECIPE}, micro-batch {micro}, {out['global_batch']} "
        f"sequences a step): {out['tokens_per_second']:,} tok/s steady "
        f"(wall {out['wall_tokens_per_second'] or 0:,}), step {out['step_seconds']} s, MFU "
        f"{100 * (out['mfu'] or 0):.1f}%, first step after {out['seconds_to_first_step']} s",
        flush=True,
    )
    return out


def compare_variants(rows: list[dict]) -> dict:
    """Step time of each variant over DDP without checkpointing (goals: FSDP2 <= 1.15x DDP,
    selective <= 1.12x none) and the chunked loss's cost over the standard one."""
    by = {r["variant"]: r["step_seconds"] for r in rows}
    base = by.get("ddp:none")
    out = {v: round(s / base, 3) for v, s in by.items()} if base else {}
    for v, ratio in out.items():
        print(f"  step time {v} / ddp:none = {ratio:.3f}", flush=True)
    return out
