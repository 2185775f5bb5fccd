"""The qwen3 family (stoker/families/qwen3/: one folder and one registry line) against
transformers' own Qwen3ForCausalLM, built tiny and random here (never from a hub): q/k RMSNorm
per head, an explicit head_dim (32, with 4 heads over a width of 64), no q/k/v bias, tied and
untied. Its logits are transformers' in fp32, its adapter is an exact inverse, and a base made
by ``scripts/make_tiny_base.py --style qwen3`` (the chat tokenizer's quirks: a chat end-of-turn
eos, no bos, lacking bytes) is taken as a user would: nothing set but ``model.init_from`` and
``data.source``, the default recipe giving way, 2 FSDP2 ranks with document attention, step 1's
loss transformers' own per document, exported and reloaded by transformers with our logits.
(Its tensor-parallel plan: tests/training/test_tensor_parallel.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from stoker.config import load_config
from stoker.families import FAMILIES, spec_of
from stoker.storage.bases import resolve_base
from stoker.storage.runs import pin_run_folder
from tests.bases import exported_logits_are_ours, loss_of_documents_alone, short_documents, tiny_base
from tests.conftest import prepare_shards, tiny_dict, train_losses
from tests.forked_ranks import run_forked
from tests.training.test_llama import _SHAPE, _hf_model

transformers = pytest.importorskip("transformers")


def _hf_qwen3(tied: bool):
    """A random Qwen3ForCausalLM (test_llama's helper: every parameter off its init, the q/k
    norms' gains not ones), test_llama's shape with an explicit head_dim of 32."""
    config = lambda: transformers.Qwen3Config(  # noqa: E731
        **_SHAPE,
        head_dim=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    return _hf_model("qwen3", {"qwen3": config})


def _ours_of(hf, vocab: int):
    section = FAMILIES["qwen3"]
    cfg = section.model_validate({"family": "qwen3", "block_size": 32, **section.from_hf_config(hf.config.to_dict())})
    spec = spec_of(cfg)
    stored = {k: v for k, v in hf.state_dict().items() if k not in spec.hf_tied(cfg)}
    model = spec.build(cfg, vocab, None)
    model.load_state_dict(spec.from_hf(cfg, stored, vocab), strict=True)
    return model.eval(), cfg, stored


@pytest.mark.parametrize("tied", [True, False])
def test_a_qwen3_base_gives_transformers_logits_and_the_adapter_is_an_exact_inverse(tied):
    hf = _hf_qwen3(tied)
    vocab = 290  # a tokenizer with fewer ids than the base's 300 rows
    ours, cfg, stored = _ours_of(hf, vocab)
    assert (cfg.family, cfg.resolved_head_dim, cfg.n_head * cfg.resolved_head_dim, cfg.n_embd) == ("qwen3", 32, 128, 64)
    assert cfg.qkv_bias is False and cfg.tie_embeddings is tied
    assert (ours.lm_head.weight is ours.embed_tokens.weight) is tied
    assert "layers.1.self_attn.k_norm.weight" in dict(ours.named_parameters())
    idx = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits[..., :vocab])
    spec = spec_of(cfg)
    back = spec.to_hf(cfg, spec.from_hf(cfg, stored, 300), 300)
    assert back.keys() == stored.keys()
    assert all(torch.equal(back[k], stored[k]) for k in stored)
    # its config.json is Qwen3's, and transformers reads it back to the same fields
    written = transformers.Qwen3Config(**cfg.to_hf_config(300))
    assert FAMILIES["qwen3"].from_hf_config(written.to_dict()) == FAMILIES["qwen3"].from_hf_config(hf.config.to_dict())


def test_a_qwen3_checkpoint_of_attention_bias_or_of_another_family_is_refused():
    from stoker.families import UnsupportedArchitecture

    hf = _hf_qwen3(True).config.to_dict()
    with pytest.raises(UnsupportedArchitecture, match="attention_bias"):
        FAMILIES["qwen3"].from_hf_config({**hf, "attention_bias": True})
    with pytest.raises(Exception, match="qkv_bias: is true, and Qwen3 has no q/k/v bias"):
        load_config(tiny_dict("file:///tmp/unused", model={"family": "qwen3", "qkv_bias": True}))


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    """A user's first try: the base and the data, nothing else about the model or tokenizer."""
    base = shutil.copytree(tiny_base(tmp_path_factory, "qwen3"), tmp_path_factory.mktemp("qwen3") / "base")
    root = "file://" + str(tmp_path_factory.mktemp("qwen3-store") / "store")
    text = short_documents(tmp_path_factory.mktemp("qwen3-text") / "text")
    sections = tiny_dict(root, run_name="qwen3", engine={"parallelism": "fsdp"}, train={"max_steps": 4})
    sections["data"] = {"source": text, "val_fraction": 0.1}
    sections["model"] = {"init_from": str(base)}
    del sections["tokenizer"]
    cfg = resolve_base(load_config(sections))
    store, shards = prepare_shards(cfg)
    records = run_forked(pin_run_folder(store, cfg, shards), shards.key, nproc=2)
    return cfg, store, shards, records, str(base)


def test_a_qwen3_base_trains_on_2_ranks_from_its_first_loss_exports_and_reloads(qwen3_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from stoker.training.data import Batches, TokenStream, TrainWindows

    cfg, store, shards, records, base = qwen3_run
    m = cfg.model
    assert (m.family, m.head_dim, m.n_head, m.n_kv_head, m.tie_embeddings) == ("qwen3", 32, 4, 2, True)
    assert m.attention == "document" and m.block_size == 128  # the default recipe's context, within the base's 256
    assert sorted(train_losses(records)) == [1, 2, 3, 4]
    # step 1's loss is the base's own, each document alone (its end: <|endoftext|>, not the chat eos)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    stream = TokenStream(store.local_path(shards.key), "train")
    windows = TrainWindows.one(stream, m.block_size, seed=cfg.train.seed, global_batch=cfg.train.global_batch_size)
    losses, unmasked = [], []
    for rank in (0, 1):
        batches = Batches(windows, micro_batch=2, rank=rank, accum=2, device=torch.device("cpu"), prefetch=False)
        for micro in range(2):
            x, y = batches.get(0, micro)
            losses.append(loss_of_documents_alone(hf, x, y, stream.eot_id))
            with torch.no_grad():  # plain causal attention across the window's documents
                unmasked.append(
                    torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten(), reduction="none")
                )
    first = torch.tensor(train_losses(records)[1], dtype=torch.float32)
    # fp32 defaults (rtol 1.3e-6, atol 1e-5): measured 1 ulp apart (6.3882551 vs 6.3882556) on 2 CPU cores
    torch.testing.assert_close(first, torch.cat(losses).mean())
    with pytest.raises(AssertionError):  # the control: without document masking, 5.2e-3 apart
        torch.testing.assert_close(first, torch.cat(unmasked).mean())
    exported = exported_logits_are_ours(cfg, store, "runs/qwen3/checkpoints/step-00000004", shards.vocab_size, tmp_path)
    assert (exported["model_type"], exported["architectures"], exported["head_dim"]) == (
        "qwen3",
        ["Qwen3ForCausalLM"],
        32,
    )
