"""Metric sinks people already use: TensorBoard event files and MLflow (the 'metrics' extra;
off by default: ``metrics.tensorboard_enabled``, ``metrics.mlflow_tracking_uri``).

They are fed from the ranks' typed records, the very ones rank 0 keeps in
``{run}/metrics.jsonl``, as the launcher decodes them from the ranks' output; plus the result
of each checkpoint evaluated while training goes on.

Where they run: here, beside the TrainingMonitor, on the host that launches the ranks; not in
rank 0. Why:
- the ranks stay plain torch: no tracking client, no network call and no extra package in
  every training image, and a tracking server that is slow or away can never stall a step;
- one writer per run whatever the number of nodes, on the host that holds the store's and
  the tracking server's settings (rank 0 may run on a node that cannot reach the server);
- the orchestrator sees every attempt of a run: a retried or resumed run continues the same
  MLflow run (found by its ``stoker.run_name`` tag) and the same TensorBoard folder.
The sinks run on a thread of their own, fed through a queue: a slow sink never holds up the
reading of the ranks' output (the log, the watchdog). A sink that fails while the run goes on
is reported once in the log and left off for the rest of that launch (metrics never fail
training); one that cannot be opened is a ConfigError before the ranks start.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
from typing import Protocol

from stoker.config import RunConfig
from stoker.contracts import events
from stoker.failures import ConfigError, describe, is_transient
from stoker.storage.layout import TENSORBOARD_DIR, run_file_key, run_key
from stoker.storage.store import Store, join

RUN_TAG = "stoker.run_name"  # the MLflow tag that finds a stoker run's MLflow run
CLOSE_TIMEOUT_SECONDS = 60.0
_MLFLOW_PARAMS_PER_CALL = 100  # MLflow's log_batch limit


def scalars(event: events.Event) -> dict[str, float]:
    """The numbers a record carries, by the name both sinks give them (empty: none)."""
    if isinstance(event, events.Train):
        values = {
            "train/loss": event.loss,
            "train/lr": event.lr,
            "train/step_seconds": event.step_seconds,
            "train/tokens_seen": event.tokens_seen,
            "train/tokens_per_second": event.tokens_per_second,
            "train/mfu": event.mfu,
            "train/peak_memory_gb": event.peak_memory_gb,
            "train/data_wait_share": event.data_wait_share,
        }
        for name, seen in (event.sources or {}).items():  # a mixture: what each source gave so far
            values[f"data/{name}/tokens"] = seen.get("tokens")
            values[f"data/{name}/epochs"] = seen.get("epochs")
    elif isinstance(event, events.Eval):
        values = {"val/loss": event.val_loss, "val/perplexity": event.val_ppl}
        values.update({f"val/{name}/loss": loss for name, loss in (event.sources or {}).items()})
    elif isinstance(event, events.CheckpointCommitted):
        values = {
            "checkpoint/bytes": event.bytes,
            "checkpoint/stage_seconds": event.stage_seconds,
            "checkpoint/upload_seconds": event.upload_seconds,
        }
    elif isinstance(event, events.Evaluated):  # a committed checkpoint, evaluated in its own process
        values = {
            "checkpoint/val_loss": event.val_loss,
            "checkpoint/val_perplexity": event.val_ppl,
            "checkpoint/bits_per_byte": event.bits_per_byte,
            "checkpoint/mc_accuracy": event.mc_accuracy,
            "checkpoint/mc_accuracy_clean": event.mc_accuracy_clean,
            "checkpoint/mc_accuracy_norm": event.mc_accuracy_norm,
        }
        for name, scores in (event.sources or {}).items():
            values[f"checkpoint/{name}/val_loss"] = scores.get("val_loss")
            values[f"checkpoint/{name}/bits_per_byte"] = scores.get("bits_per_byte")
    else:
        return {}
    return {name: float(v) for name, v in values.items() if v is not None}


class Sink(Protocol):
    name: str

    def write(self, step: int, wall_time: float, values: dict[str, float]) -> None: ...

    def close(self, status: str) -> None: ...


class TensorBoardSink:
    """Event files in {root}/runs/{run}/tensorboard/, one file per launch attempt (TensorBoard
    reads them as one run, and drops the steps a resumed attempt trains again). On an object
    store the file is written locally and uploaded when the attempt ends."""

    name = "tensorboard"

    def __init__(self, store: Store, run_name: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.store, self.key = store, run_file_key(run_name, TENSORBOARD_DIR)
        self.logdir = store.local_path(self.key) if store.is_local else tempfile.mkdtemp(prefix="stoker-tensorboard-")
        os.makedirs(self.logdir, exist_ok=True)
        self.writer = EventFileWriter(self.logdir, flush_secs=5)

    def write(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self.writer.add_event(Event(wall_time=wall_time, step=step, summary=summary))

    def close(self, status: str) -> None:
        self.writer.close()
        if not self.store.is_local:
            for name in sorted(os.listdir(self.logdir)):
                self.store.put_file(os.path.join(self.logdir, name), join(self.key, name))
            shutil.rmtree(self.logdir, ignore_errors=True)


class MlflowSink:
    """One MLflow run per stoker run, in metrics.mlflow_experiment: created with the config as
    parameters, found again by its tag when the run resumes or retries."""

    name = "mlflow"

    def __init__(self, cfg: RunConfig, store: Store):
        m, run = cfg.metrics, cfg.resolved_run_name()
        self.client = mlflow_client(m.mlflow_tracking_uri)
        experiment_id = mlflow_experiment_id(self.client, m.mlflow_experiment)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(
            experiment_id, run_name=run, tags={RUN_TAG: run, "stoker.run_uri": store.url(run_key(run))}
        ).info.run_id
        self._log_params(cfg)

    def _log_params(self, cfg: RunConfig) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in sorted(_flat(cfg.model_dump(mode="json")).items())]
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + _MLFLOW_PARAMS_PER_CALL])

    def write(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def mlflow_client(tracking_uri: str):
    """An MlflowClient for this URI (no global MLflow state is set). MLflow's usage telemetry
    is turned off unless the user asked for it: it honours DO_NOT_TRACK=true only, and stoker
    sets DO_NOT_TRACK=1."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def mlflow_experiment_id(client, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment is not None else client.create_experiment(name)


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class MetricSinks:
    """The sinks of one launch attempt, fed from a queue by a thread of their own. Call it
    with each record; close it when the attempt ends."""

    def __init__(self, sinks: list[Sink], logger):
        self.sinks, self.logger = list(sinks), logger
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._drain, name="stoker-metric-sinks", daemon=True)
        self.thread.start()

    def __call__(self, event: events.Event) -> None:
        values = scalars(event)
        if values:
            self.queue.put((event.step, event.time, values))

    def _drain(self) -> None:
        while (item := self.queue.get()) is not None:
            for sink in list(self.sinks):
                try:
                    sink.write(*item)
                except Exception as err:  # metrics never stop training
                    self.sinks.remove(sink)
                    self.logger.warning(
                        "metric sink %s failed and is off for the rest of this launch: %s", sink.name, describe(err)
                    )
            self.queue.task_done()  # queue.join() returns once all that was queued is written

    def close(self, status: str = "FINISHED", timeout: float = CLOSE_TIMEOUT_SECONDS) -> None:
        """Write what is queued, then close every sink (MLflow run status: FINISHED, FAILED or
        KILLED). A sink still busy after `timeout` is left as it is, with a warning."""
        self.queue.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.logger.warning("metric sinks still writing after %.0fs; the last records may be missing", timeout)
            return
        for sink in self.sinks:
            try:
                sink.close(status)
            except Exception as err:
                self.logger.warning("metric sink %s did not close: %s", sink.name, describe(err))


