"""engine.parallelism 'fsdp+tp' (training.parallel: FSDP2 over "dp" and tensor parallel over
"tp" of a 2D mesh, torchtitan's Llama plan) on CPU ranks with gloo (forked: tests.forked_ranks).

torchtitan's convergence discipline: the same global batch (8 sequences a step) under every
mesh, so the same tokens each step, and the losses of 10 steps compared with plain FSDP2 on 2
ranks (each rank 4 sequences). Under tensor parallel a group of tp_degree ranks reads the same
micro-batches (the split is over the "dp" coordinate), so fsdp+tp on 2 ranks is 1 replica of
2 ranks that takes all 8 sequences, and on 4 ranks 2 replicas of 2 ranks, 4 sequences each.
(Gradient clipping, whose scale AdamW's updates hardly see, is checked on its own: one
step's global gradient norm equals one process's.)

One module run set (`runs`) serves the tests: plain FSDP2 on 2 ranks, fsdp+tp on 2 ranks (1x2)
and on 4 ranks (2x2), each 10 steps with checkpoints at 5 and 10, and the 2x2 run's step-5
checkpoint resumed under plain FSDP2 on 2 ranks.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.config import load_config
from stoker.failures import ConfigError
from stoker.storage.checkpoints import COMMIT_FILE
from tests.conftest import prepare_shards, tiny_dict, train_losses
from tests.forked_ranks import run_forked

# every size tp_degree 2 divides: 4 query heads, 2 key/value heads, an MLP of 64, 32 positions
LLAMA = {
    "family": "llama",
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "n_embd": 32,
    "intermediate_size": 64,
    "block_size": 32,
}
STEPS = 10
HALF = STEPS // 2  # the checkpoint (and evaluation) interval: the resume point
# Not bitwise: under tensor parallel the o/down_proj matmuls sum their halves in an
# all-reduce, the loss sums the vocabulary's halves, and FSDP2's reduce-scatter adds other
# ranks' gradients: each an fp32 rounding (~1e-7 relative) in another order. Measured on this
# host over 20 steps of AdamW at lr 1e-2 (the runs were 20 steps long then): at most 1.5e-6
# apart on losses near 5 (a few ulps, grown by the updates; less over 10 steps). 1e-4 absolute
# is ~70x that and far below what a fault moves (the embedding left without its gradient by a
# compiled block moved step 2's loss by 0.2).
TOL = dict(rtol=0.0, atol=1e-4)
TIMES: dict[str, float] = {}


def _run(store, shards, cfg, name: str, nproc: int, resume: str | None = None) -> list[dict]:
    key = f"runs/{cfg.run_name}/{name}.json"
    store.write_bytes(key, cfg.to_json().encode())
    began = time.monotonic()
    records = run_forked(store.url(key), shards.key, resume=resume, nproc=nproc)
    TIMES[name] = round(time.monotonic() - began, 1)
    return records


def _config(root: str, run_name: str, nproc: int, **engine):
    return load_config(
        tiny_dict(
            root,
            run_name=run_name,
            model=LLAMA,
            engine=engine,
            launch={"nproc_per_node": nproc},
            train={"max_steps": STEPS, "micro_batch_size": 4},
            checkpoint={"interval_steps": HALF, "keep_latest_k": 4},
            eval={"interval_steps": HALF},
        )
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (config, records)} of the module's runs, and the store."""
    root = "file://" + str(tmp_path_factory.mktemp("tp") / "store")
    fsdp = _config(root, "tp-fsdp", 2, parallelism="fsdp")
    tp_1x2 = _config(root, "tp-1x2", 2, parallelism="fsdp+tp", tp_degree=2)
    tp_2x2 = _config(root, "tp-2x2", 4, parallelism="fsdp+tp", tp_degree=2)
    # the 2x2 run, resumed under plain FSDP2 on 2 ranks (the engine and launch are no part of
    # a run's identity: the same run)
    resumed = _config(root, "tp-2x2", 2, parallelism="fsdp")
    store, shards = prepare_shards(fsdp)
    out = {
        "fsdp": (fsdp, _run(store, shards, fsdp, "fsdp", 2)),
        "1x2": (tp_1x2, _run(store, shards, tp_1x2, "1x2", 2)),
        "2x2": (tp_2x2, _run(store, shards, tp_2x2, "2x2", 4)),
    }
    out["resumed"] = (
        resumed,
        _run(store, shards, resumed, "resumed", 2, resume=f"runs/tp-2x2/checkpoints/step-{HALF:08d}"),
    )
    print(f"wall seconds of each run: {TIMES}")
    for name, (_, records) in out.items():
        print(name, {s: round(v, 7) for s, v in train_losses(records).items()}, _val_losses(records))
    return out, store


