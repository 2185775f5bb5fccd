"""The document mask's build (model.attention 'document', flex attention's BlockMask) compiled
once, as stoker builds it on CUDA (stoker.families.attention.block_mask_builder), against eager
create_block_mask, which first evaluates the mask over a dense (B, H, T, T) grid: peak RSS above
the process's start and time per build, at T = 2k and 8k, each in a fresh process on the CPU.
goal: compiled peak <= 0.25 x eager at 8k (no B x T^2 tensor)

    python -m benchmarks.bench_block_mask [--batch 4] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from benchmarks._child import run_child


def child(mode: str, batch: int, T: int) -> dict:
    import torch

    from stoker.families.attention import block_mask_builder

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(2, 1000, (batch, T), generator=g)
    idx[torch.rand(batch, T, generator=g) < 1 / 300] = 1  # documents of ~300 tokens, ended by id 1
    ends = (idx == 1).to(torch.int32)
    doc = torch.cumsum(ends, 1) - ends

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    if mode == "compiled":
        build = block_mask_builder(on_cuda=True)  # what CUDA runs, here on the CPU
        build(same_document_causal, batch, None, T, T, device="cpu")  # the compilation, not measured
    else:
        build = block_mask_builder(on_cuda=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    for _ in range(3):
        mask = build(same_document_causal, batch, None, T, T, device="cpu")
    seconds = (time.perf_counter() - t0) / 3
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"peak_mb": peak, "seconds": seconds, "blocks": int(mask.kv_num_blocks.sum())}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--child", nargs=3, metavar=("MODE", "BATCH", "T"))
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return {}
    sizes = [256] if args.smoke else [2048, 8192]
    out = {}
    for T in sizes:
        got = {
            m: run_child("benchmarks.bench_block_mask", [m, str(args.batch), str(T)], f"{m} T={T}")
            for m in ("eager", "compiled")
        }
        assert got["eager"]["blocks"] == got["compiled"]["blocks"]  # the same mask
        ratio = got["compiled"]["peak_mb"] / max(got["eager"]["peak_mb"], 1e-9)
        out[T] = {**got, "peak_ratio": ratio, "speedup": got["eager"]["seconds"] / got["compiled"]["seconds"]}
        print(
            f"T={T} B={args.batch}: eager {got['eager']['peak_mb']:.0f} MB, {got['eager']['seconds']:.3f} s per build; "
            f"compiled {got['compiled']['peak_mb']:.0f} MB, {got['compiled']['seconds']:.3f} s; "
            f"peak ratio {ratio:.3f}, {out[T]['speedup']:.1f}x faster",
            flush=True,
        )
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
