"""A learning rate made for the base (issue 53): a run from a base (model.init_from) whose config
writes no train.lr re-warms and holds ('wsd') to a tenth of the peak a base of its width was
pretrained at (stoker.arithmetic.learning_rate), said in the plan with the number and where it
came from; a rate the user wrote wins, and so do the schedule fields they wrote; without a base
the default recipe's rate is unchanged. The base is SmolLM2-135M's shape (576 wide, 9/3 heads of
64, an MLP of 1536, tied) with one of its 30 layers, saved here by transformers' save_pretrained
with the tiny chat base's tokenizer (never the Hub). Fast: the base's files are read, nothing
trains."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import yaml

from stoker.cli import main
from stoker.config import RECIPES_DIR, ConfigError, RunConfig, build_config, load_config
from stoker.storage.bases import resolve_base
from tests.bases import tiny_base

SMOLLM2_135M_LR = 0.1 * 3e-4 * 4096 / 576  # a tenth of the rule's peak at width 576: 2.13e-4


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """A base of SmolLM2-135M's shape, one layer deep: its config.json says what the rate reads."""
    import torch
    import transformers

    chat = tiny_base(tmp_path_factory, "chat")
    folder = shutil.copytree(chat, tmp_path_factory.mktemp("smollm2-135m") / "base")
    for path in glob.glob(os.path.join(folder, "model*.safetensors*")):
        os.remove(path)
    hf = json.load(open(os.path.join(chat, "config.json")))
    shape = transformers.LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=hf["eos_token_id"],
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(shape, dtype=torch.bfloat16).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def sets(tmp_path, smol):
    text = tmp_path / "text"
    text.mkdir()
    (text / "doc.txt").write_text("The court held that the clause binds both parties.")
    return {"model.init_from": smol, "data.source": str(text), "storage.root": f"file://{tmp_path}/store"}


def _plan(capsys, sets: dict, *more: str) -> str:
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    assert main(["plan", *args, *more]) == 0
    return capsys.readouterr().out


def test_a_base_with_no_rate_written_rewarms_and_holds_at_a_tenth_of_its_peak_said_in_the_plan(capsys, sets):
    # `stoker plan --set model.init_from=BASE --set data.source=DIR`, nothing else
    out = _plan(capsys, sets)
    assert (
        "learning rate                  warm-up 20 steps from 0 to 0.000213, stable 0.000213 to step 400, then a "
        "linear decay to 0 at step 500 (trained longer as the same run, from a checkpoint before step 400)"
    ) in out, out
    assert (
        "learning rate from             the base (no train.lr written): 0.000213 = 0.1 x 0.00213, the peak learning "
        "rate of a base 576 wide (min(0.003, 1.2288 / 576), calibrated on the published peaks of Llama 3, Qwen "
        "and SmolLM2: stoker.arithmetic.learning_rate); write train.lr to choose another"
    ) in out, out
    assert "0.003" not in out.split("learning rate ")[1].split("\n")[0]  # not the default recipe's rate
    # the config the ranks read: the rate set once the base is read, one run before and after
    loaded = build_config("tiny-cpu", **sets)
    cfg = resolve_base(loaded)
    t = cfg.train
    assert (t.lr_from_base, t.lr_schedule, t.decay_steps, t.min_lr) == (True, "wsd", 100, 0.0)
    assert t.lr == pytest.approx(SMOLLM2_135M_LR) and cfg.model.n_embd == 576
    assert cfg.resolved_run_name() == loaded.resolved_run_name()
    again = RunConfig.model_validate(json.loads(cfg.to_json()))  # config.json, as every rank reads it
    assert again.train == t and again.resolved_run_name() == cfg.resolved_run_name()
    # a deployment's parameters (prefect.yaml: the recipe's values and its name) with the base added
    params = {**yaml.safe_load((RECIPES_DIR / "tiny-cpu.yaml").read_text()), "recipe": "tiny-cpu"}
    params["model"]["init_from"] = sets["model.init_from"]
    params["data"]["source"], params["storage"] = sets["data.source"], {"root": sets["storage.root"]}
    assert resolve_base(RunConfig.model_validate(params)).train.lr == pytest.approx(SMOLLM2_135M_LR)


def test_a_rate_the_user_wrote_wins_and_so_do_the_schedule_fields_they_wrote(capsys, sets, tmp_path):
    out = _plan(capsys, sets, "--set", "train.lr=1e-4", "--set", "train.min_lr=1e-5")
    assert "learning rate                  warm-up 20 steps from 0 to 0.0001, then cosine to 1e-05 at step 500" in out
    assert (
        "learning rate from             train.lr as the config writes it (the base's default would be 0.000213" in out
    )
    # the default recipe's own value, written by the user, is theirs too
    cfg = resolve_base(build_config("tiny-cpu", **sets, **{"train.lr": 3e-3}))
    assert (cfg.train.lr, cfg.train.lr_schedule, cfg.train.min_lr, cfg.train.lr_from_base) == (
        3e-3,
        "cosine",
        3e-4,
        False,
    )
    assert load_config("tiny-cpu", **sets, train={"lr": 3e-3}).train.lr_from_base is False
    # a YAML file of their own: every field in it is theirs
    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  lr: 3.0e-3\n  min_lr: 3.0e-4\n")
    assert resolve_base(build_config(str(mine), **sets)).train.lr == 3e-3
    # a schedule field they wrote stays, with the base's rate
    cfg = resolve_base(build_config("tiny-cpu", **sets, **{"train.lr_schedule": "constant", "train.min_lr": 1e-5}))
    assert (cfg.train.lr_schedule, cfg.train.min_lr, cfg.train.decay_steps) == ("constant", 1e-5, None)
    assert cfg.train.lr == pytest.approx(SMOLLM2_135M_LR)
    # a recipe written for a base keeps its rate (llama-3.1-8b: 3e-5, for its own base)
    recipe = load_config("llama-3.1-8b")
    assert (recipe.train.lr_from_base, recipe.train.lr, recipe.train.lr_schedule) == (False, 3e-5, "cosine")


def test_without_a_base_the_default_recipes_rate_is_unchanged(capsys, sets):
    out = _plan(capsys, {k: v for k, v in sets.items() if k != "model.init_from"})
    assert "learning rate                  warm-up 20 steps from 0 to 0.003, then cosine to 0.0003 at step 500\n" in out
    assert "learning rate from" not in out
    cfg = load_config("tiny-cpu", **{"data.source": sets["data.source"]})
    assert (cfg.train.lr, cfg.train.lr_schedule, cfg.train.min_lr, cfg.train.lr_from_base) == (
        3e-3,
        "cosine",
        3e-4,
        None,
    )
    assert (
        cfg.resolved_run_name() == load_config("tiny-cpu", **{"data.source": sets["data.source"]}).resolved_run_name()
    )
    with pytest.raises(ConfigError) as err:  # the base's rate asked for, with no base
        load_config("tiny-cpu", **{"data.source": sets["data.source"], "train.lr_from_base": True})
    assert err.value.problems == [
        "train.lr_from_base: is true, and the run starts from no base (model.init_from is empty) (got True); leave "
        "it empty, and write train.lr to choose the rate."
    ]
