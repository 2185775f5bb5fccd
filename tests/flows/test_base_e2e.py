"""Continued pretraining of an open model through the whole flow, as a team's first try makes
it: a base with a real chat base's quirks (scripts/make_tiny_base.py --style chat: sharded
safetensors, a byte-level vocabulary lacking 21 byte values, <|im_end|> as its eos beside
<|endoftext|>, no bos, many added tokens, GQA 6/2 with an explicit head_dim of 24) and a folder
of legal-sounding text.

The literal first try, `stoker run --set model.init_from=BASE --set data.source=DIR` and nothing
else, runs for real as a `stoker` process and carries what a user reads of it: the rate made for
the base said before launch, no WARNING, step 0's validation loss (the base's own) equal to
transformers' loss of the documents scored one by one, the gain since the base in `stoker runs`,
the export's tensors the checkpoint's, one by one, loaded by transformers with our logits, and the
base's own tokenizer files.

A shortened run of the same recipe from the notebook API (`load_config("tiny-cpu", **{...})`),
2 gloo ranks under FSDP2 with document-aware attention (the base's default), has a rank killed
after the first checkpoint and the retried launch resuming from it bit for bit; the gain and
forgetting in the result; the final checkpoint evaluated with the base's tokenizer."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.config import load_config
from stoker.storage.bases import resolve_base
from stoker.storage.checkpoints import list_checkpoints
from stoker.storage.store import Store
from tests.bases import (
    copy_base,
    documents,
    exported_tensors_are_the_checkpoints,
    loss_of_documents_alone,
    one_document,
    short_documents,
    tiny_base,
)
from tests.conftest import ROOT, prepare_shards

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
    x, y = get_batch(
        val,
        T,
        eval_offsets(val.num_tokens, T, cfg.eval.num_batches * cfg.train.micro_batch_size * cfg.launch.world_size),
    )
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert sum(len(documents(row, val.eot_id)) > 1 for row in x) >= 2  # windows that span documents
    return loss_of_documents_alone(hf, x, y, val.eot_id).mean()


def test_a_base_is_trained_further_through_the_flow_and_resumed_bitwise(
    prefect_server, tmp_path, tmp_path_factory, monkeypatch, quick_relaunch
):
    from stoker.flows.pipeline import train_pipeline
    from stoker.storage.runs import pin_run_folder
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

    # gain and forgetting against step 0 (the base's own evaluation), per source, in loss and in
    # bits per byte of the same windows
    evals = {r["step"]: r for r in records if r["event"] == "eval"}
    since = result.since_base["main"]
    assert since["step"] == 8 and since["base_loss"] == round(evals[0]["val_loss"], 4)
    assert since["loss_change"] == round(evals[8]["val_loss"] - evals[0]["val_loss"], 4)
    assert since["bpb_change"] == round(evals[8]["bits_per_byte"] - evals[0]["bits_per_byte"], 4)


def test_the_literal_first_try_trains_the_base_at_a_rate_made_for_it_and_exports_it(
    session_server_env, tmp_path, tmp_path_factory
):
    """`stoker run --set model.init_from=BASE --set data.source=DIR` and nothing else, from an
    empty folder, as a real `stoker` process on the session's server: the default recipe's 500
    steps at the rate made for the base, said before launch, with no WARNING in what it prints;
    step 0 is the base's own loss (transformers, each document alone); the gain since the base
    in `stoker runs`; the final checkpoint exported and loaded by transformers with our logits
    and the base's own tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stoker.cli import main
    from stoker.families import build_model
    from stoker.training.checkpoint import load_checkpoint

    base = copy_base(tiny_base(tmp_path_factory, "chat"), tmp_path / "base")
    text = short_documents(tmp_path / "text")
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in session_server_env.items() if not k.startswith("STOKER_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    argv = ["run", "--set", f"model.init_from={base}", "--set", f"data.source={text}"]
    done = subprocess.run(
        [sys.executable, "-m", "stoker.cli", *argv], cwd=work, env=env, capture_output=True, text=True, timeout=1800
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert "WARNING" not in said and "Traceback" not in said
    # the plan before launch: the default recipe's 500 steps, at a tenth of the base's peak
    flat = " ".join(said.split())  # a console may wrap a long line
    assert "plan: learning rate from: the base (no train.lr written): 0.0003 = 0.1 x 0.003, the peak" in flat
    assert "stable 0.0003 to step 400, then a linear decay to 0 at step 500" in flat

    # the run the folder's defaults name: the same config read here (the store is ./stoker-data)
    root = "file://" + str(work / "stoker-data")
    cfg = resolve_base(load_config("tiny-cpu", **{"model.init_from": base, "data.source": text, "storage.root": root}))
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.train.lr_schedule == "wsd" and cfg.model.attention == "document"
    run = cfg.resolved_run_name()
    assert f"run {run}: step 0 -> 500" in flat
    store, shards = prepare_shards(cfg)  # the shards the run made: a cache hit
    records = [json.loads(x) for x in store.read_bytes(f"runs/{run}/metrics.jsonl").splitlines()]
    evals = {r["step"]: r for r in records if r["event"] == "eval"}
    assert sorted(evals) == [0, 100, 200, 300, 400, 500] and evals[500]["val_loss"] < evals[0]["val_loss"]
    # step 0 is the base's own evaluation, with documents masked: transformers on each document alone
    expected = _base_loss_one_document_at_a_time(base, cfg, shards)
    torch.testing.assert_close(torch.tensor(evals[0]["val_loss"], dtype=torch.float32), expected)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["runs", "--root", root]) == 0
    [row] = [line for line in out.getvalue().splitlines() if line.startswith(run)]
    loss_change = round(evals[500]["val_loss"] - evals[0]["val_loss"], 4)
    bpb_change = round(evals[500]["bits_per_byte"] - evals[0]["bits_per_byte"], 4)
    assert "llama, 2 layers x 96" in row and f"(sha256 {cfg.model.base_sha256[:12]})" in row
    assert f"main {loss_change:+.2f} nats ({bpb_change:+.3f} bpb) since the base (step 500)" in row

    final_ckpt = list_checkpoints(store, run)[0]
    assert final_ckpt.step == 500
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", store.url(final_ckpt.key), str(tmp_path / "hf")]) == 0
    final = store.local_path(final_ckpt.key)
    exported_tensors_are_the_checkpoints(cfg.model, final, tmp_path / "hf")  # tensor by tensor
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ours = build_model(cfg.model, shards.vocab_size, seed=None)
    load_checkpoint(final, model=ours)
    ids = one_document(
        ours, cfg, torch.randint(0, shards.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    )
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits[..., : shards.vocab_size], ours.eval()(ids)[0])
    # the base's own tokenizer files: the same ids as the base's, its eos, no bos
    exported = json.load(open(tmp_path / "hf" / "config.json"))
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["stoker"]["base_sha256"] == (
        cfg.model.base_sha256
    )
    assert exported["head_dim"] == 24 and exported["num_key_value_heads"] == 2
    sample = "Filing 7.\nThe court held that each party shall indemnify the other."
    theirs, mine = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert mine(sample)["input_ids"] == theirs(sample)["input_ids"] and mine.eos_token == "<|im_end|>"
    assert mine.bos_token is None and (hf.config.bos_token_id, hf.config.eos_token_id) == (None, 2)
