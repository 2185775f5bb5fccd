"""The GPU engine on one GPU: stoker's trainer against a bare hand-tuned loop, and the
checkpoint stall. Skipped (exit 0, a line saying so) without CUDA.

1. tokens/s of stoker's Trainer (the one-GPU recipe: bf16 autocast, TF32, torch.compile,
   fused AdamW, padded vocabulary, prefetched pinned batches) over a bare nanoGPT-style loop
   of the same model, batch, optimizer and shards with the best settings known (bf16,
   compile, fused AdamW, TF32, pinned non-blocking copies), alternated in rounds, medians.
                                                                              goal >= 1.0
   MFU printed (6N + 12·L·C·T FLOPs per token against the device's bf16 peak; goal >= 45%
   for GPT-2 124M on an H100).
2. Training time lost per checkpoint: async (the step waits only for the copy into pinned
   host buffers) over a synchronous save+write+commit of the same state, each measured as
   the extra time of the steps around a save over the same steps without one.
                                                                              goal <= 0.15
3. With --real-variants: what a user runs, `torchrun --nproc-per-node=1 -m stoker.training.train` of
   the gpt2-124m-1gpu recipe (process group, per-step events, log-step syncs, checkpoint),
   its steady-state tokens/s read from its event stream (benchmarks/real_run.py); 'ddp:none'
   over the in-process trainer above                                          goal >= 0.97
   and each variant's step time over 'ddp:none' (fsdp:none <= 1.15, ddp:selective <= 1.12;
   ddp:none:ce4096: the chunked loss's cost). Parameter count, vocabulary (padded),
   micro-batch, torch and device are recorded in the JSON.
4. With --llama-1b: a Llama-3.2-1B-shaped model (random init; GQA 32/8 heads, SwiGLU 8192,
   llama3 RoPE, tied 128,256-row vocabulary) with the llama-3.2-1b recipe's settings on one GPU
   (bf16, compile, selective activation checkpointing, chunked loss; micro-batch from
   --llama-micro-batch): tokens/s and MFU of stoker's trainer, beside GPT-2 124M's above.
                                                                  goal MFU >= 45% on an H100
5. With --profile: where our trainer's step spends the GPU's time, by kind of kernel
   (matmuls, attention, inductor's fused kernels, optimizer, copies) and the top kernels.
--cross-entropy-chunk N runs the trainer and the bare loop with the chunked cross-entropy;
--explore times bare-loop variants (micro-batch, attention kernel, chunked loss) first.
The store is a local folder (the GPU host has no S3 endpoint), so "upload" is the checksum
and commit of files DCP wrote in place.

    python -m benchmarks.bench_gpu --store file:///path/with/shards [--micro-batch 16,32]
    python -m benchmarks.bench_gpu --store ... --real-variants ddp:none,fsdp:selective
    python -m benchmarks.bench_gpu --smoke --store ...   # every part, tiny, on the CPU

The shard set: ``python -m benchmarks.make_shards`` here, carried to the GPU host.
Writes benchmarks/results/gpu-<device>.json (and $OUT/bench_gpu.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from stoker.training.engine import compile_options

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEVICE = torch.device("cuda", 0)  # --smoke: the CPU
# --smoke: every part at a tiny size on the CPU, to check the benchmark itself before a GPU
# session spends its minutes on it (its figures mean nothing)
SMOKE = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 64, "engine.compile": "off"}


def _cuda() -> bool:
    return DEVICE.type == "cuda"


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def _peak_gb() -> float:
    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if _cuda() else 0.0


def _free() -> None:
    if _cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _config(store_root: str, micro: int, **engine):
    from stoker.config import load_config

    over = {
        "storage.root": store_root,
        "run_name": f"bench-gpu-{micro}",
        "train.micro_batch_size": micro,
        "train.global_batch_size": micro * 4,
        "train.deterministic": False,
        "eval.per_checkpoint_enabled": False,
        "launch.nproc_per_node": 1,
    }
    over.update({f"engine.{k}": v for k, v in engine.items()})
    if not _cuda():
        over.update(SMOKE)
    return load_config("gpt2-124m-1gpu", **over)


def _shard_key(store) -> str:
    keys = [k for k in store.listdir("shards") if not k.startswith(".")]
    if len(keys) != 1:
        raise SystemExit(f"expected one shard set under {store.url('shards')}, found {keys}")
    return keys[0]


def _trainer(cfg, store, shard_key, cache_dir):
    from stoker.storage.shards import materialize
    from stoker.training.distributed import RankInfo
    from stoker.training.loop import Trainer

    ranks = RankInfo(0, 0, 1, DEVICE)
    return Trainer(cfg, ranks, materialize(store, shard_key, cache_dir), store, shard_key, cache_dir)


def _chunked(chunk: int) -> dict:
    """Engine settings for the chunked cross-entropy (chunk tokens a chunk; 0: the full logits)."""
    return {"cross_entropy": "chunked", "cross_entropy_chunk": chunk} if chunk else {}


def _sdpa(name: str):
    """A context for the attention kernels: 'default' (PyTorch's choice) or one backend first."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "default":
        return nullcontext
    order = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[name]
    rest = [
        b
        for b in (
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        )
        if b != order
    ]
    return lambda: sdpa_kernel([order] + rest, set_priority=True)


def explore(store_root: str, store, key: str, cache_dir: str, variants: list[str], steps: int) -> list[dict]:
    """Tokens/s and MFU of the bare loop under variants "micro:attention[:cdt|:ma][:ce<N>]"
    (cdt: inductor's coordinate-descent tuning, ma: max-autotune, as engine.compile_tuning
    does them; ce<N>: the chunked cross-entropy, N tokens a chunk), to pick the settings the
    trainer should use."""
    from stoker.storage.shards import materialize
    from stoker.training.engine import peak_flops

    out = []
    for variant in variants:
        micro, attention, *extra = variant.split(":")
        torch._dynamo.reset()
        chunk = next((int(e[2:]) for e in extra if e.startswith("ce")), 0)
        tuning = "coordinate-descent" if "cdt" in extra else "max-autotune" if "ma" in extra else "none"
        cfg = _config(store_root, int(micro), compile_tuning=tuning, **_chunked(chunk))
        bare = BareLoop(cfg, materialize(store, key, cache_dir), attention)
        t0 = time.perf_counter()
        for _ in range(3):
            bare.train_step()
        _sync()
        warm = time.perf_counter() - t0
        tokens = cfg.train.global_batch_size * cfg.model.block_size
        tps = statistics.median(_tokens_per_second(bare.train_step, steps, tokens) for _ in range(3))
        peak = peak_flops(DEVICE)
        mfu = bare.model.flops_per_token() * tps / peak if peak else None
        row = {
            "variant": variant,
            "tokens_per_second": round(tps),
            "mfu": mfu and round(mfu, 4),
            "warmup_seconds": round(warm, 1),
            "peak_memory_gb": _peak_gb(),
        }
        print(
            f"  explore {variant}: {tps:,.0f} tok/s, MFU {100 * (mfu or 0):.1f}%, compile+warm-up {warm:.0f}s",
            flush=True,
        )
        out.append(row)
        del bare
        _free()
    compile_options("none")
    return out


class BareLoop:
    """nanoGPT's train.py, reduced: the same GPT, fused AdamW, bf16 autocast, compile, TF32,
    random windows from the same memmapped shards, pinned non-blocking copies, grad clip."""

    def __init__(self, cfg, shard_dir: str, attention: str = "default"):
        from stoker.families.gpt2.model import GPT
        from stoker.families.spec import param_groups
        from stoker.training.data import TokenStream

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        self.stream = TokenStream(shard_dir, "train")
        self.data = self.stream.parts[0]
        self.T, self.B = cfg.model.block_size, cfg.train.micro_batch_size
        self.accum = cfg.train.global_batch_size // self.B
        self.model = GPT(cfg.model, self.stream.vocab_size, seed=0).to(DEVICE)
        if cfg.engine.cross_entropy == "chunked":  # the same loss, as the trainer computes it
            self.model.loss_chunk = cfg.engine.cross_entropy_chunk
        self.opt = torch.optim.AdamW(param_groups(self.model, 0.1), lr=6e-4, betas=(0.9, 0.95), fused=_cuda())
        self.step_fn = (
            torch.compile(self.model, **compile_options(cfg.engine.compile_tuning)) if _cuda() else self.model
        )
        self.rng = np.random.default_rng(0)
        self.attention = _sdpa(attention)

    def batch(self):
        ix = self.rng.integers(0, len(self.data) - self.T - 1, size=self.B)
        rows = np.stack([self.data[i : i + self.T + 1] for i in ix]).astype(np.int64)
        t = torch.from_numpy(rows)
        if not _cuda():
            return t[:, :-1], t[:, 1:]
        t = t.pin_memory()
        return t[:, :-1].cuda(non_blocking=True), t[:, 1:].cuda(non_blocking=True)

    def train_step(self):
        x, y = self.batch()
        for _ in range(self.accum):
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=_cuda()), self.attention():
                _, loss = self.step_fn(x, y)
            x, y = self.batch()  # next batch while the GPU works
            (loss / self.accum).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _tokens_per_second(step, steps: int, tokens_per_step: int) -> float:
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    float(loss)  # one sync at the end, as a log step would
    return steps * tokens_per_step / (time.perf_counter() - t0)


