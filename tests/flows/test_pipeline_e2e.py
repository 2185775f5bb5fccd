"""The whole flow, tiny, through a real Prefect server and real torchrun ranks."""

import json

import pytest
import torch

from stoker.config import ConfigError, load_config
from stoker.families.gpt2.model import GPT
from stoker.storage.checkpoints import list_checkpoints, validate_checkpoint
from stoker.storage.store import Store
from stoker.training.checkpoint import load_checkpoint
from tests.conftest import tiny_dict

pytestmark = pytest.mark.e2e


def test_pipeline_trains_resumes_and_hits_the_data_cache(prefect_server, tmp_path):
    from stoker.flows.evaluation_flow import evaluate_checkpoint_flow
    from stoker.flows.pipeline import PipelineResult, train_pipeline

    root = "file://" + str(tmp_path / "store")
    # warmup-stable-decay: the decay over the last 4 steps (from step 4, where a checkpoint is taken
    # anyway: one where a decay begins adds none), so that the run can be trained longer
    wsd = {"lr_schedule": "wsd", "decay_steps": 4}
    cfg = load_config(tiny_dict(root, run_name="e2e", eval={"per_checkpoint_enabled": True}, train=wsd))
    first = train_pipeline(cfg)
    assert isinstance(first, PipelineResult)
    assert (first.run_name, first.final_step, first.resumed_from_step) == ("e2e", 8, 0)
    assert not first.data_cache_hit
    steps = [s for s, _ in first.val_losses]
    assert steps == [0, 4, 8]
    assert first.val_losses[-1][1] < first.val_losses[0][1]  # the loss fell
    assert first.last_train_loss < first.first_train_loss
    assert first.last_val_loss is not None
    # throughput of every log step reaches the result (no MFU on a CPU: no peak to divide by)
    assert first.tokens_per_second > 0 and first.mfu is None and first.peak_memory_gb is None
    # every committed checkpoint was evaluated in its own task run (step 4 while training went on)
    assert [(c["step"], c["val_loss"] is not None) for c in first.checkpoints] == [(4, True), (8, True)]
    assert first.checkpoints[-1]["val_loss"] == pytest.approx(first.last_val_loss)

    store = Store(root)
    ckpt_key = list_checkpoints(store, "e2e")[0].key
    assert store.url(ckpt_key) == first.final_checkpoint_uri
    assert validate_checkpoint(store, ckpt_key, deep=True)
    model = GPT(cfg.model, cfg.tokenizer.vocab_size)
    before = model.wte.weight.detach().clone()
    load_checkpoint(store.local_path(ckpt_key), model=model)  # a committed checkpoint loads
    assert not torch.equal(before, model.wte.weight)
    records = [json.loads(line) for line in store.read_bytes("runs/e2e/metrics.jsonl").splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == [0, 4, 8]
    assert store.exists("runs/e2e/config.json") and store.exists("runs/e2e/tokenizer.json")

    # the same run, asked for more steps (a wsd run's past does not depend on its end): it goes on
    # from step 4, its newest checkpoint before its decay (step 8 is inside it), and the data step
    # is a cache hit (with train.micro_batch_size 'auto': not part of the run's identity)
    longer = load_config(tiny_dict(root, run_name="e2e", train={"max_steps": 12, "micro_batch_size": "auto", **wsd}))
    second = train_pipeline(longer)
    assert (second.resumed_from_step, second.final_step) == (4, 12)
    # the plan reaches the result (and the report), at the micro-batch the ranks chose
    share = longer.train.global_batch_size // longer.launch.world_size
    assert first.plan["fits"] and first.plan["micro_batch"] == cfg.train.micro_batch_size
    assert second.micro_batch_size and share % second.micro_batch_size == 0
    assert second.plan["micro_batch"] == second.micro_batch_size and second.plan["total_gib"] > 0
    assert second.data_cache_hit and second.shard_cache_key == first.shard_cache_key
    records = [json.loads(line) for line in store.read_bytes("runs/e2e/metrics.jsonl").splitlines()]
    resumed_at = [i for i, r in enumerate(records) if r["event"] == "resumed"]
    assert len(resumed_at) == 1 and records[resumed_at[0]]["step"] == 4
    assert [r["step"] for r in records[resumed_at[0] :] if r["event"] == "train"] == list(range(5, 13))
    # flow runs are named after the stoker run (and which flow run of it) and tagged
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["run:e2e"])))
    assert sorted(r.name for r in runs) == ["e2e", "e2e (flow run 2)"]
    assert all({"recipe:custom", "launcher:local", "world:1x2"} <= set(r.tags) for r in runs)

    # evaluation is also a flow of its own, for any checkpoint URI
    ev = evaluate_checkpoint_flow(second.final_checkpoint_uri)
    assert ev.step == 12 and ev.val_loss == pytest.approx(second.last_val_loss)


def test_bad_config_is_one_clear_error_before_anything_runs(prefect_server, tmp_path):
    from stoker.flows.pipeline import train_pipeline

    root = tmp_path / "store"
    bad = tiny_dict(
        "file://" + str(root),
        train={"lr": -1.0, "global_batch_size": 10},
        data={"source": str(tmp_path / "missing" / "*.jsonl")},
    )
    with pytest.raises(ConfigError) as err:  # refused where the config is built, as a notebook does
        train_pipeline(load_config(bad))
    assert len(err.value.problems) == 3
    for field in ("train.lr", "train.global_batch_size", "data.source"):
        assert field in str(err.value)
    assert not root.exists()  # nothing written
