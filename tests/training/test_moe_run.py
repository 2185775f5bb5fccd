"""A Qwen3-MoE base taken as a user would (made by ``scripts/make_tiny_base.py --style
qwen3-moe``: 8 experts top-2, a dense layer among the sparse ones, the chat tokenizer's
quirks), with nothing set but ``model.init_from`` and ``data.source``: 2 FSDP2 ranks with
document attention; step 0's validation loss is the base's own language-model loss, computed
here independently by transformers on the same validation windows (no router loss in it);
the training loss is the language model's plus router_aux_loss_coef x the load-balancing loss;
the router's load is logged at each log step; the run exports, and transformers reloads the
export with equal tensors and equal logits."""

from __future__ import annotations

import shutil

import pytest
import torch

from stoker.config import load_config
from stoker.storage.bases import resolve_base
from stoker.storage.runs import pin_run_folder
from tests.bases import exported_logits_are_ours, loss_of_documents_alone, short_documents, tiny_base
from tests.conftest import prepare_shards, tiny_dict, train_losses
from tests.forked_ranks import run_forked

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    base = shutil.copytree(tiny_base(tmp_path_factory, "qwen3-moe"), tmp_path_factory.mktemp("moe") / "base")
    root = "file://" + str(tmp_path_factory.mktemp("moe-store") / "store")
    text = short_documents(tmp_path_factory.mktemp("moe-text") / "text")
    sections = tiny_dict(root, run_name="moe", engine={"parallelism": "fsdp"}, train={"max_steps": 4})
    sections["data"] = {"source": text, "val_fraction": 0.1}
    sections["model"] = {"init_from": str(base)}
    del sections["tokenizer"]
    cfg = resolve_base(load_config(sections))
    store, shards = prepare_shards(cfg)
    records = run_forked(pin_run_folder(store, cfg, shards), shards.key, nproc=2)
    return cfg, store, shards, records, str(base)


def test_a_qwen3_moe_base_trains_on_2_ranks_its_validation_free_of_the_routers_loss(moe_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from stoker.training.data import TokenStream, eval_offsets, get_batch

    cfg, store, shards, records, base = moe_run
    m = cfg.model
    assert (m.family, m.num_experts, m.num_experts_per_tok, m.norm_topk_prob, m.mlp_only_layers) == (
        "qwen3_moe",
        8,
        2,
        True,
        [1],
    )
    assert m.attention == "document" and m.aux_loss_coef == 0.001  # the base's coefficient
    # step 0's validation loss: the base's language-model loss on the validation windows, each
    # document alone, computed by transformers here (the eval's windows, every rank's)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    val = TokenStream(store.local_path(shards.key), "val")
    micro = cfg.train.micro_batch_size
    offsets = eval_offsets(val.num_tokens, m.block_size, cfg.eval.num_batches * micro * 2)
    x, y = get_batch(val, m.block_size, offsets)
    independent = float(loss_of_documents_alone(hf, x, y, val.eot_id).mean())
    first_eval = next(r for r in records if r["event"] == "eval" and r["step"] == 0)
    assert first_eval["val_loss"] == pytest.approx(independent, rel=1e-5)
    # the training loss holds the router's loss; its parts and the router's load are logged
    steps = [r for r in records if r["event"] == "train"]
    assert sorted(train_losses(records)) == [1, 2, 3, 4]
    for r in steps:
        assert r["loss"] == pytest.approx(r["lm_loss"] + 0.001 * r["aux_loss"], rel=1e-5)
        assert r["aux_loss"] >= 1.0 - 1e-4  # the Switch loss is 1 when balanced, more otherwise
        load = r["expert_load"]
        assert load["layers"] == [0, 2], load
        assert all(0 <= i <= 1 / 8 <= b <= 1 for b, i in zip(load["busiest"], load["idlest"])), load
    exported = exported_logits_are_ours(cfg, store, "runs/moe/checkpoints/step-00000004", shards.vocab_size, tmp_path)
    assert (exported["model_type"], exported["architectures"], exported["num_experts"]) == (
        "qwen3_moe",
        ["Qwen3MoeForCausalLM"],
        8,
    )


def test_the_report_shows_the_routers_load_per_sparse_layer_and_its_loss(moe_run):
    from stoker.observe.router import ROUTER_PLOT_FILE, router_history, router_markdown
    from stoker.storage.layout import run_file_key

    cfg, store, _, records, _ = moe_run
    history = router_history(store, "moe")
    assert history["steps"] == [1, 2, 3, 4] and history["layers"] == [0, 2]
    last = next(r for r in records if r["event"] == "train" and r["step"] == 4)
    assert history["busiest"][2][-1] == last["expert_load"]["busiest"][1]
    assert history["aux_loss"][-1] == last["aux_loss"]
    md = router_markdown(store, "moe", cfg.model.num_experts)
    assert "### The router" in md and "- layer 0: busiest expert" in md and "- layer 2: busiest expert" in md
    assert store.read_bytes(run_file_key("moe", ROUTER_PLOT_FILE))[:4] == b"\x89PNG"