def _losses(records) -> torch.Tensor:
    losses = train_losses(records)
    return torch.tensor([losses[s] for s in sorted(losses)], dtype=torch.float64)


def _val_losses(records) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records if r["event"] == "eval"}


def _tensors(path: str) -> dict[str, torch.Tensor]:
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if not k.startswith("rng.")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def test_fsdp_tp_on_2_and_4_ranks_trains_like_plain_fsdp2(runs):
    """The same 10 losses as plain FSDP2 with the same global batch, on a 1x2 and a 2x2 mesh;
    the same validation losses (at 0, 5, 10) on the 2x2 mesh, whose 2 replicas take the
    reference's windows (eval.num_batches are a replica's: 1x2 evaluates half as many); the
    checkpoints say the run was tensor parallel."""
    out, store = runs
    reference = _losses(out["fsdp"][1])
    assert len(reference) == STEPS
    for mesh in ("1x2", "2x2"):
        cfg, records = out[mesh]
        torch.testing.assert_close(_losses(records), reference, **TOL, msg=lambda m, mesh=mesh: f"{mesh}: {m}")
        val, ref_val = _val_losses(records), _val_losses(out["fsdp"][1])
        assert sorted(val) == sorted(ref_val) == [0, HALF, STEPS]
        if mesh == "2x2":
            for step in val:
                assert val[step] == pytest.approx(ref_val[step], abs=TOL["atol"]), (mesh, step)
        manifest = json.dumps(store.read_json(f"runs/{cfg.run_name}/checkpoints/step-{HALF:08d}/{COMMIT_FILE}"))
        assert '"parallelism": "fsdp+tp"' in manifest and '"tp_degree": 2' in manifest, manifest


def test_a_2x2_checkpoint_resumes_under_plain_fsdp2_on_2_ranks(runs):
    """DCP holds the full tensors whatever the mesh: the 2x2 run's step-5 checkpoint has the
    plain FSDP2 run's entries and shapes (and values within the tolerance), and resumes under
    plain FSDP2 on 2 ranks with the unbroken 2x2 run's losses for steps 6-10."""
    out, store = runs
    resumed = train_losses(out["resumed"][1])
    assert sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    whole = train_losses(out["2x2"][1])
    torch.testing.assert_close(
        torch.tensor([resumed[s] for s in sorted(resumed)], dtype=torch.float64),
        torch.tensor([whole[s] for s in sorted(resumed)], dtype=torch.float64),
        **TOL,
    )
    tp = _tensors(store.local_path(f"runs/tp-2x2/checkpoints/step-{HALF:08d}"))
    plain = _tensors(store.local_path(f"runs/tp-fsdp/checkpoints/step-{HALF:08d}"))
    assert tp.keys() == plain.keys() and any(k.startswith("optim.") for k in tp)
    for k in tp:
        assert tp[k].shape == plain[k].shape, k
    for k in (
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.embed_tokens.weight",
    ):
        torch.testing.assert_close(tp[k], plain[k], **TOL)


