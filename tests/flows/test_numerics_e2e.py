"""A diverging run through the real flow: it fails once, permanently, naming the step, and the
store says why (attempts.jsonl, `stoker runs`); nothing from the bad step on is committed."""

import json

import pytest

from stoker.config import load_config
from stoker.failures import TrainingFailed
from stoker.observe.inspect import list_runs
from stoker.storage.checkpoints import find_latest_valid
from stoker.storage.store import Store
from tests.conftest import tiny_dict

pytestmark = pytest.mark.e2e


def test_a_diverging_run_fails_once_naming_the_step_and_is_not_retried(prefect_server, tmp_path):
    from stoker.flows.pipeline import train_pipeline

    root = "file://" + str(tmp_path / "store")
    cfg = load_config(
        tiny_dict(
            root,
            run_name="diverging",
            train={"max_steps": 8, "lr": 1e6, "min_lr": 0, "warmup_steps": 0},
            checkpoint={"interval_steps": 1},
            # one rank: the flow's answer to a diverging loss is the subject (the ranks agree
            # on a non-finite loss: tests/training/test_numerics.py runs two)
            launch={"max_attempts": 3, "max_restarts": 0, "nproc_per_node": 1},
            eval={"per_checkpoint_enabled": False},
        )
    )
    with pytest.raises(TrainingFailed, match="NonFiniteError: non-finite loss at step 2") as err:
        train_pipeline(cfg)
    assert not err.value.transient
    store = Store(root)
    rows = [json.loads(x) for x in store.read_bytes("runs/diverging/attempts.jsonl").splitlines()]
    assert len(rows) == 1 and rows[0]["outcome"] == "error"  # not retried
    assert "non-finite loss at step 2" in rows[0]["error"]
    assert find_latest_valid(store, "diverging").checkpoint.step == 1
    [run] = list_runs(root)
    assert run["newest_valid_step"] == 1 and run["ended"] == "failed: non-finite loss at step 2"
