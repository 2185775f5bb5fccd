"""Metric sinks: the records a run streams, read back from real TensorBoard event files (with
TensorBoard's own reader) and from a real local MLflow store (file store and SQLite)."""

import logging
import os
import random
import threading
import time

import numpy as np
import pytest

from stoker.config import load_config
from stoker.contracts import events
from stoker.observe.sinks import RUN_TAG, MetricSinks, open_sinks, scalars
from stoker.storage.store import Store
from tests.conftest import tiny_dict

log = logging.getLogger("tests.sinks")


def _run_records(first_step: int, last_step: int, seed: int) -> list[events.Event]:
    """What a launch streams, in its order: heartbeats, log steps, evaluations, commits."""
    rng, out, t = random.Random(seed), [], 1.7e9 + first_step
    for step in range(first_step, last_step + 1):
        t += rng.uniform(0.1, 1.0)
        out.append(events.Step(step=step, time=t))  # a heartbeat: no number worth a sink
        out.append(
            events.Train(
                step=step,
                loss=rng.uniform(2, 8),
                lr=rng.uniform(1e-4, 1e-2),
                step_seconds=rng.uniform(0.01, 1),
                tokens_seen=step * 512,
                tokens_per_second=rng.uniform(1e3, 1e5),
                data_wait_share=rng.random(),
                time=t,
            )
        )
        if step % 3 == 0:
            val = rng.uniform(2, 8)
            out.append(events.Eval(step=step, val_loss=val, val_ppl=float(np.exp(val)), time=t))
            out.append(
                events.CheckpointCommitted(
                    step=step,
                    key=f"k{step}",
                    uri=f"u{step}",
                    bytes=rng.randrange(10**6, 10**7),
                    stage_seconds=rng.random(),
                    upload_seconds=rng.random(),
                    commit_seconds=rng.random(),
                    time=t,
                )
            )
            out.append(
                events.Evaluated(
                    checkpoint=f"u{step}",
                    step=step,
                    val_loss=val + 0.01,
                    val_ppl=float(np.exp(val + 0.01)),
                    windows=8,
                    time=t,
                )
            )
    out.append(events.Done(step=last_step, seconds=1.0, val_loss=None, time=t))
    return out


def _expected(records) -> dict[str, list[tuple[int, float, float]]]:
    """{metric name: [(step, value, wall time)]} from the records themselves."""
    out: dict[str, list] = {}
    for e in records:
        for name, value in scalars(e).items():
            out.setdefault(name, []).append((e.step, value, e.time))
    return out


def _tensorboard(folder: str) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(s.step, s.value, s.wall_time) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _mlflow_runs(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("stoker")
    runs = client.search_runs([experiment.experiment_id])
    return client, runs


@pytest.fixture(params=["file", "sqlite"])
def tracking_uri(request, tmp_path, monkeypatch):
    if request.param == "file":
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores opt-in
        return "file://" + str(tmp_path / "mlruns")
    return "sqlite:///" + str(tmp_path / "mlflow.db")


def test_every_record_reaches_tensorboard_and_mlflow_and_a_resumed_run_continues_both(tmp_path, tracking_uri):
    root = "file://" + str(tmp_path / "store")
    cfg = load_config(
        tiny_dict(root, run_name="sinks", metrics={"tensorboard_enabled": True, "mlflow_tracking_uri": tracking_uri})
    )
    first, second = _run_records(1, 6, seed=1), _run_records(7, 9, seed=2)
    for records in (first, second):  # the first launch, then a resumed one
        sinks = open_sinks(cfg, log)
        for e in records:
            sinks(e)
        sinks.close("FINISHED")
    want = _expected(first + second)
    assert {"train/loss", "train/lr", "val/loss", "checkpoint/bytes", "checkpoint/val_loss"} <= set(want)
    assert "train/mfu" not in want  # a record without the number gives no point

    folder = Store(root).local_path("runs/sinks/tensorboard")
    assert len([n for n in os.listdir(folder) if n.startswith("events.out.tfevents.")]) == 2
    board = _tensorboard(folder)
    assert set(board) == set(want)
    for name, points in want.items():  # TensorBoard keeps float32 values
        assert board[name] == [(s, float(np.float32(v)), t) for s, v, t in points], name

    client, runs = _mlflow_runs(tracking_uri)
    assert len(runs) == 1  # the resumed launch continued the run's MLflow run
    run = runs[0]
    assert run.info.run_name == "sinks" and run.data.tags[RUN_TAG] == "sinks"
    assert run.info.status == "FINISHED"
    assert run.data.params["model.n_layer"] == str(cfg.model.n_layer)
    assert run.data.params["train.max_steps"] == str(cfg.train.max_steps)
    for name, points in want.items():
        history = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: (m.step, m.timestamp))
        assert [(m.step, m.value, m.timestamp) for m in history] == [(s, v, int(t * 1000)) for s, v, t in points], name