# the Llama-3.2-1B shape (its config.json), for --llama-1b; --smoke shrinks it
LLAMA_1B = {
    "model.family": "llama",
    "model.n_layer": 16,
    "model.n_head": 32,
    "model.n_kv_head": 8,
    "model.n_embd": 2048,
    "model.intermediate_size": 8192,
    "model.head_dim": 64,
    "model.vocab_size": 128256,
    "model.rope_theta": 500000.0,
    "model.rope_type": "llama3",
    "model.rope_factor": 32.0,
    "model.rope_low_freq_factor": 1.0,
    "model.rope_high_freq_factor": 4.0,
    "model.rope_original_context": 8192,
    "model.norm_eps": 1e-5,
    "model.tie_embeddings": True,
    "model.max_position_embeddings": 131072,
}
LLAMA_SMOKE = {
    **LLAMA_1B,
    "model.n_layer": 2,
    "model.n_head": 4,
    "model.n_kv_head": 2,
    "model.n_embd": 64,
    "model.intermediate_size": 96,
    "model.head_dim": 16,
    "model.vocab_size": 512,
    "model.block_size": 64,
}


def bench_llama(store_root: str, store, key: str, cache_dir: str, micro: int, steps: int) -> dict:
    """tokens/s and MFU of stoker's trainer on the Llama-3.2-1B shape, the recipe's engine."""
    from stoker.config import load_config

    shape = LLAMA_1B if _cuda() else LLAMA_SMOKE
    over = {
        "storage.root": store_root,
        "run_name": f"bench-gpu-llama-{micro}",
        "model.init_from": None,
        "train.micro_batch_size": micro,
        "train.global_batch_size": micro * 4,
        "train.deterministic": False,
        "eval.per_checkpoint_enabled": False,
        "launch.nproc_per_node": 1,
        "engine.parallelism": "ddp",  # one GPU: nothing to shard
        **({"model.block_size": 2048} if _cuda() else {"engine.compile": "off"}),
        **shape,
    }
    cfg = load_config("llama-3.2-1b", **over)
    ours = _trainer(cfg, store, key, cache_dir)
    tokens = cfg.train.global_batch_size * cfg.model.block_size
    t0 = time.perf_counter()
    for _ in range(2):  # compile and warm
        ours.train_step()
    _sync()
    warm = time.perf_counter() - t0
    tps = statistics.median(_tokens_per_second(ours.train_step, steps, tokens) for _ in range(3))
    mfu = ours.flops_per_token * tps / ours.peak_flops if ours.peak_flops else None
    out = {
        "model": "llama-3.2-1b shape" if _cuda() else "llama (smoke shape)",
        "model_params": sum(p.numel() for p in ours.raw_model.parameters()),
        "micro_batch": micro,
        "block_size": cfg.model.block_size,
        "engine": ours.engine.describe(),
        "warmup_seconds": round(warm, 1),
        "tokens_per_second": round(tps),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_memory_gb": _peak_gb(),
    }
    print(
        f"  llama: {out['model_params'] / 1e6:.1f}M parameters, micro-batch {micro} x {cfg.model.block_size}: "
        f"{tps:,.0f} tok/s, MFU {100 * (mfu or 0):.1f}% (goal >= 45%), peak {out['peak_memory_gb']} GB",
        flush=True,
    )
    ours.batches.close()
    del ours
    _free()
    return out


