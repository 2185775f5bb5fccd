"""Continued pretraining of an open model through the whole flow, as a team's first try makes
it: a base with a real chat base's quirks (scripts/make_tiny_base.py --style chat: sharded
safetensors, a byte-level vocabulary lacking 21 byte values, <|im_end|> as its eos beside
<|endoftext|>, no bos, many added tokens, GQA 6/2 with an explicit head_dim of 24), a folder
of legal-sounding text, and the default recipe from the notebook API with nothing of the model
or the tokenizer set (`load_config("tiny-cpu", **{"model.init_from": ...})`; only the run is
shortened). 2 gloo ranks under FSDP2, document-aware attention (the base's default), a rank
killed after the first checkpoint and the retried launch resuming from it bit for bit; the
step-0 validation loss (the base's own) equal to transformers' loss of the documents scored
one by one; the gain and forgetting in the result and in `stoker runs`; the final checkpoint
evaluated with the base's tokenizer; the export's tensors the checkpoint's, one by one, loaded
by transformers with our logits, and the base's own tokenizer files."""

import contextlib
import io
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.config import load_config
from stoker.storage.bases import resolve_base
from stoker.storage.checkpoints import list_checkpoints
from stoker.storage.store import Store
from tests.bases import (
    documents,
    exported_tensors_are_the_checkpoints,
    loss_of_documents_alone,
    one_document,
    short_documents,
    tiny_base,
)
from tests.conftest import prepare_shards

pytestmark = pytest.mark.e2e


def _cfg(root, run, base, text):
    # the default recipe and the base: nothing of the model or the tokenizer is set
    return load_config(
        "tiny-cpu",
        **{
            "model.init_from": base,
            "data.source": text,
            "storage.root": root,
            "run_name": run,
            # a shorter run than the recipe's
            "model.block_size": 32,
            "data.val_fraction": 0.1,
            "train.max_steps": 8,
            "train.warmup_steps": 2,
            "train.log_interval": 1,
            "train.global_batch_size": 8,
            "train.micro_batch_size": 2,
            "checkpoint.interval_steps": 4,
            "eval.interval_steps": 4,
            "eval.num_batches": 2,
            "eval.per_checkpoint_enabled": False,
            "eval.multiple_choice_items": 20,
            "engine.parallelism": "fsdp",
            "launch.timeout_seconds": 300,
            "launch.max_attempts": 2,  # the flow relaunches from the newest checkpoint
            "launch.max_restarts": 0,
        },
    )


def _final_tensors(store, run):
    path = store.local_path(list_checkpoints(store, run)[0].key)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if k.startswith("model.")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def _base_loss_one_document_at_a_time(base: str, cfg, shards) -> torch.Tensor:
    """transformers' loss on the windows of the in-loop evaluation, each document alone."""
    from transformers import AutoModelForCausalLM

    from stoker.training.data import TokenStream, eval_offsets, get_batch

    store = Store(cfg.storage.root)
    val = TokenStream(store.local_path(shards.key), "val")
    T = cfg.model.block_size
    x, y = get_batch(val, T, eval_offsets(val.num_tokens, T, cfg.eval.num_batches * 2 * cfg.launch.world_size))
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert sum(len(documents(row, val.eot_id)) > 1 for row in x) >= 2  # windows that span documents
    return loss_of_documents_alone(hf, x, y, val.eot_id).mean()


