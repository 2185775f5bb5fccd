"""Activation checkpointing: what each mode of engine.activation_checkpointing costs in step
time and saves in activation memory, against 'none' measured in the same run.

For 'none', 'selective' and 'full', on one GPT (CPU, or the first CUDA device with bf16
autocast when there is one):
- peak activation memory of a training step, counted by torch's MemTracker (every tensor by
  what it is: parameters, gradients, optimizer state, activations, temporaries); on CUDA also
  the allocator's peak;
- step time (forward, backward, AdamW), modes alternated in rounds, medians.
Prints each mode's ratios to 'none': memory (lower is better) and time (the recompute's cost).

    python -m benchmarks.bench_activation_checkpointing [--layers 6 --width 384 --block 256 --batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MODES = ("none", "selective", "full")


def _model(args, mode: str, device: torch.device):
    from core.config import ModelConfig
    from training.model import GPT

    cfg = ModelConfig(n_layer=args.layers, n_head=args.width // 64, n_embd=args.width,
                      block_size=args.block, dropout=0.0)
    model = GPT(cfg, args.vocab, seed=0).to(device)
    model.activation_checkpointing = mode
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def _step(model, opt, x, device):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_activation_bytes(args, mode: str, device: torch.device, x) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    model, opt = _model(args, mode, device)
    _step(model, opt, x, device)  # the optimizer state exists from here on
    tracker = MemTracker()
    tracker.track_external(model, opt)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tracker:
        _step(model, opt, x, device)
    stats = next(s for d, s in tracker.get_tracker_snapshot("peak").items() if torch.device(d) == device)
    out = {"activations": stats[_MemRefType.ACT], "total": stats["Total"]}
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
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    try:
        import torch.distributed._tools.mem_tracker  # noqa: F401
    except ImportError:
        print("  torch has no MemTracker (torch.distributed._tools.mem_tracker): skipped")
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.block), generator=gen).to(device)
    print(f"  {args.layers} layers x {args.width}, block {args.block}, batch {args.batch}, "
          f"vocab {args.vocab}, on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}")

    memory = {mode: peak_activation_bytes(args, mode, device, x) for mode in MODES}
    built = {mode: _model(args, mode, device) for mode in MODES}
    for mode in MODES:
        for _ in range(2):  # warm
            _step(*built[mode], x, device)
    times = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            t0 = time.perf_counter()
            _step(*built[mode], x, device)
            times[mode].append(time.perf_counter() - t0)
    base_mem, base_time = memory["none"]["activations"], statistics.median(times["none"])
    for mode in MODES:
        t = statistics.median(times[mode])
        act = memory[mode]["activations"]
        line = (f"  {mode:>9}: activations {act / 2**20:7.1f} MiB, RATIO to none {act / base_mem:.2f}; "
                f"step {t * 1000:7.1f} ms, RATIO to none {t / base_time:.2f}")
        if "allocator_peak" in memory[mode]:
            line += f"; allocator peak {memory[mode]['allocator_peak'] / 2**30:.2f} GiB"
        print(line, flush=True)


if __name__ == "__main__":
    main()
