"""Document-aware attention (model.attention 'document') against causal attention, measured in
the same run: the training step's throughput on packed windows of whole documents.

A Llama-family model (grouped-query attention) on windows of --block tokens packed from
documents of random lengths (mean --doc-tokens) ended by a separator, as the data stage packs
them. Each variant: forward, backward and an AdamW step, --steps times after 2 warm-up steps;
rounds alternate the variants; medians. On CUDA 'document' runs flex attention over a BlockMask
built once per micro-batch (compiled; the goal is >= 0.9 of causal); on the CPU it is the exact
path, SDPA with a (B, 1, T, T) boolean mask. Prints tokens/s of each and the ratio.

    python -m benchmarks.bench_attention [--block 512 --batch 8 --steps 10 --rounds 3] [--smoke]

--smoke: a tiny model and sizes, one round: checks that the benchmark runs, its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch

SEP = 1


def packed_windows(batch: int, block: int, doc_tokens: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(batch, block + 1) windows cut from documents of 1..2*doc_tokens tokens, each ended by SEP."""
    g = torch.Generator().manual_seed(seed)
    need = batch * (block + 1)
    flat: list[torch.Tensor] = []
    total = 0
    while total < need:
        n = int(torch.randint(1, 2 * doc_tokens, (1,), generator=g))
        doc = torch.randint(2, vocab, (n,), generator=g)
        flat += [doc, torch.tensor([SEP])]
        total += n + 1
    return torch.cat(flat)[:need].view(batch, block + 1)


def main(argv: list[str] | None = None) -> dict:
    from stoker.families.llama.config import LlamaConfig
    from stoker.families.llama.model import Llama

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=128, help="mean document length in tokens")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks the benchmark runs")
    args = p.parse_args(argv)
    shape = dict(n_layer=4, n_head=8, n_kv_head=2, n_embd=256, intermediate_size=704)
    if args.smoke:
        args.block, args.batch, args.doc_tokens, args.steps, args.rounds = 64, 2, 16, 1, 1
        shape = dict(n_layer=1, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext
    vocab = 2048
    windows = packed_windows(args.batch, args.block, args.doc_tokens, vocab).to(device)
    x, y = windows[:, :-1], windows[:, 1:]
    models = {}
    for kind in ("causal", "document"):
        cfg = LlamaConfig(family="llama", block_size=args.block, attention=kind, **shape)
        model = Llama(cfg, vocab, seed=0).to(device)
        model.document_end_id = SEP
        models[kind] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def steps(kind: str, n: int) -> float:
        model, opt = models[kind]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            with autocast():
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for kind in models:  # warm-up (and, on CUDA, flex attention's compilation)
        steps(kind, 1 if args.smoke else 2)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for kind in models:
            times[kind].append(steps(kind, args.steps))
    tokens = args.steps * args.batch * args.block
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    result = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "path": "flex attention, BlockMask" if device.type == "cuda" else "SDPA, dense boolean mask",
        "block": args.block,
        "batch": args.batch,
        "mean_doc_tokens": args.doc_tokens,
        "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
        "document_over_causal": round(rate["document"] / rate["causal"], 3),
        "smoke": args.smoke,
    }
    print(json.dumps(result))
    print(
        f"document attention: {rate['document']:,.0f} tok/s, causal {rate['causal']:,.0f} tok/s: "
        f"x{result['document_over_causal']:.2f} of causal ({result['path']}, {result['device']})"
    )
    return result


if __name__ == "__main__":
    main()
