"""The engine on CPU: FSDP2 on two real gloo ranks (forked: tests.forked_ranks), checkpoints that move between
DDP and FSDP2 in both directions, and the engine settings' config errors."""

import math

import pytest
import torch

from stoker.config import RunConfig, load_config
from stoker.failures import ConfigError
from stoker.training.engine import Engine, peak_flops
from tests.conftest import prepare_shards, tiny_dict, train_losses
from tests.forked_ranks import run_forked

CKPT = "runs/eng/checkpoints/step-{:08d}"


def _write_config(store, cfg, name):
    key = f"runs/eng/{name}.json"
    store.write_bytes(key, cfg.to_json().encode())
    return store.url(key)


def _close(a: dict, b: dict, steps, tol=2e-4):
    for s in steps:
        assert math.isclose(a[s], b[s], rel_tol=tol, abs_tol=tol), (s, a[s], b[s])


def test_fsdp2_on_two_gloo_ranks_trains_like_ddp_and_checkpoints_move_both_ways(tiny_config):
    """FSDP2 starts from the same weights as DDP (meta-device build, then init by name) and
    follows the same losses; a DDP checkpoint resumes under FSDP2 and an FSDP2 checkpoint
    under DDP (DCP reshards). Not bitwise: reduce-scatter sums in another order. The FSDP2 runs
    also checkpoint activations selectively (recomputing changes no value) and compute the
    loss in uneven chunks (within rounding of the full logits')."""
    ddp = tiny_config(
        run_name="eng",
        train={"max_steps": 4},
        checkpoint={"interval_steps": 2, "keep_latest_k": 10},
        eval={"interval_steps": 2},
    )
    fsdp = ddp.model_copy(
        update={
            "engine": ddp.engine.model_copy(
                update={
                    "parallelism": "fsdp",
                    "activation_checkpointing": "selective",
                    "cross_entropy": "chunked",
                    "cross_entropy_chunk": 100,
                }
            )
        }
    )
    store, shards = prepare_shards(ddp)
    ddp_url, fsdp_url = _write_config(store, ddp, "config"), _write_config(store, fsdp, "config-fsdp")

    a = train_losses(run_forked(ddp_url, shards.key))  # DDP: checkpoints step-2, step-4
    fresh = run_forked(fsdp_url, shards.key)  # FSDP2 from scratch: step-2.a1, step-4.a1
    _close(a, train_losses(fresh), [1, 2, 3, 4])
    assert any(e["event"] == "checkpoint" and e["step"] == 4 for e in fresh)

    c = train_losses(run_forked(fsdp_url, shards.key, resume=CKPT.format(2)))  # DDP -> FSDP2
    assert sorted(c) == [3, 4]
    _close(a, c, [3, 4])
    d = train_losses(run_forked(ddp_url, shards.key, resume=CKPT.format(2) + ".a1"))  # FSDP2 -> DDP
    assert sorted(d) == [3, 4]
    _close(a, d, [3, 4])


def test_engine_settings_resolve_for_the_device():
    cfg = RunConfig()
    cpu = Engine.resolve(cfg, torch.device("cpu"))
    assert (cpu.bf16, cpu.compile, cpu.fused, cpu.fsdp, cpu.prefetch) == (False, False, False, False, True)
    on = cfg.model_copy(
        update={
            "engine": cfg.engine.model_copy(
                update={
                    "precision": "bf16",
                    "compile": "on",
                    "parallelism": "fsdp",
                    "activation_checkpointing": "full",
                    "cross_entropy": "chunked",
                }
            )
        }
    )
    e = Engine.resolve(on, torch.device("cpu"))
    assert (e.bf16, e.compile, e.fsdp, e.activation_checkpointing) == (True, True, True, "full")
    assert (cpu.loss_chunk, e.loss_chunk) == (0, on.engine.cross_entropy_chunk)
    assert peak_flops(torch.device("cpu")) is None  # tokens/s only


def test_fused_optimizer_on_cpu_is_one_clear_error():
    cfg = load_config(tiny_dict("file:///tmp/x", engine={"fused_optimizer": "on"}))
    with pytest.raises(ConfigError, match="engine.fused_optimizer: .*use 'auto' or 'off'"):
        Engine.resolve(cfg, torch.device("cpu"))


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("precision", "fp16", "engine.precision"),
        ("compile", "yes", "engine.compile"),
        ("parallelism", "tp", "engine.parallelism"),
        ("tp_degree", 0, "engine.tp_degree"),
        ("tp_degree", 2, "engine.tp_degree: splits the model over ranks"),  # with 'ddp'
        ("parallelism", "fsdp+tp", "engine.tp_degree: is 1"),  # tests/training/test_tensor_parallel.py: the rest
        ("activation_checkpointing", "some", "engine.activation_checkpointing"),
        ("cross_entropy", "fused", "engine.cross_entropy"),
        ("compile_tuning", "fast", "engine.compile_tuning"),
        ("cross_entropy_chunk", 0, "engine.cross_entropy_chunk"),
    ],
)
def test_bad_engine_settings_are_named_with_their_choices(field, value, expect):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict("file:///tmp/x", engine={field: value}))
    assert expect in str(err.value)


