"""On a CUDA GPU (marker `cuda`; skipped cleanly without one): the one-GPU recipe under
torchrun with NCCL through evaluation, checkpoint and resume; FSDP2 on CUDA; bf16+compile
faster than fp32 in the same run (a ratio, never a time); the async checkpoint copy; document
attention's fused kernel (flex attention) against its exact path, for each family.

Shards: STOKER_GPU_STORE names a store root holding one shard set built for the recipe
(``python -m benchmarks.make_shards``, carried to the GPU host); without it the data stage
builds a small one here.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from stoker.config import load_config
from stoker.families import FAMILIES
from stoker.storage.store import Store
from tests.conftest import ROOT, run_ranks, train_losses

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def gpu_shards(tmp_path_factory):
    """(store root, shard key) of a shard set for the gpt2-124m-1gpu recipe."""
    root = os.environ.get("STOKER_GPU_STORE")
    if not root:
        from tests.conftest import prepare_shards

        root = "file://" + str(tmp_path_factory.mktemp("gpu-store"))
        cfg = load_config("gpt2-124m-1gpu", **{"storage.root": root, "data.max_bytes": 3_000_000})
        prepare_shards(cfg)
    store = Store(root)
    keys = [k for k in store.listdir("shards") if not k.startswith(".")]
    assert len(keys) == 1, keys
    return root, keys[0]


def _recipe(root: str, run: str, tmp_path, **over):
    """The one-GPU recipe as written, cut to a few steps, in a store of this test's own."""
    cfg = load_config(
        "gpt2-124m-1gpu",
        **{
            "run_name": run,
            "storage.root": "file://" + str(tmp_path / "store"),
            "train.max_steps": 12,
            "train.warmup_steps": 2,
            "train.global_batch_size": 32,
            "train.log_interval": 2,
            "checkpoint.interval_steps": 6,
            "eval.interval_steps": 6,
            "eval.num_batches": 2,
            "eval.per_checkpoint_enabled": False,
            **over,
        },
    )
    store = Store(cfg.storage.root)
    src = Store(root)
    return cfg, store, src


def _link_shards(src: Store, store: Store, key: str) -> None:
    os.makedirs(store.local_path("shards"), exist_ok=True)
    dst = store.local_path(f"shards/{key}")
    if not os.path.exists(dst):
        os.symlink(src.local_path(f"shards/{key}"), dst)


def _launch(cfg, store, key, resume=None, name="config"):
    url_key = f"runs/{cfg.run_name}/{name}.json"
    store.write_bytes(url_key, cfg.to_json().encode())
    return run_ranks(store.url(url_key), key, resume=resume, nproc=1, timeout=560)


def test_one_gpu_recipe_trains_evaluates_checkpoints_and_resumes_under_nccl(gpu_shards, tmp_path):
    root, key = gpu_shards
    cfg, store, src = _recipe(root, "gpu-run", tmp_path)
    _link_shards(src, store, key)
    assert cfg.launch.backend == "nccl" and cfg.engine.compile == "auto"
    unbroken = _launch(cfg, store, key)
    losses = train_losses(unbroken)
    assert sorted(losses) == [1, 2, 4, 6, 8, 10, 12]
    assert losses[12] < losses[1]
    trains = [e for e in unbroken if e["event"] == "train"]
    assert all(e["tokens_per_second"] > 0 and e["peak_memory_gb"] > 0 for e in trains)
    if "H100" in torch.cuda.get_device_name(0):
        assert all(0 < e["mfu"] < 1 for e in trains)
    assert [e["step"] for e in unbroken if e["event"] == "eval"] == [0, 6, 12]
    commits = [e for e in unbroken if e["event"] == "checkpoint"]
    assert [e["step"] for e in commits] == [6, 12]

    resumed = train_losses(_launch(cfg, store, key, resume=commits[0]["key"]))
    assert sorted(resumed) == [8, 10, 12]
    for s in resumed:  # bf16 + compile on a GPU: close, not bitwise (see docs/gpu-engine.md)
        assert abs(resumed[s] - losses[s]) < 2e-2 * abs(losses[s]), (s, resumed[s], losses[s])

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stoker.training.evaluation_main",
            "--config",
            store.url(f"runs/{cfg.run_name}/config.json"),
            "--checkpoint",
            commits[1]["key"],
            "--shards",
            key,
            "--max-windows",
            "32",
            "--device",
            "cuda",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    evaluated = [json.loads(l.split("STOKER_METRIC ", 1)[1]) for l in out.stdout.splitlines() if "STOKER_METRIC " in l]
    assert evaluated[-1]["event"] == "evaluated" and evaluated[-1]["step"] == 12
    assert 0 < evaluated[-1]["val_loss"] < 20


