"""The engine on CPU: FSDP2 on two real gloo ranks (torchrun), checkpoints that move between
DDP and FSDP2 in both directions, and the engine settings' config errors."""

import math

import pytest
import torch

from core.config import RunConfig, load_config
from core.failures import ConfigError
from tests.conftest import prepare_shards, run_ranks, tiny_dict, train_losses
from training.engine import Engine, peak_flops

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
    under DDP (DCP reshards). Not bitwise: reduce-scatter sums in another order."""
    ddp = tiny_config(run_name="eng", train={"max_steps": 4},
                      checkpoint={"interval_steps": 2, "keep_latest_k": 10},
                      eval={"interval_steps": 2})
    fsdp = ddp.model_copy(update={"engine": ddp.engine.model_copy(update={"parallelism": "fsdp"})})
    store, shards = prepare_shards(ddp)
    ddp_url, fsdp_url = _write_config(store, ddp, "config"), _write_config(store, fsdp, "config-fsdp")

    a = train_losses(run_ranks(ddp_url, shards.key))  # DDP: checkpoints step-2, step-4
    fresh = run_ranks(fsdp_url, shards.key)  # FSDP2 from scratch: step-2.a1, step-4.a1
    _close(a, train_losses(fresh), [1, 2, 3, 4])
    assert any(e["event"] == "checkpoint" and e["step"] == 4 for e in fresh)

    c = train_losses(run_ranks(fsdp_url, shards.key, resume=CKPT.format(2)))  # DDP -> FSDP2
    assert sorted(c) == [3, 4]
    _close(a, c, [3, 4])
    d = train_losses(run_ranks(ddp_url, shards.key, resume=CKPT.format(2) + ".a1"))  # FSDP2 -> DDP
    assert sorted(d) == [3, 4]
    _close(a, d, [3, 4])


def test_engine_settings_resolve_for_the_device():
    cfg = RunConfig()
    cpu = Engine.resolve(cfg, torch.device("cpu"))
    assert (cpu.bf16, cpu.compile, cpu.fused, cpu.fsdp, cpu.prefetch) == (False, False, False, False, True)
    on = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={
        "precision": "bf16", "compile": "on", "parallelism": "fsdp", "activation_checkpointing": "full"})})
    e = Engine.resolve(on, torch.device("cpu"))
    assert (e.bf16, e.compile, e.fsdp, e.activation_checkpointing) == (True, True, True, True)
    assert peak_flops(torch.device("cpu")) is None  # tokens/s only


def test_fused_optimizer_on_cpu_is_one_clear_error():
    cfg = load_config(tiny_dict("file:///tmp/x", engine={"fused_optimizer": "on"}))
    with pytest.raises(ConfigError, match="engine.fused_optimizer: .*use 'auto' or 'off'"):
        Engine.resolve(cfg, torch.device("cpu"))


@pytest.mark.parametrize("field,value,expect", [
    ("precision", "fp16", "engine.precision"),
    ("compile", "yes", "engine.compile"),
    ("parallelism", "tp", "engine.parallelism"),
    ("activation_checkpointing", "some", "engine.activation_checkpointing"),
])
def test_bad_engine_settings_are_named_with_their_choices(field, value, expect):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict("file:///tmp/x", engine={field: value}))
    assert expect in str(err.value)


def test_vocab_padding_is_validated_and_engine_is_not_part_of_the_run_identity():
    with pytest.raises(ConfigError, match="model.vocab_pad_multiple"):
        load_config(tiny_dict("file:///tmp/x", model={"vocab_pad_multiple": 0}))
    a = load_config(tiny_dict("file:///tmp/x"))
    b = load_config(tiny_dict("file:///tmp/x", engine={"parallelism": "fsdp", "compile": "on"}))
    assert a.identity_hash() == b.identity_hash()  # a run may resume with other engine settings
    c = load_config(tiny_dict("file:///tmp/x", model={"vocab_pad_multiple": 64}))
    assert a.model_hash() != c.model_hash()  # but padding changes the model's shape