def open_sinks(cfg: RunConfig, logger) -> MetricSinks | None:
    """The sinks cfg.metrics asks for, opened; None when it asks for none. ConfigError naming
    the field when one cannot be opened (a transient error is raised as it is, to be retried)."""
    store = Store.of(cfg.storage)
    opened: list[Sink] = []
    wanted = (
        [("tensorboard_enabled", lambda: TensorBoardSink(store, cfg.resolved_run_name()))]
        if cfg.metrics.tensorboard_enabled
        else []
    )
    if cfg.metrics.mlflow_tracking_uri:
        wanted.append(("mlflow_tracking_uri", lambda: MlflowSink(cfg, store)))
    for field, make in wanted:
        try:
            opened.append(make())
        except Exception as err:
            for sink in opened:
                sink.close("FAILED")
            if is_transient(err):
                raise  # the task's retry policy takes it
            raise _cannot_open(cfg, field, err) from err
    if not opened:
        return None
    logger.info("metric sinks: %s", ", ".join(s.name for s in opened))
    return MetricSinks(opened, logger)


def sink_problems(cfg: RunConfig) -> list[str]:
    """Before anything is computed: can the MLflow tracking server (or store) be used? Finds
    or creates the experiment; no run is created. Empty when MLflow is off."""
    m = cfg.metrics
    if not m.mlflow_tracking_uri:
        return []
    try:
        mlflow_experiment_id(mlflow_client(m.mlflow_tracking_uri), m.mlflow_experiment)
    except Exception as err:
        if is_transient(err):
            raise
        return _cannot_open(cfg, "mlflow_tracking_uri", err).problems
    return []


def _cannot_open(cfg: RunConfig, field: str, err: Exception) -> ConfigError:
    value = getattr(cfg.metrics, field)
    what = f"{value} cannot be used" if isinstance(value, str) else "the sink cannot be opened"
    why = " ".join(f"{type(err).__name__}: {err}".split())[:600]  # MLflow's own words, not a cause
    return ConfigError([f"metrics.{field}: {what} ({why}); fix it or turn the sink off."])
