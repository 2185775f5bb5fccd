"""The metric sinks in a real run: the pipeline through a Prefect server and torchrun ranks,
with TensorBoard and a local MLflow file store on. What they hold is what metrics.jsonl holds."""

import json

import numpy as np
import pytest

from stoker.config import ConfigError, load_config
from stoker.storage.store import Store
from tests.conftest import tiny_dict

pytestmark = pytest.mark.e2e


def test_a_run_writes_its_records_to_tensorboard_and_mlflow(prefect_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stoker.flows.pipeline import train_pipeline

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores opt-in
    root, mlruns = "file://" + str(tmp_path / "store"), "file://" + str(tmp_path / "mlruns")
    cfg = load_config(
        tiny_dict(
            root,
            run_name="sinks-e2e",
            metrics={"tensorboard_enabled": True, "mlflow_tracking_uri": mlruns, "mlflow_experiment": "e2e"},
            eval={"per_checkpoint_enabled": True},
            launch={"nproc_per_node": 1},  # the sinks are rank 0's: a second rank adds nothing here
        )
    )
    result = train_pipeline(cfg)
    assert result.final_step == 8

    store = Store(root)
    records = [json.loads(line) for line in store.read_bytes("runs/sinks-e2e/metrics.jsonl").splitlines()]
    want = {
        "train/loss": [(r["step"], r["loss"]) for r in records if r["event"] == "train"],
        "train/tokens_per_second": [(r["step"], r["tokens_per_second"]) for r in records if r["event"] == "train"],
        "val/loss": [(r["step"], r["val_loss"]) for r in records if r["event"] == "eval"],
        "checkpoint/bytes": [(r["step"], r["bytes"]) for r in records if r["event"] == "checkpoint"],
    }
    # checkpoints evaluated while training went on (the flow evaluates the last one after); the
    # report's table rounds their losses to 4 decimals
    evaluated = [(c["step"], c["val_loss"]) for c in result.checkpoints if c["step"] < result.final_step]
    assert [s for s, _ in want["train/loss"]] == list(range(1, 9))
    assert [s for s, _ in want["val/loss"]] == [0, 4, 8] and [s for s, _ in evaluated] == [4]

    acc = EventAccumulator(store.local_path("runs/sinks-e2e/tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for name, points in want.items():
        assert [(s.step, s.value) for s in acc.Scalars(name)] == [(step, float(np.float32(v))) for step, v in points], (
            name
        )
    assert [(s.step, pytest.approx(s.value, abs=6e-5)) for s in acc.Scalars("checkpoint/val_loss")] == evaluated

    client = MlflowClient(tracking_uri=mlruns)
    [run] = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert run.info.run_name == "sinks-e2e" and run.info.status == "FINISHED"
    assert run.data.params["model.n_embd"] == str(cfg.model.n_embd)
    for name, points in want.items():
        history = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(step, float(v)) for step, v in points], name
    history = client.get_metric_history(run.info.run_id, "checkpoint/val_loss")
    assert [(m.step, pytest.approx(m.value, abs=5e-5)) for m in history] == evaluated


def test_a_tracking_uri_that_cannot_be_used_stops_the_run_before_any_work(prefect_server, tmp_path):
    from stoker.flows.pipeline import train_pipeline

    root = "file://" + str(tmp_path / "store")
    cfg = load_config(tiny_dict(root, metrics={"mlflow_tracking_uri": "nosuch://tracking/server"}))
    with pytest.raises(
        ConfigError,
        match=r"metrics.mlflow_tracking_uri: nosuch://tracking/server "
        r"cannot be used \(\w+: .*unsupported URI 'nosuch://",
    ):
        train_pipeline(cfg)
    assert not Store(root).exists("datasets") and not Store(root).exists("runs")