def test_fsdp2_on_cuda_follows_ddp_and_its_checkpoint_loads_under_ddp(gpu_shards, tmp_path):
    root, key = gpu_shards
    ddp, store, src = _recipe(
        root, "gpu-fsdp", tmp_path, **{"train.max_steps": 6, "checkpoint.interval_steps": 3, "eval.interval_steps": 3}
    )
    _link_shards(src, store, key)
    fsdp = ddp.model_copy(update={"engine": ddp.engine.model_copy(update={"parallelism": "fsdp"})})
    a = train_losses(_launch(ddp, store, key))
    b_events = _launch(fsdp, store, key, name="config-fsdp")
    b = train_losses(b_events)
    for s in a:
        assert abs(a[s] - b[s]) < 2e-2 * abs(a[s]), (s, a[s], b[s])
    fsdp_ckpt = [e["key"] for e in b_events if e["event"] == "checkpoint"][0]
    c = train_losses(_launch(ddp, store, key, resume=fsdp_ckpt))  # FSDP2 -> DDP
    assert sorted(c) == [4, 6]
    for s in c:
        assert abs(a[s] - c[s]) < 2e-2 * abs(a[s]), (s, a[s], c[s])


def _tokens_per_second(trainer, steps: int) -> float:
    for _ in range(3):  # compile and warm up
        trainer.train_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = trainer.train_step()
    float(loss)
    tokens = trainer.cfg.train.global_batch_size * trainer.cfg.model.block_size
    return steps * tokens / (time.perf_counter() - t0)


def test_bf16_and_compile_are_faster_than_fp32(gpu_shards, tmp_path):
    from stoker.storage.shards import materialize
    from stoker.training.distributed import RankInfo
    from stoker.training.loop import Trainer

    root, key = gpu_shards
    ranks = RankInfo(0, 0, 1, torch.device("cuda", 0))
    rates = {}
    for name, engine in [
        ("fp32", {"precision": "fp32", "tf32": False, "compile": "off", "fused_optimizer": "off"}),
        ("fast", {}),
    ]:
        cfg, store, src = _recipe(
            root,
            f"speed-{name}",
            tmp_path,
            **{
                "train.global_batch_size": 16,
                "train.micro_batch_size": 16,
                **{f"engine.{k}": v for k, v in engine.items()},
            },
        )
        trainer = Trainer(
            cfg, ranks, materialize(src, key, str(tmp_path / "cache")), store, key, cache_dir=str(tmp_path / "cache")
        )
        rates[name] = _tokens_per_second(trainer, 8)
        trainer.batches.close()
        del trainer
        torch.cuda.empty_cache()
    ratio = rates["fast"] / rates["fp32"]
    print(f"bf16+compile+fused over fp32: {ratio:.2f}x ({rates})")
    assert ratio > 1.0


