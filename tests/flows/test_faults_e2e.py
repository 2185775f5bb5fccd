"""Failures through the real flow: a killed rank is retried from the newest valid checkpoint
and ends bit for bit where an unbroken run ends; a rank that raises is not retried."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.core.config import load_config
from stoker.core.failures import TrainingFailed
from stoker.storage.checkpoints import list_checkpoints
from stoker.storage.store import Store
from tests.conftest import tiny_dict

pytestmark = pytest.mark.e2e


def _final_tensors(store, run):
    path = store.local_path(list_checkpoints(store, run)[0].key)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def _cfg(root, name, **train):
    return load_config(
        tiny_dict(
            root,
            run_name=name,
            train={"max_steps": 8, **train},
            launch={"max_attempts": 3, "max_restarts": 0},  # the relaunch path
            eval={"per_checkpoint_enabled": False},
        )
    )


def test_killed_rank_is_retried_and_ends_bitwise_like_an_unbroken_run(prefect_server, tmp_path, monkeypatch):
    from stoker.flows.pipeline import train_pipeline

    root = "file://" + str(tmp_path / "store")
    unbroken = train_pipeline(_cfg(root, "unbroken"))
    monkeypatch.setenv("STOKER_FAULT", "kill:rank=1:step=6")  # SIGKILL before step 6
    monkeypatch.setenv("STOKER_FAULT_ONCE", str(tmp_path / "fault-fired"))
    broken = train_pipeline(_cfg(root, "killed"))
    assert (tmp_path / "fault-fired").exists()
    assert broken.final_step == unbroken.final_step == 8
    assert broken.num_attempts == 2
    first, second = broken.attempts
    assert first["outcome"] == "lost-rank" and first["reached_step"] == 5
    assert second["resumed_from_step"] == 4 and second["outcome"] == "completed"
    assert broken.steps_lost == 1 and 0 < broken.goodput < 1

    store = Store(root)
    a, b = _final_tensors(store, "unbroken"), _final_tensors(store, "killed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) or (a[k].isnan().all() and b[k].isnan().all()), k
    losses = {}
    for run in ("unbroken", "killed"):
        rows = [json.loads(x) for x in store.read_bytes(f"runs/{run}/metrics.jsonl").splitlines()]
        losses[run] = {r["step"]: r["loss"] for r in rows if r["event"] == "train"}
    assert losses["killed"] == losses["unbroken"]  # same per-step losses, exactly


def test_a_rank_that_raises_is_not_retried(prefect_server, tmp_path, monkeypatch):
    from stoker.flows.pipeline import train_pipeline

    root = "file://" + str(tmp_path / "store")
    monkeypatch.setenv("STOKER_FAULT", "raise:rank=0:step=2")
    with pytest.raises(TrainingFailed, match="RuntimeError.*injected fault") as err:
        train_pipeline(_cfg(root, "buggy"))
    assert not err.value.transient
    rows = [json.loads(x) for x in Store(root).read_bytes("runs/buggy/attempts.jsonl").splitlines()]
    assert len(rows) == 1 and rows[0]["outcome"] == "error"
