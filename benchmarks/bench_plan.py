"""The plan's memory estimate (stoker.arithmetic.plan) against what a step really allocates.

On a GPU: GPT-2 124M and the Llama-3.2-1B shape (random weights, bf16 autocast, eager), a few
optimizer steps of two accumulated micro-batches, against torch.cuda.max_memory_allocated
(goal: within 10%). On CPU (--smoke, or no GPU): the tiny models against torch's memory
tracker (MemTracker). Prints one line per case and the RATIO plan/measured.

    python -m benchmarks.bench_plan            # a GPU: GPT-2 124M and a Llama-1B shape
    python -m benchmarks.bench_plan --smoke    # CPU: the tiny shapes (checks the benchmark)
    python -m benchmarks.bench_plan --smoke --every-mode   # CPU: 12 cases, RESULTS' table
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from stoker.arithmetic import plan as plans
from stoker.config import RunConfig
from stoker.training.engine import Engine, build_model, build_optimizer

GPT2_124M = {"family": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
LLAMA_1B = {
    "family": "llama",
    "n_layer": 16,
    "n_head": 32,
    "n_kv_head": 8,
    "n_embd": 2048,
    "intermediate_size": 8192,
    "head_dim": 64,
    "vocab_size": 128256,
    "block_size": 2048,
    "tie_embeddings": True,
}
TINY = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}


def _config(model: dict, micro: int, checkpointing: str, cross_entropy: str, cuda: bool) -> RunConfig:
    return RunConfig(
        model=model,
        tokenizer={"vocab_size": 50257 if model["family"] == "gpt2" and cuda else 2048},
        train={"global_batch_size": 2 * micro, "micro_batch_size": micro},
        launch={"nproc_per_node": 1},
        engine={
            "activation_checkpointing": checkpointing,
            "cross_entropy": cross_entropy,
            "compile": "off",
            "cross_entropy_chunk": 4096 if cuda else 128,
        },
    )


def measure(cfg: RunConfig, device: torch.device, steps: int = 2) -> int:
    """The peak bytes of `steps` optimizer steps of two micro-batches."""
    torch.manual_seed(0)
    engine = Engine.resolve(cfg, device)
    vocab = cfg.tokenizer.vocab_size
    raw, model = build_model(cfg, vocab, engine, 1)
    optimizer = build_optimizer(cfg, raw, engine)
    micro, T, accum = cfg.train.micro_batch_size, cfg.model.block_size, cfg.grad_accum_steps

    def step():
        for _ in range(accum):
            idx = torch.randint(0, vocab, (micro, T + 1), device=device)
            with engine.autocast():
                _, loss = model(idx[:, :-1], idx[:, 1:])
            (loss / accum).backward()
            if tracker is not None:
                tracker.reset_mod_stats()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    tracker = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(raw, optimizer)
    with tracker:
        for _ in range(steps):
            step()
    snap = tracker.get_tracker_snapshot("peak")
    return next(iter(snap.values()))["Total"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the tiny shapes on CPU (checks the benchmark)")
    p.add_argument(
        "--every-mode",
        action="store_true",
        help="on CPU: both families in every checkpointing mode and loss (12 cases)",
    )
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        cases = [
            ("gpt2-124m", GPT2_124M, 8, "none", "standard"),
            ("gpt2-124m", GPT2_124M, 16, "selective", "chunked"),
            ("llama-1b shape", LLAMA_1B, 4, "full", "chunked"),
            ("llama-1b shape", LLAMA_1B, 2, "selective", "standard"),
        ]
        hardware = plans.Hardware(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory, None)
    elif args.every_mode:
        cases = [
            (f"tiny {family}", {"family": family, **TINY}, 4, ac, ce)
            for family in ("llama", "gpt2")
            for ac in ("none", "selective", "full")
            for ce in ("standard", "chunked")
        ]
    else:
        cases = [
            ("tiny gpt2", {"family": "gpt2", **TINY}, 4, "none", "standard"),
            ("tiny llama", {"family": "llama", **TINY}, 4, "full", "chunked"),
        ]
    if not cuda:
        hardware = plans.Hardware.cpu()
    ratios = []
    for name, model, micro, ac, ce in cases:
        cfg = _config(model, micro, ac, ce, cuda)
        measured = measure(cfg, device)
        planned = plans.plan(cfg, hardware).allocated
        ratios.append(planned / measured)
        unit, size = ("GiB", plans.GIB) if measured >= plans.GIB else ("MiB", 1024**2)
        print(
            f"{name} micro {micro} {ac} {ce}: plan {planned / size:.2f} {unit}, measured "
            f"{measured / size:.2f} {unit} ({(planned - measured) / measured:+.1%})"
        )
        if cuda:
            torch.cuda.empty_cache()
    worst = max(ratios, key=lambda r: abs(r - 1))
    print(f"RATIO plan/measured, worst of {len(ratios)}: {worst:.3f} (goal within 10%: 0.90-1.10)")
    print(json.dumps({"device": hardware.name, "ratios": [round(r, 4) for r in ratios]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