def _bf16_steps_on_cuda(variants: dict, compiled: bool, vocab: int = 8192) -> dict:
    """variant -> (loss, output-matrix gradient, allocator peak above the model) of a bf16
    training step of one GPT, the variant's (activation checkpointing, loss chunk) set."""
    from stoker.families.gpt2.config import GPT2Config
    from stoker.families.gpt2.model import GPT
    from stoker.families.layers import checkpoint_blocks

    dev = torch.device("cuda", 0)
    cfg = GPT2Config(n_layer=4, n_head=8, n_embd=512, block_size=512, dropout=0.0)
    x = torch.randint(0, vocab, (8, 512), device=dev, generator=torch.Generator(dev).manual_seed(0))
    out = {}
    for name, (ac, chunk) in variants.items():
        model = GPT(cfg, vocab, seed=0).to(dev)
        model.loss_chunk = chunk
        checkpoint_blocks(model.blocks, ac)
        step = torch.compile(model) if compiled else model
        for _ in range(2):  # the first compiles
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = step(x, x)
            loss.backward()
            torch.cuda.synchronize()
        out[name] = (
            loss.item(),
            model.lm_head.weight.grad.float().clone(),
            torch.cuda.max_memory_allocated(dev) - base,
        )
        del model, step
        torch.cuda.empty_cache()
    peaks = {m: round(v[2] / 2**20) for m, v in out.items()}
    print(f"allocator peak above the model, MiB: {peaks}")
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_on_cuda_keeps_the_loss_and_holds_less(compiled):
    """bf16 autocast, eager and compiled: 'selective' and 'full' give the loss and gradients
    of 'none' (close: a compiled recompute may fuse otherwise) and a lower allocator peak,
    full < selective < none."""
    out = _bf16_steps_on_cuda({m: (m, 0) for m in ("none", "selective", "full")}, compiled)
    for mode in ("selective", "full"):
        assert out[mode][0] == pytest.approx(out["none"][0], rel=1e-3), (mode, out[mode][0], out["none"][0])
        assert torch.allclose(out[mode][1], out["none"][1], rtol=2e-2, atol=1e-4), mode
    peaks = {m: v[2] for m, v in out.items()}
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_cross_entropy_on_cuda_keeps_the_loss_and_holds_less(compiled):
    """At GPT-2's vocabulary the logits dominate the step's memory: the chunked cross-entropy
    (1024 tokens a chunk) gives the loss and output-matrix gradient of the full logits (close:
    bf16 rounding) at a lower allocator peak (printed: how much lower, compiled or not, is
    for bench_memory to say)."""
    out = _bf16_steps_on_cuda({"full": ("none", 0), "chunked": ("none", 1024)}, compiled, vocab=50304)
    assert out["chunked"][0] == pytest.approx(out["full"][0], rel=1e-3)
    a, b = out["chunked"][1], out["full"][1]
    assert (a - b).norm() <= 2e-2 * b.norm()
    assert out["chunked"][2] < out["full"][2], (out["chunked"][2], out["full"][2])


def test_async_checkpoint_copy_on_cuda_writes_the_state_of_its_step(tmp_path):
    """The copy to pinned buffers is non-blocking: what lands must still be the state at
    save time although the next steps start at once; the buffers are reused."""
    from stoker.families.gpt2.config import GPT2Config
    from stoker.families.gpt2.model import GPT
    from stoker.families.spec import param_groups
    from stoker.storage.uploader import CheckpointUploader
    from stoker.training.checkpoint import Checkpointer, load_checkpoint

    dev = torch.device("cuda", 0)
    model = GPT(GPT2Config(n_layer=2, n_head=4, n_embd=256, block_size=64), 1000, seed=1).to(dev)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def step():
        x = torch.randint(0, 1000, (8, 64), device=dev)
        model(x, x)[1].backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    events = []
    store = Store("file://" + str(tmp_path / "store"))
    uploader = CheckpointUploader(
        store,
        "r",
        rank=0,
        world_size=1,
        staging_root=str(tmp_path / "s"),
        keep_latest_k=5,
        upload_timeout=60,
        commit_timeout=60,
        async_enabled=True,
        on_event=events.append,
    )
    ckpt = Checkpointer(uploader, model, opt, sched, rank=0, world_size=1, device=dev, seed=0, global_batch_size=8)
    step()
    ckpt.save(1, 0, {})
    uploader.wait()
    buffers = {k: v.data_ptr() for k, v in ckpt.buffers.items()}
    step()
    at_save = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt.save(2, 0, {})
    for _ in range(5):
        step()  # overwrite the live tensors while the copy and the write are in flight
    uploader.wait()
    assert {k: v.data_ptr() for k, v in ckpt.buffers.items()} == buffers  # reused
    key = [e.key for e in events if e.kind == "checkpoint"][-1]
    fresh = GPT(GPT2Config(n_layer=2, n_head=4, n_embd=256, block_size=64), 1000, seed=2).to(dev)
    load_checkpoint(store.local_path(key), model=fresh)
    for n, p in fresh.named_parameters():
        assert torch.equal(p, at_save[n]), n


