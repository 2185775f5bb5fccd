"""A mixture of experts on the CPU (families.moe): training tokens per second of a tiny
Qwen3-MoE (8 experts, top-2) against a dense Qwen3 of the same active parameters (its MLP as
wide as the two experts a token runs), and the grouped experts (torch._grouped_mm over tokens
sorted by expert) against the per-expert loop, the exact reference; forward and backward of
the whole model, fp32, one process, the same batches.
goal: grouped >= 1.0 x the loop (it replaces E matmuls by one per projection); the mixture's
tokens/s against the dense model's is the price of routing, reported, with no goal on a CPU

    python -m benchmarks.bench_moe [--smoke]
    python -m benchmarks.bench_moe --gpu-layer   # on CUDA: one Qwen3-30B-A3B MoE layer's MFU

--gpu-layer (benchmarks/gpu_session.sh bench): the grouped experts of one Qwen3-30B-A3B layer
(128 experts of 768 over a width of 2048, top-8) on 16k tokens in bf16, forward and backward,
its MFU against the device's bf16 peak (6 x 3 x 2048 x 768 FLOPs a routed token), beside the
per-expert loop's.
"""

from __future__ import annotations

import argparse
import json
import time


def _tokens_per_second(model, batch: int, T: int, steps: int, vocab: int) -> float:
    import torch

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (batch, T + 1), generator=g) for _ in range(steps + 2)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for i, idx in enumerate(data):
        if i == 2:  # two warm-up steps
            began = time.perf_counter()
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * batch * T / (time.perf_counter() - began)


def gpu_layer(tokens: int = 16384, reps: int = 10) -> dict:
    """One Qwen3-30B-A3B MoE layer's experts on CUDA in bf16: MFU of the grouped path and of
    the loop."""
    import torch

    from stoker.families.moe import SparseMoE
    from stoker.training.engine import peak_flops

    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(dev)}
    peak = peak_flops(dev)
    for impl in ("grouped", "loop"):
        moe = SparseMoE(2048, 768, num_experts=128, top_k=8, norm_topk_prob=True, impl=impl).to(dev)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(1, tokens, 2048, device=dev, requires_grad=True)
        for i in range(reps + 3):
            if i == 3:
                torch.cuda.synchronize()
                began = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, _ = moe(x)
            y.float().square().mean().backward()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - began) / reps
        flops = 6 * tokens * 8 * 3 * 2048 * 768
        out[f"{impl}_ms"] = round(seconds * 1e3, 2)
        out[f"{impl}_mfu"] = round(flops / seconds / peak, 4) if peak else None
    out["grouped_over_loop"] = round(out["loop_ms"] / out["grouped_ms"], 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    import torch

    from stoker.families import FAMILIES, build_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny size, for the suite's check")
    p.add_argument("--gpu-layer", action="store_true", help="one Qwen3-30B-A3B MoE layer on CUDA")
    args = p.parse_args(argv)
    if args.gpu_layer:
        out = gpu_layer()
        print(json.dumps(out, indent=2))
        return out
    torch.set_num_threads(1)
    width, T, batch, steps = (64, 64, 2, 2) if args.smoke else (256, 256, 8, 8)
    expert, vocab = width, 1024
    shape = dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=width, head_dim=width // 4, block_size=T, vocab_size=vocab)
    dense_cfg = FAMILIES["qwen3"].model_validate({"family": "qwen3", **shape, "intermediate_size": 2 * expert})
    out = {}
    for impl in ("grouped", "loop"):
        moe_cfg = FAMILIES["qwen3_moe"].model_validate(
            {
                "family": "qwen3_moe",
                **shape,
                "intermediate_size": 2 * expert,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": expert,
                "mlp_only_layers": [],
                "experts_impl": impl,
            }
        )
        moe = build_model(moe_cfg, vocab, seed=0)
        out[f"moe_{impl}_tokens_per_s"] = round(_tokens_per_second(moe, batch, T, steps, vocab), 1)
    dense = build_model(dense_cfg, vocab, seed=0)
    out["moe_active_params"] = moe.num_active_params()
    out["dense_params"] = dense.num_params()
    out["dense_tokens_per_s"] = round(_tokens_per_second(dense, batch, T, steps, vocab), 1)
    out["grouped_over_loop"] = round(out["moe_grouped_tokens_per_s"] / out["moe_loop_tokens_per_s"], 3)
    out["moe_over_dense"] = round(out["moe_grouped_tokens_per_s"] / out["dense_tokens_per_s"], 3)
    print(json.dumps(out, indent=2))
    print(
        f"grouped / loop: {out['grouped_over_loop']} (goal >= 1.0); moe / dense of the same active parameters: {out['moe_over_dense']}"
    )
    return out


if __name__ == "__main__":
    main()