def test_a_sink_that_fails_is_left_off_and_the_others_get_every_record(tmp_path, monkeypatch, caplog):
    """The MLflow store disappears mid-run: one warning, MLflow off for the rest of the launch,
    TensorBoard still gets every record, and nothing is raised into the stream."""
    import shutil

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    root, mlruns = "file://" + str(tmp_path / "store"), tmp_path / "mlruns"
    cfg = load_config(
        tiny_dict(
            root,
            run_name="fails",
            metrics={"tensorboard_enabled": True, "mlflow_tracking_uri": "file://" + str(mlruns)},
        )
    )
    records = _run_records(1, 6, seed=3)
    sinks = open_sinks(cfg, log)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i, e in enumerate(records):
            if i == len(records) // 2:
                sinks.queue.join()  # the first half is in MLflow
                shutil.rmtree(mlruns)
            sinks(e)
        sinks.close("FINISHED")
    warnings = [r.getMessage() for r in caplog.records if "metric sink" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("metric sink mlflow failed"), warnings
    board = _tensorboard(Store(root).local_path("runs/fails/tensorboard"))
    assert {k: [p[0] for p in v] for k, v in board.items()} == {
        k: [p[0] for p in v] for k, v in _expected(records).items()
    }


def test_a_slow_sink_never_holds_up_the_stream_of_records():
    """The sinks write on their own thread: a sink stuck in a network call costs the caller
    (the launcher's stream) nothing, and what was queued is written once it answers."""
    release, written = threading.Event(), []

    class Stuck:
        name = "stuck"

        def write(self, step, wall_time, values):
            release.wait()
            written.append(step)

        def close(self, status):
            written.append(status)

    sinks = MetricSinks([Stuck()], log)
    records = [e for e in _run_records(1, 300, seed=4) if isinstance(e, events.Train)]
    t0 = time.perf_counter()
    for e in records:
        sinks(e)
    assert time.perf_counter() - t0 < 0.5 and written == []
    release.set()
    sinks.close("FINISHED")
    assert written == [e.step for e in records] + ["FINISHED"]


def test_the_sinks_and_the_export_command_load_no_torch_in_the_orchestrator(tmp_path):
    """The flow's process never imports torch: not through the sinks (both open, one record
    written) nor through `stoker export`, whose torch side runs in a process of its own."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = f"""
import logging, sys
from stoker.contracts import events
from stoker.config import load_config
from stoker.observe.sinks import open_sinks
from tests.conftest import tiny_dict
import stoker.cli
import stoker.launch.export
cfg = load_config(tiny_dict("file://{tmp_path}/store", metrics={{
    "tensorboard_enabled": True, "mlflow_tracking_uri": "sqlite:///{tmp_path}/m.db"}}))
sinks = open_sinks(cfg, logging.getLogger("x"))
sinks(events.Train(step=1, loss=2.0, lr=1e-3, step_seconds=0.1, tokens_seen=10))
sinks.close("FINISHED")
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not bad, bad[:5]
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_tensorboard_files_of_a_run_on_an_object_store_are_uploaded_when_the_launch_ends(s3_root, tmp_path):
    root, options = s3_root
    cfg = load_config(
        tiny_dict(
            root,
            run_name="s3-sinks",
            storage={"root": root, "storage_options": options},
            metrics={"tensorboard_enabled": True},
        )
    )
    records = _run_records(1, 4, seed=5)
    sinks = open_sinks(cfg, log)
    for e in records:
        sinks(e)
    store = Store(root, options)
    assert not store.exists("runs/s3-sinks/tensorboard", refresh=True)  # written locally until the end
    sinks.close("FINISHED")
    [name] = store.listdir("runs/s3-sinks/tensorboard")
    store.get_file(f"runs/s3-sinks/tensorboard/{name}", str(tmp_path / "tb" / name))
    board = _tensorboard(str(tmp_path / "tb"))
    assert board == {
        k: [(s, float(np.float32(v)), t) for s, v, t in points] for k, points in _expected(records).items()
    }
