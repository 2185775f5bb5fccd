"""`stoker export`: a checkpoint trained by a real (forked) rank, written as a Hugging Face
folder (GPT-2 here; the llama family's export, tensor by tensor and by logits, in
tests/training/test_base.py), loaded by transformers, gives our model's logits on the same
tokens, exactly."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from stoker.families.gpt2.config import GPT2Config
from stoker.families.gpt2.model import GPT
from stoker.families.layers import padded_vocab
from stoker.training.checkpoint import load_checkpoint
from stoker.training.export import hf_config, hf_state_dict, shard_tensors
from tests.conftest import ROOT, one_rank_run

CHECKPOINT = "runs/export/checkpoints/step-00000004"


def _cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder as the flow pins it, and a checkpoint committed by one real rank after 4
    steps. The tokenizer has 300 ids: the model's embedding is padded to 384 rows."""
    cfg, store, shards, _ = one_rank_run(tmp_path_factory, "export")
    assert shards.vocab_size == 300 and padded_vocab(300, cfg.model.vocab_pad_multiple) == 384
    return cfg, store, shards


def _our_model(cfg, store, vocab_size):
    model = GPT(cfg.model, vocab_size, seed=None)
    load_checkpoint(store.local_path(CHECKPOINT), model=model)
    return model.eval()