def test_a_base_is_trained_further_through_the_flow_resumed_bitwise_and_exported(
    prefect_server, tmp_path, tmp_path_factory, monkeypatch, quick_relaunch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stoker.cli import main
    from stoker.families import build_model
    from stoker.flows.pipeline import train_pipeline
    from stoker.storage.runs import pin_run_folder
    from stoker.training.checkpoint import load_checkpoint
    from tests.forked_ranks import run_forked

    base = str(shutil.copytree(tiny_base(tmp_path_factory, "chat"), tmp_path / "base"))
    text = short_documents(tmp_path / "text")
    root = "file://" + str(tmp_path / "store")
    unbroken = resolve_base(_cfg(root, "base-unbroken", base, text))  # the same training without the flow
    m = unbroken.model
    assert (m.family, m.n_head, m.n_kv_head, m.head_dim, m.attention) == ("llama", 6, 2, 24, "document")
    assert unbroken.tokenizer.eot_token == "<|endoftext|>"  # not the chat turn's <|im_end|>
    prepared, shards = prepare_shards(unbroken)
    run_forked(pin_run_folder(prepared, unbroken, shards), shards.key, nproc=2)

    monkeypatch.setenv("STOKER_FAULT", "kill:rank=1:step=6")  # SIGKILL before step 6
    monkeypatch.setenv("STOKER_FAULT_ONCE", str(tmp_path / "fault-fired"))
    result = train_pipeline(_cfg(root, "base-killed", base, text))
    assert (tmp_path / "fault-fired").exists()
    assert result.final_step == 8 and result.num_attempts == 2
    assert result.attempts[1]["resumed_from_step"] == 4
    assert result.shard_cache_key == shards.cache_key  # the same base tokenizer, the same shards: a hit

    store = Store(root)
    a, b = _final_tensors(store, "base-unbroken"), _final_tensors(store, "base-killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    records = [json.loads(x) for x in store.read_bytes("runs/base-killed/metrics.jsonl").splitlines()]
    assert [r["event"] for r in records].count("base_loaded") == 1  # the retry resumed, not the base again
    # the final checkpoint evaluated (loss, bits per byte with the base's own tokenizer)
    assert result.checkpoints[-1]["step"] == 8 and result.checkpoints[-1]["val_loss"] is not None
    assert result.last_val_loss is not None

    # step 0 is the base's own evaluation, with documents masked: transformers on each document alone
    evals = {r["step"]: r for r in records if r["event"] == "eval"}
    expected = _base_loss_one_document_at_a_time(base, unbroken, shards)
    torch.testing.assert_close(torch.tensor(evals[0]["val_loss"], dtype=torch.float32), expected)
    # gain and forgetting against it, per source, in loss and in bits per byte of the same windows
    since = result.since_base["main"]
    assert since["step"] == 8 and since["base_loss"] == round(evals[0]["val_loss"], 4)
    assert since["loss_change"] == round(evals[8]["val_loss"] - evals[0]["val_loss"], 4)
    assert since["bpb_change"] == round(evals[8]["bits_per_byte"] - evals[0]["bits_per_byte"], 4)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["runs", "--root", root]) == 0
    [row] = [line for line in out.getvalue().splitlines() if line.startswith("base-killed")]
    assert "llama, 2 layers x 96" in row and f"(sha256 {unbroken.model.base_sha256[:12]})" in row
    assert f"main {since['loss_change']:+.2f} nats ({since['bpb_change']:+.3f} bpb) since the base (step 8)" in row

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", result.final_checkpoint_uri, str(tmp_path / "hf")]) == 0
    final = store.local_path(list_checkpoints(store, "base-killed")[0].key)
    exported_tensors_are_the_checkpoints(unbroken.model, final, tmp_path / "hf")  # tensor by tensor
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ours = build_model(unbroken.model, shards.vocab_size, seed=None)
    load_checkpoint(final, model=ours)
    ids = one_document(
        ours, unbroken, torch.randint(0, shards.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    )
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits[..., : shards.vocab_size], ours.eval()(ids)[0])
    # the base's own tokenizer files: the same ids as the base's, its eos, no bos
    exported = json.load(open(tmp_path / "hf" / "config.json"))
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["stoker"]["base_sha256"] == (
        unbroken.model.base_sha256
    )
    assert exported["head_dim"] == 24 and exported["num_key_value_heads"] == 2
    sample = "Filing 7.\nThe court held that each party shall indemnify the other."
    theirs, mine = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert mine(sample)["input_ids"] == theirs(sample)["input_ids"] and mine.eos_token == "<|im_end|>"
    assert mine.bos_token is None and (hf.config.bos_token_id, hf.config.eos_token_id) == (None, 2)