def bench_throughput(cfg, store, shard_key, cache_dir, rounds: int, steps: int) -> dict:
    from stoker.storage.shards import materialize

    ours = _trainer(cfg, store, shard_key, cache_dir)
    bare = BareLoop(cfg, materialize(store, shard_key, cache_dir))
    tokens = cfg.train.global_batch_size * cfg.model.block_size
    t0 = time.perf_counter()
    for _ in range(3):  # compile and warm both
        ours.train_step()
        bare.train_step()
    _sync()
    warm = time.perf_counter() - t0
    a, b = [], []
    for i in range(rounds):  # ABBA order: neither loop always runs first
        first, second = ((ours, a), (bare, b)) if i % 2 == 0 else ((bare, b), (ours, a))
        for loop, rates in (first, second):
            rates.append(_tokens_per_second(loop.train_step, steps, tokens))
    tps_ours, tps_bare = statistics.median(a), statistics.median(b)
    mfu = ours.flops_per_token * tps_ours / ours.peak_flops if ours.peak_flops else None
    mfu_bare = ours.flops_per_token * tps_bare / ours.peak_flops if ours.peak_flops else None
    out = {
        "micro_batch": cfg.train.micro_batch_size,
        "tokens_per_step": tokens,
        "engine": ours.engine.describe(),
        "model_params": ours.raw_model.num_params(),
        "vocab_size": ours.raw_model.vocab_size,
        "warmup_seconds": round(warm, 1),
        "ours_tokens_per_second": round(tps_ours),
        "bare_tokens_per_second": round(tps_bare),
        "ratio": round(tps_ours / tps_bare, 3),
        "mfu": None if mfu is None else round(mfu, 4),
        "bare_mfu": None if mfu_bare is None else round(mfu_bare, 4),
        "peak_memory_gb": _peak_gb(),
        "rounds": {"ours": [round(x) for x in a], "bare": [round(x) for x in b]},
    }
    print(f"  model: {out['model_params'] / 1e6:.1f}M parameters, vocabulary {out['vocab_size']:,}")
    e = out["engine"]
    print(
        f"  micro-batch {out['micro_batch']} (cross-entropy {e['cross_entropy']}, compile tuning "
        f"{e['compile_tuning']}): ours {tps_ours:,.0f} tok/s, bare {tps_bare:,.0f} tok/s; "
        f"RATIO ours/bare = {out['ratio']:.3f} (goal >= 1.0: {'met' if out['ratio'] >= 1 else 'NOT met'}); "
        f"MFU {100 * (mfu or 0):.1f}% (bare {100 * (mfu_bare or 0):.1f}%; goal >= 45%)",
        flush=True,
    )
    ours.batches.close()
    del ours, bare
    _free()
    return out