def test_an_exported_checkpoint_loads_in_transformers_with_our_logits(trained, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, GPT2LMHeadModel

    cfg, store, shards = trained
    out = _cli("export", store.url(CHECKPOINT), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "exported step 4" in out.stdout
    assert sorted(os.listdir(tmp_path / "hf")) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]

    hf, info = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    assert hf.config.vocab_size == 300 and hf.config.n_positions == cfg.model.block_size
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied
    ours = _our_model(cfg, store, shards.vocab_size)
    assert ours.wte.weight.shape[0] == 384  # the checkpoint's padded rows are not exported
    torch.testing.assert_close(hf.transformer.wte.weight, ours.wte.weight[:300], rtol=0, atol=0)

    tokens = torch.randint(0, 300, (3, cfg.model.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(tokens).logits, ours(tokens)[0]
    assert theirs.shape == mine.shape == (3, cfg.model.block_size, 300)
    # the same fp32 operations in the same order: measured 0.0 apart, so compared exactly
    assert torch.equal(theirs, mine), (theirs - mine).abs().max()

    # the folder is usable as it is: its tokenizer is the run's, with the end-of-text token
    text = "def export(model):\n    return model.state_dict()  # <|endoftext|>"
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    run_tok = Tokenizer.from_str(store.read_bytes("runs/export/tokenizer.json").decode())
    assert tok(text)["input_ids"] == run_tok.encode(text).ids
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == hf.config.eos_token_id
    ids = torch.tensor([tok(text)["input_ids"][: cfg.model.block_size]])
    with torch.no_grad():
        theirs, mine = hf(ids).logits, ours(ids)[0]
    assert torch.equal(theirs, mine), (theirs - mine).abs().max()


@pytest.mark.parametrize("bias", [True, False])
def test_the_gpt2_mapping_is_exact_with_biases_and_a_padded_vocabulary(bias):
    """Every parameter set to random values (trained biases and LayerNorm gains included),
    50 real ids padded to 64 rows, 3 layers: transformers' GPT-2 computes the same logits,
    and the adapter's two directions are exact inverses."""
    from transformers import GPT2Config as HFGPT2Config
    from transformers import GPT2LMHeadModel

    from stoker.families.gpt2.model import SPEC

    cfg = GPT2Config(n_layer=3, n_head=2, n_embd=16, block_size=8, bias=bias, vocab_pad_multiple=64)
    model = GPT(cfg, vocab_size=50, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    model.eval()
    hf = GPT2LMHeadModel(HFGPT2Config(**hf_config(cfg, 50, 49, 49))).eval()
    tensors = hf_state_dict(model, cfg, 50)
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to wte
    tokens = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, mine = hf(tokens).logits, model(tokens)[0]
    assert torch.equal(theirs, mine), (theirs - mine).abs().max()  # measured 0.0 apart: exact
    # from_hf(to_hf(x)): our tensors back, the padded rows as zeros
    back = SPEC.from_hf(cfg, tensors, 50)
    ours = model.state_dict()
    assert set(back) == set(ours)
    for name, t in ours.items():
        expected = torch.cat([t[:50], torch.zeros_like(t[50:])]) if name in ("wte.weight", "lm_head.weight") else t
        assert torch.equal(back[name], expected), name
    assert SPEC.to_hf(cfg, back, 50).keys() == tensors.keys()
    assert all(torch.equal(SPEC.to_hf(cfg, back, 50)[k], tensors[k]) for k in tensors)


def test_weights_above_the_shard_size_are_split_in_order():
    tensors = {f"t{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    assert list(shard_tensors(tensors, 1000)) == ["model.safetensors"]
    shards = shard_tensors(tensors, 100)
    assert list(shards) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [list(g) for g in shards.values()] == [["t0", "t1"], ["t2", "t3"], ["t4"]]


def _copy_store(store, tmp_path):
    """A copy of the whole store: damage done to it leaves the module's run alone."""
    from stoker.storage.store import Store

    shutil.copytree(store.local_path(), tmp_path / "copy")
    return Store("file://" + str(tmp_path / "copy"))


def _refused(out, says, folder):
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stoker: ") and says in lines[0], out.stderr
    assert not os.path.exists(folder) or not os.listdir(folder)  # nothing written
    assert not [n for n in os.listdir(os.path.dirname(folder)) if ".tmp-" in n]


@pytest.mark.parametrize(
    "case,says",
    [
        ("malformed", "is not of the form {root}/runs/{run}/checkpoints/step-NNNNNNNN"),
        ("no such checkpoint", "is not a committed, intact checkpoint (no manifest"),
        ("no such run", "is in no run folder"),
        ("another run's checkpoint", "belongs to another run name ('export', this run has 'copied')"),
        ("folder in use", "exists and is not an empty folder"),
    ],
)
def test_an_export_that_cannot_be_done_is_one_line_and_exit_2(trained, tmp_path, case, says):
    _, store, _ = trained
    folder = str(tmp_path / "hf")
    uri = {
        "malformed": store.url("runs/export/step-4"),
        "no such checkpoint": store.url("runs/export/checkpoints/step-00000099"),
        "no such run": store.url("runs/nobody/checkpoints/step-00000004"),
        "another run's checkpoint": store.url("runs/copied/checkpoints/step-00000004"),
        "folder in use": store.url(CHECKPOINT),
    }[case]
    if case == "another run's checkpoint":  # a run folder copied under another name
        copy = _copy_store(store, tmp_path)
        shutil.copytree(copy.local_path("runs/export"), copy.local_path("runs/copied"))
        uri = copy.url("runs/copied/checkpoints/step-00000004")
    if case == "folder in use":
        os.makedirs(folder)
        open(os.path.join(folder, "keep.txt"), "w").close()
    out = _cli("export", uri, folder, timeout=120)
    if case == "folder in use":
        assert os.listdir(folder) == ["keep.txt"]
        folder = os.path.join(folder, "nothing")
    _refused(out, says, folder)


def test_a_checkpoint_that_fails_its_full_check_is_not_exported(trained, tmp_path):
    """Sizes and manifest intact, one flipped byte: found by the export process's sha256 check
    (where the bytes are read), marked invalid in the store, nothing written."""
    _, store, _ = trained
    copy = _copy_store(store, tmp_path)
    shard = sorted(n for n in copy.walk_files(CHECKPOINT) if n.endswith(".distcp"))[0]
    data = copy.read_bytes(f"{CHECKPOINT}/{shard}")
    copy.write_bytes(f"{CHECKPOINT}/{shard}", data[:64] + bytes([data[64] ^ 1]) + data[65:])
    out = _cli("export", copy.url(CHECKPOINT), str(tmp_path / "hf"))
    _refused(
        out,
        f"CheckpointInvalid: checkpoint {copy.url(CHECKPOINT)} is not valid: {shard} fails its sha256 checksum",
        str(tmp_path / "hf"),
    )
    assert json.loads(copy.read_bytes(f"{CHECKPOINT}/_invalid.json"))["reason"]
