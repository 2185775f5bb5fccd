"""The memory-saving engine settings: what each costs in step time and saves in memory,
against the default (no activation checkpointing, the full logits' cross-entropy) measured
in the same run.

Variants, on one GPT (CPU, or the first CUDA device with bf16 autocast when there is one):
- 'none', 'selective', 'full': engine.activation_checkpointing;
- 'chunked': engine.cross_entropy 'chunked' (the output matmul and the loss --chunk tokens at
  a time), without activation checkpointing.
For each: peak memory of a training step counted by torch's MemTracker (every tensor by what
it is: activations, temporaries, parameters, gradients, optimizer state), on CUDA also the
allocator's peak; and step time (forward, backward, AdamW), variants alternated in rounds,
medians. Prints each variant's ratios to 'none': memory (lower is better) and time.

    python -m benchmarks.bench_memory [--layers 6 --width 384 --block 256 --batch 8 --vocab 4096] [--smoke]

--smoke: one layer of width 64 (one head: the heads are width / 64), every variant, one round;
it checks that the benchmark runs, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# variant: (engine.activation_checkpointing, tokens per cross-entropy chunk or 0)
VARIANTS = ("none", "selective", "full", "chunked")


def _model(args, variant: str, device: torch.device):
    from stoker.families.gpt2.config import GPT2Config
    from stoker.families.gpt2.model import GPT
    from stoker.families.layers import checkpoint_blocks

    cfg = GPT2Config(
        n_layer=args.layers, n_head=args.width // 64, n_embd=args.width, block_size=args.block, dropout=0.0
    )
    model = GPT(cfg, args.vocab, seed=0).to(device)
    checkpoint_blocks(model.blocks, "none" if variant == "chunked" else variant)
    model.loss_chunk = args.chunk if variant == "chunked" else 0
    step = torch.compile(model) if args.compile else model
    return step, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def _step(step, model, opt, x, device):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        _, loss = step(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_bytes(args, variant: str, device: torch.device, x) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    built = _model(args, variant, device)
    _step(*built, x, device)  # the optimizer state exists from here on (and compiled)
    tracker = MemTracker()
    tracker.track_external(built[1], built[2])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tracker:
        _step(*built, x, device)
    stats = next(s for d, s in tracker.get_tracker_snapshot("peak").items() if torch.device(d) == device)
    out = {"activations": stats[_MemRefType.ACT], "temporaries": stats[_MemRefType.TEMP], "total": stats["Total"]}
    if device.type == "cuda":
        out["allocator_peak"] = torch.cuda.max_memory_allocated(device)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512, help="tokens per chunk for 'chunked'")
    p.add_argument("--compile", action="store_true", help="torch.compile each model")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny model, one round: checks the benchmark runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.block, args.batch, args.vocab, args.chunk, args.rounds = 1, 64, 32, 2, 256, 16, 1
    try:
        import torch.distributed._tools.mem_tracker  # noqa: F401
    except ImportError:
        print("  torch has no MemTracker (torch.distributed._tools.mem_tracker): skipped")
        return
    variants = ["none"] + [v for v in args.variants.split(",") if v in VARIANTS and v != "none"]
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.block), generator=gen).to(device)
    print(
        f"  {args.layers} layers x {args.width}, block {args.block}, batch {args.batch}, "
        f"vocab {args.vocab}, chunk {args.chunk}{', compiled' if args.compile else ''}, on "
        f"{torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}"
    )

    memory = {v: peak_bytes(args, v, device, x) for v in variants}
    built = {v: _model(args, v, device) for v in variants}
    for v in variants:
        for _ in range(2):  # warm
            _step(*built[v], x, device)
    times = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            t0 = time.perf_counter()
            _step(*built[v], x, device)
            times[v].append(time.perf_counter() - t0)
    base, base_time = memory["none"], statistics.median(times["none"])
    for v in variants:
        t, m = statistics.median(times[v]), memory[v]
        line = (
            f"  {v:>9}: activations {m['activations'] / 2**20:7.1f} MiB, RATIO to none "
            f"{m['activations'] / base['activations']:.2f}; peak {m['total'] / 2**20:7.1f} MiB, "
            f"RATIO {m['total'] / base['total']:.2f}; step {t * 1000:7.1f} ms, RATIO to none "
            f"{t / base_time:.2f}"
        )
        if "allocator_peak" in m:
            line += (
                f"; allocator peak {m['allocator_peak'] / 2**30:.2f} GiB, RATIO "
                f"{m['allocator_peak'] / base['allocator_peak']:.2f}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