# where a kernel's time goes, by the first pattern its name matches (CUDA kernel names, and
# aten op names when profiling on CPU). Inductor's kernels first: their names carry the names
# of the ops they fuse; attention before matmuls: flash kernels' names carry "cutlass".
KERNEL_KINDS = (
    ("matmul", re.compile(r"^triton_tem", re.I)),  # inductor's matmul templates
    ("fused by inductor", re.compile(r"^triton_|^cpp_fused", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa|_efficient_", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|aten::(mm|addmm|bmm|matmul)$", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("communication", re.compile(r"nccl|allreduce|all_reduce|reduce_scatter", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy_|aten::to$|_to_copy", re.I)),
)


def kernel_breakdown(run_steps, steps: int, device: torch.device, top: int = 12) -> dict:
    """Run `run_steps(steps)` under torch.profiler: the device time of each kind of kernel
    (matmuls, attention, inductor's fused kernels, optimizer, copies) as a share of all, and
    the kernels that take the most. On CPU: the ops' own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run_steps(steps)
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = (
            getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if cuda
            else e.self_cpu_time_total
        )
        if t > 0 and (not cuda or str(getattr(e, "device_type", "")).endswith("CUDA")):
            rows.append((e.key, t, e.count))
    total = sum(t for _, t, _ in rows) or 1
    kinds: dict[str, float] = {}
    for name, t, _ in rows:
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        kinds[kind] = kinds.get(kind, 0) + t
    rows.sort(key=lambda r: -r[1])
    out = {
        "steps": steps,
        "device_ms_per_step": round(total / 1000 / steps, 2),
        "share": {k: round(v / total, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": [{"kernel": name[:120], "share": round(t / total, 4), "calls": n} for name, t, n in rows[:top]],
    }
    print(
        f"  kernel time per step {out['device_ms_per_step']} ms: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in out["share"].items()),
        flush=True,
    )
    for row in out["top"]:
        print(f"    {100 * row['share']:5.1f}%  x{row['calls']:<5} {row['kernel']}")
    return out


def bench_profile(cfg, store, shard_key, cache_dir, steps: int = 2) -> dict:
    """Where our trainer's step spends the GPU's time (after compile and warm-up)."""
    ours = _trainer(cfg, store, shard_key, cache_dir)
    for _ in range(3):
        ours.train_step()
    out = kernel_breakdown(lambda n: [ours.train_step() for _ in range(n)], steps, ours.ranks.device)
    ours.batches.close()
    ours = None  # drop the model before _free (the lambda above holds the name, not the object)
    _free()
    return out


def _step_times(trainer, steps: int, save_at: set[int]) -> list[float]:
    """Wall time of each step (synchronized), saving after the steps in save_at."""
    times = []
    for i in range(steps):
        _sync()
        t0 = time.perf_counter()
        trainer.train_step()
        if i in save_at:
            trainer.save()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def bench_stall(cfg, store, shard_key, cache_dir, saves: int = 4, window: int = 4) -> dict:
    """Per save: the steps of a window starting at the save, minus the same number of steps
    without a save (median step time), for async and synchronous saves of the same state."""
    out = {}
    for mode in ("async", "sync"):
        run_cfg = cfg.model_copy(
            update={
                "run_name": f"{cfg.run_name}-{mode}",
                "checkpoint": cfg.checkpoint.model_copy(update={"async_enabled": mode == "async", "keep_latest_k": 2}),
            }
        )
        trainer = _trainer(run_cfg, store, shard_key, cache_dir)
        _step_times(trainer, 3, set())  # compile
        trainer.save()  # the first save allocates the pinned buffers
        trainer.uploader.wait()
        plain = statistics.median(_step_times(trainer, 10, set()))
        lost = []
        for _ in range(saves):
            times = _step_times(trainer, window, {0})
            lost.append(max(0.0, sum(times) - window * plain))
            trainer.uploader.wait()  # one save in flight, as the loop allows
        assert not trainer.uploader.failures, trainer.uploader.failures
        out[mode] = {
            "step_seconds": round(plain, 4),
            "lost_per_save": [round(x, 4) for x in lost],
            "median_lost_seconds": round(statistics.median(lost), 4),
        }
        trainer.batches.close()
        del trainer
        _free()
    state_bytes = (
        sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(store.local_path(f"runs/{cfg.run_name}-sync/checkpoints"))
            for f in fs
        )
        / 2
    )  # 2 kept
    ratio = out["async"]["median_lost_seconds"] / max(out["sync"]["median_lost_seconds"], 1e-9)
    out.update(ratio=round(ratio, 4), checkpoint_gb=round(state_bytes / 1e9, 2))
    print(
        f"  checkpoint of {out['checkpoint_gb']} GB: time lost per save async "
        f"{out['async']['median_lost_seconds']:.3f}s, sync {out['sync']['median_lost_seconds']:.3f}s; "
        f"RATIO async/sync = {ratio:.3f} (goal <= 0.15: {'met' if ratio <= 0.15 else 'NOT met'})",
        flush=True,
    )
    return out


def bench_real_runs(args, store, key: str, first_micro: int, throughput: list[dict]) -> dict:
    """The real runs of --real-variants (one torchrun each), the step-time ratios between
    them, and the 'ddp:none' run against the benchmark's trainer and bare loop (goal: the
    real run >= 0.97 of the benchmark)."""
    from benchmarks.real_run import compare_variants, real_run

    micro = args.real_micro_batch or first_micro or 32
    rows = [
        real_run(
            store,
            key,
            micro,
            steps=args.real_steps,
            warmup=args.real_warmup,
            smoke=SMOKE if args.smoke else None,
            global_batch=args.real_global_batch or None,
            variant=v,
            timeout=args.real_timeout,
        )
        for v in args.real_variants.split(",")
        if v
    ]
    out = {"real_runs": rows, "real_step_time_over_ddp": compare_variants(rows)}
    base = next((r for r in rows if r["variant"] == "ddp:none"), None)
    bench = next((t for t in throughput if t["micro_batch"] == micro), None)
    if base and bench:
        real = base["tokens_per_second"]
        out["real_vs_benchmark"] = {
            "micro_batch": micro,
            "real_tokens_per_second": real,
            "over_trainer": round(real / bench["ours_tokens_per_second"], 3),
            "over_bare_loop": round(real / bench["bare_tokens_per_second"], 3),
        }
        ratio = out["real_vs_benchmark"]["over_trainer"]
        print(
            f"  RATIO real run / benchmark trainer = {ratio:.3f} (goal >= 0.97: "
            f"{'met' if ratio >= 0.97 else 'NOT met'}); real / bare loop = "
            f"{out['real_vs_benchmark']['over_bare_loop']:.3f}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--store", default=os.environ.get("STOKER_GPU_STORE"), help="store root holding one shard set (shards/<key>)"
    )
    p.add_argument("--micro-batch", default="32", help="comma-separated micro-batch sizes to try")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per round")
    p.add_argument("--skip-stall", action="store_true")
    p.add_argument(
        "--profile", action="store_true", help="also profile our trainer's step: kernel time by kind, the top kernels"
    )
    p.add_argument(
        "--explore",
        default="",
        help="bare-loop variants to time first, e.g. "
        "'32:default,32:cudnn,48:cudnn:cdt,64:default:ce4096' "
        "(micro-batch:attention[:cdt|:ma][:ce<tokens a chunk>])",
    )
    p.add_argument(
        "--compile-tuning",
        default="none",
        choices=("none", "coordinate-descent", "max-autotune"),
        help="engine.compile_tuning of the trainer and the bare loop alike",
    )
    p.add_argument(
        "--cross-entropy-chunk",
        type=int,
        default=0,
        help="the trainer and the bare loop both compute the loss chunked, this many "
        "tokens a chunk (engine.cross_entropy 'chunked'); 0: the full logits",
    )
    p.add_argument(
        "--real-variants",
        default="",
        help="real 1-GPU torchrun runs of the gpt2-124m-1gpu recipe, timed from their "
        "event stream, e.g. 'ddp:none,fsdp:none,fsdp:selective,ddp:none:ce4096' "
        "(parallelism:activation checkpointing[:ce<tokens a chunk>]); 'ddp:none' is "
        "compared with the benchmark's trainer and bare loop",
    )
    p.add_argument(
        "--real-micro-batch",
        type=int,
        default=0,
        help="micro-batch of the real runs (default: the first of --micro-batch, else 32)",
    )
    p.add_argument("--real-steps", type=int, default=40, help="optimizer steps of each real run")
    p.add_argument(
        "--real-warmup",
        type=int,
        default=10,
        help="steps of each real run left out of its steady state (compile, warm-up)",
    )
    p.add_argument(
        "--real-global-batch", type=int, default=0, help="sequences a step of the real runs (default: the recipe's 480)"
    )
    p.add_argument("--real-timeout", type=float, default=540, help="seconds each real run may take")
    p.add_argument("--llama-1b", action="store_true", help="also the Llama-3.2-1B shape with its recipe's engine")
    p.add_argument("--llama-micro-batch", type=int, default=4, help="micro-batch of the Llama-1B shape")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every part at a tiny size on the CPU: checks the benchmark runs, before a "
        "GPU session spends its minutes on it; its figures mean nothing, nothing is written",
    )
    args = p.parse_args(argv)
    global DEVICE
    if args.smoke:
        DEVICE = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("  no CUDA device: skipped (see ../shared/gpu/README.md to run it on a lent GPU)")
        return
    if not args.store:
        raise SystemExit("--store (or STOKER_GPU_STORE) is required: a store root holding a shard set")
    from stoker.storage.store import Store

    store = Store(args.store)
    key = _shard_key(store)
    cache_dir = tempfile.mkdtemp(prefix="stoker-bench-gpu-")
    result = {
        "device": torch.cuda.get_device_name(0) if _cuda() else "cpu (smoke run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shards": key,
        "throughput": [],
    }
    # the trainer's engine settings; the bare loop follows them (compile tuning, chunked loss)
    engine = {"compile_tuning": args.compile_tuning, **_chunked(args.cross_entropy_chunk)}
    if args.explore:
        result["explore"] = explore(args.store, store, key, cache_dir, args.explore.split(","), args.steps)
    for micro in (int(m) for m in args.micro_batch.split(",") if m):
        cfg = _config(args.store, micro, **engine)
        result["throughput"].append(bench_throughput(cfg, store, key, cache_dir, args.rounds, args.steps))
    first = int(args.micro_batch.split(",")[0]) if args.micro_batch else 0
    if args.real_variants:
        result.update(bench_real_runs(args, store, key, first, result["throughput"]))
    if args.llama_1b:
        result["llama"] = bench_llama(args.store, store, key, cache_dir, args.llama_micro_batch, args.steps)
    if args.profile and first:
        result["profile"] = bench_profile(_config(args.store, first, **engine), store, key, cache_dir)
    if not args.skip_stall and first:
        result["stall"] = bench_stall(_config(args.store, first, **engine), store, key, cache_dir)
    # the runs' checkpoints and metrics go, so the shard store stays small enough to carry
    for run in glob.glob(store.local_path("runs/bench-gpu-*")):
        shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(cache_dir, ignore_errors=True)
    if args.smoke:
        print(json.dumps(result, indent=2))
        return
    os.makedirs(RESULTS, exist_ok=True)
    name = "gpu-" + "".join(c if c.isalnum() else "-" for c in result["device"]).strip("-").lower()
    for path in [os.path.join(RESULTS, name + ".json")] + (
        [os.path.join(os.environ["OUT"], "bench_gpu.json")] if os.environ.get("OUT") else []
    ):
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