def test_on_and_off_mean_the_words_where_yaml_reads_booleans(tmp_path):
    """`--set engine.compile=off` and `compile: on` in a recipe reach the config as YAML's
    false and true; for the on/off settings they are the words, not a type error."""
    import yaml

    cfg = load_config(
        "tiny-cpu", **{"engine.compile": yaml.safe_load("off"), "engine.fused_optimizer": yaml.safe_load("on")}
    )
    assert (cfg.engine.compile, cfg.engine.fused_optimizer) == ("off", "on")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("engine:\n  compile: on\n  fused_optimizer: off\n")
    cfg = load_config(str(recipe))
    assert (cfg.engine.compile, cfg.engine.fused_optimizer) == ("on", "off")
    with pytest.raises(ConfigError, match="engine.tf32"):  # a real boolean field stays one
        load_config("tiny-cpu", **{"engine.tf32": "sometimes"})


def test_compile_tuning_needs_a_compile_and_sets_inductor_before_it():
    """engine.compile_tuning with compile 'off' is a config error; with 'auto' on a CPU (no
    compile there) one at the rank, naming the field; with compile on, coordinate-descent
    tuning is inductor's setting when the model is compiled, and max-autotune its mode."""
    import torch._inductor.config as inductor

    from stoker.training.engine import build_model, compile_options

    with pytest.raises(
        ConfigError, match="engine.compile_tuning: tunes torch.compile, which engine.compile turns off .*use 'none'"
    ):
        load_config(tiny_dict("file:///tmp/x", engine={"compile": "off", "compile_tuning": "max-autotune"}))
    auto = load_config(tiny_dict("file:///tmp/x", engine={"compile_tuning": "coordinate-descent"}))
    with pytest.raises(ConfigError, match="engine.compile_tuning: .*'auto' leaves off on CPUs"):
        Engine.resolve(auto, torch.device("cpu"))
    on = load_config(tiny_dict("file:///tmp/x", engine={"compile": "on", "compile_tuning": "coordinate-descent"}))
    engine = Engine.resolve(on, torch.device("cpu"))
    assert engine.describe()["compile_tuning"] == "coordinate-descent"
    try:
        build_model(on, 384, engine, 1)
        assert inductor.coordinate_descent_tuning is True
        assert compile_options("max-autotune") == {"mode": "max-autotune-no-cudagraphs"}
        assert inductor.coordinate_descent_tuning is False
    finally:
        inductor.coordinate_descent_tuning = False


def test_vocab_padding_is_validated_and_engine_is_not_part_of_the_run_identity():
    with pytest.raises(ConfigError, match="model.vocab_pad_multiple"):
        load_config(tiny_dict("file:///tmp/x", model={"vocab_pad_multiple": 0}))
    a = load_config(tiny_dict("file:///tmp/x"))
    b = load_config(tiny_dict("file:///tmp/x", engine={"parallelism": "fsdp", "compile": "on"}))
    assert a.identity_hash() == b.identity_hash()  # a run may resume with other engine settings
    c = load_config(tiny_dict("file:///tmp/x", model={"vocab_pad_multiple": 64}))
    assert a.model_hash() != c.model_hash()  # but padding changes the model's shape


def _split(cfg, nproc: int, micro: int):
    return cfg.model_copy(
        update={
            "launch": cfg.launch.model_copy(update={"nproc_per_node": nproc}),
            "train": cfg.train.model_copy(update={"micro_batch_size": micro}),
        }
    )


def test_resume_at_another_world_size_trains_on_the_same_windows(tiny_config):
    """2 ranks -> 1 and 1 -> 2 (micro-batch changed too): each step draws its whole global
    batch from (seed, step), so the resumed steps see the same windows and their losses stay
    within float-reduction noise of the unbroken run; RNG streams are re-seeded (reported)."""
    two = tiny_config(
        run_name="eng",
        train={"max_steps": 4},
        checkpoint={"interval_steps": 2, "keep_latest_k": 10},
        eval={"interval_steps": 2},
    )
    one = _split(two, 1, 4)
    assert one.identity_hash() == two.identity_hash()  # the same run, split otherwise
    store, shards = prepare_shards(two)
    two_url, one_url = _write_config(store, two, "config-2"), _write_config(store, one, "config-1")

    a = train_losses(run_forked(two_url, shards.key))  # step-2, step-4
    b_events = run_forked(one_url, shards.key, resume=CKPT.format(2), nproc=1)  # 2 -> 1
    assert [e["rng_restored"] for e in b_events if e["event"] == "resumed"] == [False]
    _close(a, train_losses(b_events), [3, 4], tol=1e-5)

    c = train_losses(run_forked(one_url, shards.key, nproc=1))  # step-2.a1, step-4.a1
    _close(a, c, [1, 2, 3, 4], tol=1e-5)
    d = train_losses(run_forked(two_url, shards.key, resume=CKPT.format(2) + ".a1"))  # 1 -> 2
    _close(c, d, [3, 4], tol=1e-5)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(mode):
    """Recomputing in the backward pass changes no value: the loss is bitwise equal and so
    are the gradients (with dropout on: the recomputation replays the same RNG draws)."""
    from stoker.families.gpt2.config import GPT2Config
    from stoker.families.gpt2.model import GPT
    from stoker.families.layers import checkpoint_blocks

    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1)
    x = torch.randint(0, 100, (3, 16))
    grads = []
    for ac in ("none", mode):
        model = GPT(cfg, 100, seed=3)
        checkpoint_blocks(model.blocks, ac)
        torch.manual_seed(7)
        _, loss = model(x, x)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(g, h) for g, h in zip(grads[0][1], grads[1][1]))


