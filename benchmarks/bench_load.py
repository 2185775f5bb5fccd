"""Loading a base model (model.init_from) sharded, at world size 2 (two gloo ranks on CPU).

A Llama-shaped base (safetensors shards with an index, as save_pretrained writes them) is read
into an FSDP2 model built as the engine builds it (meta device, sharded, materialized and
initialized), each rank reading only its own slices (training.base.load_base).

1. Each rank's peak RSS (VmHWM) from building the model to the end of the load, less its fixed
   overhead (the RSS of Python, torch and the process group before the model is built,
   measured and printed), over the model's bytes: its own FSDP2 shard (0.5 at 2 ranks) plus
   what the load holds on top, its slices of one safetensors file at a time and one tensor's
   slice in flight.                                             goal <= 0.5 + largest tensor
2. The load's time (the slower rank) over a plain read of the same files (every safetensors
   file read whole into memory by one process, from the page cache as the load reads them).
                                                                            goal <= 1.5

    python -m benchmarks.bench_load [--hidden 1024 --layers 8 --vocab 32000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

MB = 1 << 20


def _write_base(folder: str, hidden: int, layers: int, vocab: int, shard_mb: int) -> tuple[dict, int, int]:
    """A Llama-shaped base with random weights: (config.json, model bytes, largest tensor bytes)."""
    from safetensors.torch import save_file

    heads, kv, inter = max(1, hidden // 64), max(1, hidden // 256), int(hidden * 8 / 3) // 64 * 64
    hf = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hidden // heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
    }
    hd = hidden // heads
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * hd, hidden),
                p + "self_attn.k_proj.weight": (kv * hd, hidden),
                p + "self_attn.v_proj.weight": (kv * hd, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * hd),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    gen = torch.Generator().manual_seed(0)
    groups, size, weight_map = [{}], 0, {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * 0.02
        if groups[-1] and size + t.numel() * 4 > shard_mb * MB:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += t.numel() * 4
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in group})
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    return hf, total, max(torch.Size(s).numel() * 4 for s in shapes.values())


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _rank(rank: int, world: int, init: str, config_json: str, folder: str, vocab: int, out: str) -> None:
    import torch.distributed as dist

    from stoker.config import RunConfig
    from stoker.training.base import load_base
    from stoker.training.engine import Engine, build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = RunConfig.model_validate_json(config_json)
        engine = Engine.resolve(cfg, torch.device("cpu"))
        fixed = _rss_now()
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
            f.write("5")
        raw, _ = build_model(cfg, vocab, engine, world, init=False)  # as the trainer builds it for a base
        dist.barrier()  # group: world; both ranks built before either loads
        before = _rss_now()
        began = time.perf_counter()
        read = load_base(raw, cfg.model, folder)
        seconds = time.perf_counter() - began
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"fixed": fixed, "before": before, "peak": _peak_rss(), "seconds": seconds, "read": read}, f)
    finally:
        dist.destroy_process_group()


def _plain_read(folder: str) -> float:
    """Every safetensors file read whole into new memory (pages touched for the first time, as
    a freshly built model's are), one file at a time, by one process."""
    began = time.perf_counter()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            buf = torch.empty(os.path.getsize(path), dtype=torch.uint8)  # fresh pages, as a model's
            with open(path, "rb") as f:
                f.readinto(memoryview(buf.numpy()))
            del buf
    return time.perf_counter() - began


def measure(hidden: int, layers: int, vocab: int, shard_mb: int) -> dict:
    import torch.multiprocessing as mp

    from stoker.config import RunConfig
    from stoker.families.llama.config import LlamaConfig

    work = tempfile.mkdtemp(prefix="stoker-bench-load-")
    try:
        base = os.path.join(work, "base")
        os.makedirs(base)
        hf, model_bytes, largest = _write_base(base, hidden, layers, vocab, shard_mb)
        model = LlamaConfig.model_validate({"block_size": 256, **LlamaConfig.from_hf_config(hf)})
        cfg = RunConfig(model=model, engine={"parallelism": "fsdp"}, launch={"nproc_per_node": 2})
        plain = min(_plain_read(base) for _ in range(3))  # warm: the load reads from the page cache too
        out = os.path.join(work, "rank")
        mp.start_processes(
            _rank, args=(2, f"file://{work}/rdzv", cfg.to_json(), base, vocab, out), nprocs=2, start_method="spawn"
        )
        ranks = [json.load(open(f"{out}.{r}")) for r in (0, 1)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "model_mb": model_bytes / MB,
        "largest_tensor_share": largest / model_bytes,
        "rank_fixed_overhead_mb": max(r["fixed"] for r in ranks) / MB,
        "peak_share": max(r["peak"] - r["fixed"] for r in ranks) / model_bytes,
        "load_rise_share": max(r["peak"] - r["before"] for r in ranks) / model_bytes,
        "read_share": [r["read"] / model_bytes for r in ranks],
        "load_seconds": max(r["seconds"] for r in ranks),
        "plain_read_seconds": plain,
        "time_ratio": max(r["seconds"] for r in ranks) / plain,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-mb", type=int, default=64, help="safetensors shard size of the base")
    p.add_argument("--smoke", action="store_true", help="a tiny base: checks the benchmark runs, measures nothing")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.shard_mb = 128, 2, 512, 1
    r = measure(args.hidden, args.layers, args.vocab, args.shard_mb)
    goal = 0.5 + r["largest_tensor_share"]
    print(
        f"base of {r['model_mb']:.0f} MB (largest tensor {r['largest_tensor_share']:.3f} of it), 2 ranks; "
        f"each rank read {', '.join(f'{s:.3f}' for s in r['read_share'])} of it"
    )
    print(
        f"fixed overhead of a rank (python, torch, the process group; before the model): {r['rank_fixed_overhead_mb']:.0f} MB"
    )
    print(
        f"peak RSS above it / model bytes: {r['peak_share']:.3f}  (goal <= 0.5 + {r['largest_tensor_share']:.3f} = "
        f"{goal:.3f}); of which the load itself, above the built model: {r['load_rise_share']:.3f}"
    )
    print(
        f"sharded load {r['load_seconds']:.3f} s / plain read {r['plain_read_seconds']:.3f} s = "
        f"{r['time_ratio']:.2f}  (goal <= 1.5)"
    )


if __name__ == "__main__":
    main()