def test_deterministic_resume_on_cuda_is_bitwise(gpu_shards, tmp_path):
    """train.deterministic on CUDA (deterministic algorithms, a fixed cuBLAS workspace) with
    the recipe's bf16 and compile: a resumed run repeats the unbroken run's losses exactly."""
    root, key = gpu_shards
    cfg, store, src = _recipe(
        root,
        "gpu-det",
        tmp_path,
        **{
            "train.deterministic": True,
            "train.max_steps": 4,
            "train.log_interval": 1,
            "checkpoint.interval_steps": 2,
            "eval.interval_steps": 100,
        },
    )
    _link_shards(src, store, key)
    unbroken = _launch(cfg, store, key)
    first = [e["key"] for e in unbroken if e["event"] == "checkpoint"][0]
    resumed = train_losses(_launch(cfg, store, key, resume=first))
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s] == train_losses(unbroken)[s] for s in resumed), (resumed, train_losses(unbroken))


def test_fsdp2_compiled_blocks_checkpoint_inside_on_cuda():
    """FSDP2 on one GPU with each block compiled by inductor (activation checkpointing inside
    the compiled block, then fully_shard): every mode gives the loss of 'none', and the
    allocator peak orders full < selective < none (with the checkpoint outside the compiled
    block, 'selective' recomputed the whole block and saved no more than 'full')."""
    import torch.distributed as dist

    from stoker.training.engine import Engine, build_model
    from tests.conftest import tiny_dict

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    try:
        x = torch.randint(0, 8192, (8, 512), device=dev, generator=torch.Generator(dev).manual_seed(0))
        for mode in ("none", "selective", "full"):
            torch._dynamo.reset()
            cfg = load_config(
                tiny_dict(
                    "file:///tmp/unused",
                    model={"n_layer": 4, "n_head": 8, "n_embd": 512, "block_size": 512, "dropout": 0.0},
                    engine={"parallelism": "fsdp", "compile": "on", "activation_checkpointing": mode},
                )
            )
            _, model = build_model(cfg, 8192, Engine.resolve(cfg, dev), world_size=1)
            for _ in range(2):  # the first compiles
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(x, x)
                loss.backward()
                torch.cuda.synchronize()
            out[mode] = (loss.item(), torch.cuda.max_memory_allocated(dev) - base)
            del model
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    print(f"FSDP2 compiled, allocator peak above the model, MiB: { {m: round(v[1] / 2**20) for m, v in out.items()} }")
    for mode in ("selective", "full"):
        assert out[mode][0] == pytest.approx(out["none"][0], rel=1e-3), (mode, out)
    assert out["full"][1] < out["selective"][1] < out["none"][1], out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_document_attention_on_cuda_runs_the_fused_kernel_as_the_exact_path(family):
    """model.attention 'document' on CUDA: FSDP2 on one GPU under NCCL, each block compiled,
    the flex-attention BlockMask built once per micro-batch by the compiled builder. The
    separators sit at other columns in every row (a mask that ignored the batch index fails),
    and the weights are drawn wide (std 0.2), so that each token's logits depend on what it
    sees: the fp32 logits equal the exact path's (the dense mask, the same weights) within
    2e-3, while causal attention's differ from them by far more (the control: a wrong mask
    fails). In bf16 the loss and the gradients agree at bf16's rounding; a window of one
    document gives causal attention's loss."""
    import torch.distributed as dist

    from stoker.families import attention
    from stoker.training.engine import Engine, build_model
    from tests.conftest import tiny_dict

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    sep = 3
    try:
        g = torch.Generator(dev).manual_seed(0)
        x = torch.randint(4, 8192, (4, 512), device=dev, generator=g)
        for row in range(x.shape[0]):  # other columns in every row: documents of ~20 tokens
            x[row, torch.randint(0, 512, (24,), device=dev, generator=g)] = sep
        model_section = {"n_layer": 2, "n_head": 8, "n_embd": 256, "block_size": 512, "attention": "document"}
        if "n_kv_head" in FAMILIES[family].model_fields:  # the RoPE families: GQA, an explicit head_dim
            model_section.update(family=family, n_kv_head=2, intermediate_size=704, head_dim=48)
        cfg = load_config(
            tiny_dict("file:///tmp/unused", model=model_section, engine={"parallelism": "fsdp", "compile": "on"})
        )
        out, logits = {}, {}
        for fused in (True, False):
            torch._dynamo.reset()
            attention.FUSED_ON_CUDA = fused
            try:
                raw, model = build_model(cfg, 8192, Engine.resolve(cfg, dev), world_size=1)
                raw.document_end_id = sep
                torch.manual_seed(1)
                with torch.no_grad():  # the same wide weights for both paths
                    for p in [p for p in raw.parameters() if p.dim() > 1]:
                        p.normal_(0.0, 0.2)
                with torch.no_grad():
                    logits[fused] = model(x)[0].float()
                    if not fused:
                        raw.cfg.attention = "causal"
                        logits["causal"] = model(x)[0].float()
                        raw.cfg.attention = "document"
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(x, x)
                loss.backward()
                grad = next(p for n, p in raw.named_parameters() if "q_proj" in n or "c_attn" in n).grad
                out[fused] = (loss.item(), grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone())
                one = x.clone()
                one[one == sep] = sep + 1
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    masked = model(one, one)[1].item()
                    raw.cfg.attention = "causal"
                    causal = model(one, one)[1].item()
                    raw.cfg.attention = "document"
                assert masked == pytest.approx(causal, rel=1e-2)
            finally:
                attention.FUSED_ON_CUDA = True
            del model, raw
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    torch.testing.assert_close(logits[True], logits[False], rtol=2e-3, atol=2e-3)
    wrong = (logits["causal"] - logits[False]).abs().max().item()
    assert wrong > 0.1, wrong  # the control: the tolerance above tells a wrong mask apart
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-2), out
    assert (out[True][1] - out[False][1]).norm() <= 5e-2 * out[False][1].norm()


def test_grouped_experts_on_cuda_in_bf16_and_compiled_follow_the_loop():
    """The grouped kernel (torch._grouped_mm, each expert's rows padded to 16) in bf16, eager
    and compiled, against the per-expert loop: the same outputs and gradients within bf16's
    rounding (families.moe)."""
    from stoker.families.moe import SparseMoE

    torch.manual_seed(0)
    grouped = SparseMoE(256, 128, num_experts=8, top_k=2, norm_topk_prob=True).cuda()
    for p in grouped.parameters():
        torch.nn.init.normal_(p, std=0.05)
    loop = SparseMoE(256, 128, num_experts=8, top_k=2, norm_topk_prob=True, impl="loop").cuda()
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(4, 128, 256, device="cuda")
    results = []
    for m in (loop, grouped, torch.compile(grouped)):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = m(xi)
        y.float().square().mean().backward()
        results.append((y.float(), xi.grad.clone()))
        m.zero_grad(set_to_none=True)
    for y, g in results[1:]:
        torch.testing.assert_close(y, results[0][0], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(g, results[0][1], atol=2e-2, rtol=2e-2)
