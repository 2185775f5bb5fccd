"""The plan before a run spends anything (stoker.arithmetic.plan, `stoker plan`, preflight): the
table, the refusal of a config that cannot fit with its cheapest fix, the choice of
train.micro_batch_size 'auto'. Fast (torch only for a model on the meta device); the estimate against torch's memory
tracker is tests/training/test_plan_memory.py."""

import pytest
import torch

from stoker.arithmetic import plan as plans
from stoker.cli import main
from stoker.config import load_config
from stoker.families import build_model
from stoker.preflight import plan_problems

H100 = plans.Hardware.named("H100")


def test_every_recipe_has_a_plan_and_its_table():
    for name in (
        "tiny-cpu",
        "gpt2-124m",
        "gpt2-124m-1gpu",
        "llama-3.2-1b",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen3-0.6b",
        "qwen3-30b-a3b",
    ):
        cfg = load_config(name)
        p = plans.plan(cfg, H100)
        table = p.table()
        for row in (
            "weights (fp32)",
            "gradients (fp32)",
            "optimizer (AdamW, fp32)",
            "activations",
            "allocator reserve",
        ):
            assert row in table, (name, table)
        assert "step time" in table and "wall time" in table  # an H100's peak is known
        assert p.tokens_per_step == cfg.train.global_batch_size * cfg.model.block_size


def test_a_mixtures_plan_counts_its_experts_and_the_all_to_all_of_expert_parallel():
    cfg = load_config("qwen3-30b-a3b")
    p = plans.plan(cfg, H100)
    assert p.params == pytest.approx(30.53e9, rel=1e-3)  # Qwen3-30B-A3B's published 30.5B
    assert p.active_params < p.params / 9 and p.fits
    assert "16 experts a device" in p.experts and p.all_to_all > 0
    alone = plans.plan(cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"ep_degree": 1})}), H100)
    assert alone.all_to_all == 0 and alone.working > p.working  # every expert gathered without EP
    assert alone.flops_per_token == p.flops_per_token  # the same active parameters a token


def test_the_parts_follow_the_parallelism_and_the_checkpointing():
    cfg = load_config("gpt2-124m")
    ddp = plans.plan(cfg, H100, parallelism="ddp")
    fsdp = plans.plan(cfg, H100, parallelism="fsdp")
    world = cfg.launch.world_size
    assert ddp.optimizer == 2 * ddp.weights == 8 * ddp.params  # two fp32 moments a parameter
    assert fsdp.weights == pytest.approx(ddp.weights / world) and fsdp.working > 0 == ddp.working
    full = plans.plan(cfg, H100, activation_checkpointing="full")
    selective = plans.plan(cfg, H100, activation_checkpointing="selective")
    none = plans.plan(cfg, H100, activation_checkpointing="none")
    assert full.activations < selective.activations < none.activations
    # the FLOPs per token are the model's own (its family's flops_per_token), for every family:
    # the section's count of the parameters against the module's
    for name in ("gpt2-124m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-30b-a3b"):
        recipe = load_config(name)
        with torch.device("meta"):
            model = build_model(recipe.model, recipe.tokenizer.vocab_size, None)
        shape = plans.shape_of(recipe)
        attention = 12 * shape.layers * shape.attention_width * shape.block
        # a mixture's FLOPs are of the parameters a token runs (its k experts of each layer's E)
        counted = model.num_active_params() if hasattr(model, "num_active_params") else model.num_params()
        assert plans.plan(recipe, H100).flops_per_token == 6 * counted + attention, name
        assert model.flops_per_token() == plans.plan(recipe, H100).flops_per_token, name
        assert shape.params == sum(p.numel() for p in model.parameters()), name
    # the time at the stated MFU, and the cost at the price of an accelerator-hour
    priced = plans.plan(
        cfg.model_copy(update={"cost": cfg.cost.model_copy(update={"per_accelerator_hour": 2.0})}), H100
    )
    assert priced.cost == pytest.approx(priced.wall_seconds / 3600 * world * 2.0)


def _with(cfg, **sections):
    return cfg.model_copy(update={k: getattr(cfg, k).model_copy(update=v) for k, v in sections.items()})


def test_a_config_that_cannot_fit_is_refused_with_the_cheapest_fix():
    # 8B under ddp: 16 bytes a parameter of weights, gradients and AdamW (~120 GiB) on each
    # H100; FSDP over the node's 8 shards them
    eight = _with(load_config("llama-3.1-8b"), engine={"parallelism": "ddp"})
    (line,) = plan_problems(eight)
    assert line.startswith("engine.parallelism: the plan of this run needs") and "H100" in line, line
    assert "set it to 'fsdp'" in line, line
    assert plan_problems(load_config("llama-3.1-8b")) == []  # the recipe itself fits
    # 70B on one node: no setting of 8 GPUs holds its state (~1.1 TB): more devices is the fix
    seventy = _with(
        load_config("llama-3.1-70b"), engine={"parallelism": "ddp", "tp_degree": 1}, launch={"num_nodes": 1}
    )
    (line,) = plan_problems(seventy)
    assert line.startswith("launch.num_nodes:") and "shard it over" in line, line
    assert plan_problems(load_config("llama-3.1-70b")) == []


def test_a_micro_batch_too_large_names_the_largest_that_fits():
    cfg = load_config("gpt2-124m")
    big = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"micro_batch_size": 60, "global_batch_size": 480})}
    )
    line = plans.fit_problem(big, plans.Hardware.named("A10G"))
    assert line.startswith("train.micro_batch_size:") and "(or 'auto')" in line, line
    m = int(line.split("; use ")[1].split()[0])
    assert plans.plan(big, plans.Hardware.named("A10G"), micro_batch=m).fits
    bigger = [n for n in plans.micro_batches(big) if n > m]
    assert not plans.plan(big, plans.Hardware.named("A10G"), micro_batch=min(bigger)).fits


def test_auto_keeps_the_global_batch_and_picks_the_largest_that_fits():
    cfg = load_config("gpt2-124m")
    auto = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": "auto"})})
    for hw in (plans.Hardware.named("A10G"), H100, plans.Hardware.named("H200")):
        m = plans.auto_micro_batch(auto, hw)
        per_rank = cfg.train.global_batch_size // cfg.launch.world_size
        assert per_rank % m == 0 and plans.plan(auto, hw, micro_batch=m).fits
        assert all(not plans.plan(auto, hw, micro_batch=n).fits for n in plans.micro_batches(auto) if n > m)
    assert plans.auto_micro_batch(auto, plans.Hardware.named("A10G")) < plans.auto_micro_batch(auto, H100)


def test_an_unknown_accelerator_needs_its_memory_in_one_line():
    cfg = load_config("gpt2-124m", launch={"accelerator": "TPU-v9"})
    (line,) = plan_problems(cfg)
    assert line.startswith("launch.accelerator: 'TPU-v9' is not a device") and "launch.device_memory_gib" in line
    cfg = load_config("gpt2-124m", launch={"accelerator": "TPU-v9", "device_memory_gib": 96})
    assert plan_problems(cfg) == []


def test_stoker_plan_prints_the_table_and_refuses_what_cannot_fit(capsys):
    assert main(["plan", "--recipe", "llama-3.1-70b"]) == 0
    out = capsys.readouterr().out
    assert "plan of run" in out and "fsdp+tp on 64 device(s)" in out and "total per device" in out
    assert main(["plan", "--recipe", "llama-3.1-70b", "--set", "launch.num_nodes=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "launch.num_nodes: the plan of this run needs" in err, err