# ---- refusals: one clear error each, before any compute -------------------------------------
@pytest.mark.parametrize(
    "sections,expect",
    [
        # fsdp+tp needs a group of 2 or more
        ({"engine": {"parallelism": "fsdp+tp"}}, "engine.tp_degree: is 1, and engine.parallelism 'fsdp+tp'"),
        ({"engine": {"parallelism": "fsdp", "tp_degree": 2}}, "engine.tp_degree: splits the model over ranks"),
        ({"engine": {"parallelism": "fsdp+tp", "tp_degree": 0}}, "engine.tp_degree"),
        # the groups must fill the world, each on one node
        (
            {
                "engine": {"parallelism": "fsdp+tp", "tp_degree": 2},
                "launch": {"nproc_per_node": 3},
                "train": {"global_batch_size": 6},
            },
            "engine.tp_degree: does not divide launch.nproc_per_node=3",
        ),
        # gpt2 has no tensor-parallel plan
        (
            {"engine": {"parallelism": "fsdp+tp", "tp_degree": 2}, "model": {"family": "gpt2"}},
            "engine.parallelism: 'fsdp+tp' has a tensor-parallel plan for the llama, qwen3 families only",
        ),
        # the heads, the MLP and the sequence split over the group
        (
            {"engine": {"parallelism": "fsdp+tp", "tp_degree": 2}, "model": {**LLAMA, "n_kv_head": 1}},
            "engine.tp_degree: does not divide model.n_kv_head=1",
        ),
        (
            {"engine": {"parallelism": "fsdp+tp", "tp_degree": 2}, "model": {**LLAMA, "intermediate_size": 65}},
            "does not divide model.intermediate_size=65",
        ),
        (
            {
                "engine": {"parallelism": "fsdp+tp", "tp_degree": 2},
                "model": {**LLAMA, "n_head": 3, "n_kv_head": 3, "n_embd": 48},
            },
            "does not divide model.n_head=3, model.n_kv_head=3",
        ),
        # the loss is vocabulary-parallel, not chunked
        (
            {"engine": {"parallelism": "fsdp+tp", "tp_degree": 2, "cross_entropy": "chunked"}},
            "engine.cross_entropy: 'chunked' is not done under engine.parallelism 'fsdp+tp'",
        ),
        # the global batch is split over the replicas: 2 of 2 ranks at 4 ranks
        (
            {
                "engine": {"parallelism": "fsdp+tp", "tp_degree": 2},
                "launch": {"nproc_per_node": 4},
                "train": {"global_batch_size": 6},
            },
            "train.global_batch_size: is not divisible by world_size / engine.tp_degree (4 / 2) x micro_batch_size",
        ),
    ],
)
def test_tensor_parallel_settings_that_cannot_run_are_one_clear_error(sections, expect):
    sections = {"model": LLAMA, **sections}
    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict("file:///tmp/x", **sections))
    assert expect in str(err.value), str(err.value)
    assert str(err.value).count("\n  - ") == 1, str(err.value)  # one problem, not one per rule