def _peak_of_a_step(vocab: int, ac: str = "none", loss_chunk: int = 0) -> dict:
    """MemTracker's peak of one training step of a small GPT, by kind of memory (and Total)."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    from stoker.families.gpt2.config import GPT2Config
    from stoker.families.gpt2.model import GPT
    from stoker.families.layers import checkpoint_blocks

    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=64, block_size=64, dropout=0.0)
    x = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    model = GPT(cfg, vocab, seed=0)
    model.loss_chunk = loss_chunk
    checkpoint_blocks(model.blocks, ac)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model)
    with tracker:
        _, loss = model(x, x)
        loss.backward()
    (stats,) = tracker.get_tracker_snapshot("peak").values()
    return {str(kind).rsplit(".", 1)[-1]: n for kind, n in stats.items()}


def test_selective_checkpointing_holds_less_than_none_and_more_than_full():
    """Peak activation memory of a training step (torch's MemTracker, which counts every
    tensor by what it is): full < selective < none."""
    peak = {mode: _peak_of_a_step(64, ac=mode)["ACT"] for mode in ("none", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["none"], peak


def _loss_and_grads(model, x, y, autocast: bool = False):
    torch.manual_seed(7)  # the same dropout draws
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, loss = model(x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk", [7, 48, 1000])  # uneven chunks, one per batch row, one for all
def test_chunked_cross_entropy_gives_the_loss_and_gradients_of_the_full_logits(chunk):
    """engine.cross_entropy 'chunked' computes the output matmul and the loss a chunk of
    tokens at a time, its gradient in the forward pass: the loss and every gradient (the tied
    embedding's included) equal the full logits' up to fp32 rounding, with dropout on; the
    evaluation path (no grad) gives the same loss."""
    from stoker.families.gpt2.config import GPT2Config
    from stoker.families.gpt2.model import GPT

    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1)
    x, y = torch.randint(0, 100, (3, 16)), torch.randint(0, 100, (3, 16))
    full = GPT(cfg, 100, seed=3)
    chunked = GPT(cfg, 100, seed=3)
    chunked.loss_chunk = chunk
    (loss, grads), (c_loss, c_grads) = _loss_and_grads(full, x, y), _loss_and_grads(chunked, x, y)
    torch.testing.assert_close(c_loss, loss)
    for (name, _), g, h in zip(full.named_parameters(), grads, c_grads):
        torch.testing.assert_close(h, g, msg=name)
    full.eval(), chunked.eval()
    with torch.no_grad():
        torch.testing.assert_close(chunked(x, y)[1], full(x, y)[1])


def test_chunked_cross_entropy_under_bf16_autocast_stays_close_to_the_full_logits():
    """Under bf16 autocast both paths run the matmuls in bf16 and the log-softmax in fp32; the
    chunked one adds its chunks' weight gradients in fp32, so they differ by bf16 rounding."""
    from stoker.families.gpt2.config import GPT2Config
    from stoker.families.gpt2.model import GPT

    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, block_size=32, dropout=0.0)
    x, y = torch.randint(0, 500, (4, 32)), torch.randint(0, 500, (4, 32))
    chunked = GPT(cfg, 500, seed=3)
    chunked.loss_chunk = 24
    (loss, grads), (c_loss, c_grads) = (
        _loss_and_grads(GPT(cfg, 500, seed=3), x, y, True),
        _loss_and_grads(chunked, x, y, True),
    )
    assert c_loss.item() == pytest.approx(loss.item(), rel=1e-3)
    for g, h in zip(grads, c_grads):
        assert h.dtype == g.dtype == torch.float32
        assert (h - g).norm() <= 2e-2 * g.norm()


def test_chunked_cross_entropy_holds_less_memory_than_the_full_logits():
    """Peak memory of a training step (MemTracker): the full logits, their fp32 copy and their
    gradient dominate at a large vocabulary; chunked, only one chunk's exist at a time."""
    peak = {chunk: _peak_of_a_step(4096, loss_chunk=chunk)["Total"] for chunk in (0, 64)}
    assert peak[64] < 0.6 * peak[0], peak
