"""Continued pretraining of an open model through the whole flow: a sharded Llama-3.2-style
base (scripts/make_tiny_base.py, save_pretrained locally), 2 gloo ranks under FSDP2, a rank
killed after the first checkpoint, the retried launch resuming from it bit for bit, the final
checkpoint evaluated with the base's tokenizer, `stoker runs` naming the base, and the export
loaded by transformers with our logits and the base's own tokenizer."""

import contextlib
import io
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.core.config import load_config
from stoker.storage.bases import resolve_base
from stoker.storage.checkpoints import list_checkpoints
from stoker.storage.store import Store
from tests.bases import tiny_base
from tests.conftest import prepare_shards, tiny_dict

pytestmark = pytest.mark.e2e


def _cfg(root, run, base):
    sections = tiny_dict(
        root,
        run_name=run,
        engine={"parallelism": "fsdp"},
        launch={"max_attempts": 2, "max_restarts": 0},  # the flow relaunches from the newest checkpoint
    )
    sections["model"] = {"family": "llama", "init_from": base, "block_size": 32}
    del sections["tokenizer"]  # the base's
    return load_config(sections)


def _final_tensors(store, run):
    path = store.local_path(list_checkpoints(store, run)[0].key)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if k.startswith("model.")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def test_a_base_is_trained_further_through_the_flow_resumed_bitwise_and_exported(
    prefect_server, tmp_path, tmp_path_factory, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stoker.cli import main
    from stoker.flows.pipeline import train_pipeline
    from stoker.storage.runs import pin_run_folder
    from stoker.training.checkpoint import load_checkpoint
    from stoker.training.models import build_model
    from tests.forked_ranks import run_forked

    base = str(shutil.copytree(tiny_base(tmp_path_factory, "llama"), tmp_path / "base"))
    root = "file://" + str(tmp_path / "store")
    unbroken = resolve_base(_cfg(root, "base-unbroken", base))  # the same training without the flow
    prepared, shards = prepare_shards(unbroken)
    run_forked(pin_run_folder(prepared, unbroken, shards), shards.key, nproc=2)

    monkeypatch.setenv("STOKER_FAULT", "kill:rank=1:step=6")  # SIGKILL before step 6
    monkeypatch.setenv("STOKER_FAULT_ONCE", str(tmp_path / "fault-fired"))
    result = train_pipeline(_cfg(root, "base-killed", base))
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

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["runs", "--root", root]) == 0
    [row] = [line for line in out.getvalue().splitlines() if line.startswith("base-killed")]
    assert "llama, 2 layers x 64" in row and f"(sha256 {unbroken.model.base_sha256[:12]})" in row

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", result.final_checkpoint_uri, str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ours = build_model(unbroken.model, shards.vocab_size, seed=None)
    load_checkpoint(store.local_path(list_checkpoints(store, "base-killed")[0].key), model=ours)
    ids = torch.randint(0, shards.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits[..., : shards.vocab_size], ours.eval()(ids)[0])
    # the base's own tokenizer files: the same ids as the base's, its bos and eos
    exported = json.load(open(tmp_path / "hf" / "config.json"))
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["stoker"]["base_sha256"] == (
        unbroken.model.base_sha256
    )
    text = "def resume(run):\n    return run.newest_valid()"
    theirs, mine = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert mine(text)["input_ids"] == theirs(text)["input_ids"] and mine.eos_token == "<|end_of_text|>"
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (0, 1)