def test_the_batch_is_split_over_the_replicas_not_the_ranks():
    """4 ranks in groups of 2: 2 replicas of 2 sequences a pass; 8 sequences a step is 2
    micro-batches each, where plain FSDP2 on 4 ranks has 1."""
    from stoker.training.parallel import data_parallel

    tp = load_config(
        tiny_dict(
            "file:///tmp/x",
            model=LLAMA,
            engine={"parallelism": "fsdp+tp", "tp_degree": 2},
            launch={"nproc_per_node": 4},
        )
    )
    plain = tp.model_copy(update={"engine": tp.engine.model_copy(update={"parallelism": "fsdp", "tp_degree": 1})})
    assert (tp.data_parallel_size, tp.grad_accum_steps) == (2, 2)
    assert (plain.data_parallel_size, plain.grad_accum_steps) == (4, 1)
    assert [data_parallel(r, 4, 2) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [data_parallel(r, 4, 1) for r in range(4)] == [(r, 4) for r in range(4)]


# ---- one step's numbers against a model in one process --------------------------------------
_CHECKED = (
    "embed_tokens.weight",  # tied: the embedding's and the output's gradients in one
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.1.mlp.down_proj.weight",
    "layers.1.post_attention_layernorm.weight",
    "norm.weight",
)
# qwen3's q and k norms: replicated gains whose gradients sum the heads of both ranks
_CHECKED_QWEN3 = ("layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight")


def _tp_rank(rank: int, world: int, init: str, config_json: str, base: str, out: str) -> None:
    """One rank of a 1x2 mesh: the model built as the trainer builds it from a base (meta
    device, split, each block checkpointed selectively and compiled, sharded), the base read
    slice by slice (row-wise projections split on their columns, 301 vocabulary rows split
    unevenly: 151 + 150), gathered whole; then one step's loss and gradients, and the logits
    without targets. Compiled with AOT autograd's eager backend: torch.compile's front end
    and autograd as inductor gets them, with no code generation (seconds, on a CPU)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import stoker.training.engine as engine_module
    from stoker.config import RunConfig
    from stoker.training.base import load_base
    from stoker.training.engine import Engine, build_model

    engine_module.compile_options = lambda tuning: {"backend": "aot_eager"}
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = RunConfig.model_validate_json(config_json)
        engine = Engine.resolve(cfg, torch.device("cpu"))
        raw, model = build_model(cfg, cfg.tokenizer.vocab_size, engine, world, init=False)
        load_base(raw, cfg.model, base)
        loaded = get_model_state_dict(raw, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        placements = {n: str(p.placements) for n, p in raw.named_parameters()}
        x, y = torch.randint(0, cfg.tokenizer.vocab_size, (2, 2, 32), generator=torch.Generator().manual_seed(1))
        _, loss = model(x, y)
        loss.backward()
        checked = _CHECKED + (_CHECKED_QWEN3 if cfg.model.family == "qwen3" else ())
        grads = {n: raw.get_parameter(n).grad.full_tensor() for n in checked}
        # as the loop clips: the global norm over the 2D-sharded gradients (a DTensor)
        norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), 1e9).full_tensor()
        model.eval()
        with torch.no_grad():
            logits, _ = model(x)
        if rank == 0:
            result = {
                "loaded": loaded,
                "loss": loss.detach(),
                "grads": grads,
                "norm": norm,
                "logits": logits,
                "placements": placements,
            }
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_one_step_under_fsdp_tp_equals_one_process_from_the_same_base(family, tmp_path):
    """For each family with a tensor-parallel plan (qwen3's adds its q and k norms, an explicit
    head_dim of 24 against a width of 32 / 4 heads; its blocks eager). On a 1x2 mesh, from a base (a Hugging Face state dict of a seeded model, 301
    vocabulary rows: an uneven split), compiled blocks with selective activation
    checkpointing: the weights read slice by slice are the base's, tensor for tensor; the
    vocabulary-parallel loss, the gradients (the tied embedding's among them: without the
    copy of the embedding's output, AOT autograd gave it none), the global gradient norm the
    loop clips with and the gathered logits are one process's, up to fp32 rounding in another
    order."""
    import torch.multiprocessing as mp
    from safetensors.torch import save_file

    from stoker.families import build_model, spec_of

    vocab = 301
    cfg = load_config(
        tiny_dict(
            "file:///tmp/unused",
            # compiled blocks once (llama's); qwen3's plan eager, seconds cheaper
            engine={
                "parallelism": "fsdp+tp",
                "tp_degree": 2,
                "compile": "on" if family == "llama" else "off",
                "activation_checkpointing": "selective",
            },
            model={**LLAMA, "vocab_pad_multiple": 1, "family": family}
            | ({"head_dim": 24} if family == "qwen3" else {}),
            tokenizer={"vocab_size": vocab},
        )
    )
    model = build_model(cfg.model, vocab, seed=cfg.train.seed)
    base = tmp_path / "base"
    base.mkdir()
    save_file(spec_of(cfg.model).to_hf(cfg.model, model.state_dict(), vocab), str(base / "model.safetensors"))
    mp.start_processes(
        _tp_rank,
        args=(2, f"file://{tmp_path}/rendezvous", cfg.to_json(), str(base), str(tmp_path / "out.pt")),
        nprocs=2,
        start_method="spawn",
    )
    got = torch.load(tmp_path / "out.pt")

    assert got["loaded"].keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        assert torch.equal(got["loaded"][name], t), name
    # the plan took: row-wise projections split on their columns, column-wise ones on their rows
    assert "Shard(dim=1)" in got["placements"]["layers.0.self_attn.o_proj.weight"]
    assert "Shard(dim=0)" in got["placements"]["layers.0.mlp.gate_proj.weight"]

    x, y = torch.randint(0, vocab, (2, 2, 32), generator=torch.Generator().manual_seed(1))
    _, loss = model(x, y)
    loss.backward()
    # fp32 sums in another order (the row-wise halves, the vocabulary's halves): 1e-5 relative
    # is ~100 ulps, far below a wrong term (a missing half moves them by 10% or more)
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    assert got["grads"].keys() == set(_CHECKED + (_CHECKED_QWEN3 if family == "qwen3" else ()))
    for name in got["grads"]:
        torch.testing.assert_close(got["grads"][name], model.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["norm"], torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], model.eval()(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mode,compile,refused", [("full", "on", True), ("selective", "on", False), ("full", "off", False)]
)
def test_full_checkpointing_of_compiled_tensor_parallel_blocks_is_refused_at_the_rank(mode, compile, refused):
    """torch 2.13's AOT autograd fails on it (a DeviceMesh among the values a checkpointed
    block saves): one clear error before any compute; 'selective', or no compile, runs."""
    from stoker.training.engine import Engine

    engine = {"parallelism": "fsdp+tp", "tp_degree": 2, "compile": compile, "activation_checkpointing": mode}
    cfg = load_config(tiny_dict("file:///tmp/x", model=LLAMA, engine=engine))
    if refused:
        with pytest.raises(ConfigError, match="engine.activation_checkpointing: 'full' under engine.parallelism 'fsdp"):
            Engine.resolve(cfg, torch.device("cpu"))
    else:
        assert Engine.resolve(cfg, torch.device("cpu")).tp == 2
