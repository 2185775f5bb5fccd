"""What a run tells beside its own files, none of it the run's identity: the metric sinks
(``MetricsConfig``), the price of its accelerators for the ledger (``CostConfig``) and its
Prefect events (``EventsConfig``)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from stoker.config.checks import _url_problem
from stoker.fields import NonBlank, _field, _rule, _Section


class MetricsConfig(_Section):
    """Where the run's metric records (those rank 0 keeps in {run}/metrics.jsonl) also go. The
    sinks run beside the flow, on the host that launches the ranks, fed from the ranks' event
    stream; they are not part of the run's identity."""

    tensorboard_enabled: bool = Field(
        False,
        description="Write TensorBoard event files of the training and validation "
        "metrics to {root}/runs/{run}/tensorboard/ (tensorboard --logdir <that folder>). Needs "
        "the 'metrics' extra: pip install 'stoker[metrics]'.",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="Also log the metrics (and the config as parameters) to MLflow at this "
        "tracking URI: http(s)://host:5000, sqlite:////abs/mlflow.db, file:///abs/mlruns (MLflow 3 "
        "wants MLFLOW_ALLOW_FILE_STORE=true for that one) or databricks. One MLflow run per stoker "
        "run (tag stoker.run_name), continued when the run resumes. Empty: off. Needs the "
        "'metrics' extra: pip install 'stoker[metrics]'.",
        json_schema_extra={
            "fix": "give http(s)://host:port, sqlite:////abs/path.db or file:///abs/path, or leave it empty"
        },
    )
    mlflow_experiment: NonBlank = _field(
        "stoker", "MLflow experiment of the run (created when missing).", fix="e.g. 'stoker'"
    )

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _tracking_uri(cls, uri: str | None) -> str | None:
        if uri is None or not uri.strip():
            return None
        uri = uri.strip()
        scheme, sep, rest = uri.partition("://")
        if "@" in rest.split("/", 1)[0]:
            raise PydanticCustomError(
                "secret_in_config",
                "holds credentials (user:password@)",
                {
                    "fix": "give them to the environment: MLFLOW_TRACKING_USERNAME and "
                    "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
                },
            )
        problem = _url_problem(uri, "the tracking URI")
        if problem is not None:
            raise problem
        if scheme == "file" and not rest.startswith("/"):
            raise _rule("is a relative file:// URL", "write file:///absolute/path (three slashes)")
        if not sep and uri != "databricks" and not os.path.isabs(uri):  # a string test
            raise _rule("is relative: it would depend on where the flow runs")
        return uri


class CostConfig(_Section):
    """The price of the run's accelerators, for the goodput and cost ledger (the run report,
    `stoker runs`): every second of a flow run is attributed to one cause and priced at
    per_accelerator_hour x launch.world_size (num_nodes x nproc_per_node). Not part of the
    run's identity."""

    per_accelerator_hour: float | None = _field(
        None,
        "Price of one accelerator (one rank's GPU, or CPU slot) for one hour, in your currency, "
        "e.g. 2.5. The ledger prices each cause at this x launch.world_size; time spent queued "
        "(before the flow run started) is shown but not priced, since no accelerator is held "
        "then. Empty or 0: no price shown.",
        fix="give the hourly price of one accelerator, e.g. 2.5, or leave it empty",
        ge=0,
    )


class EventsConfig(_Section):
    """Prefect events the run emits (``stoker.checkpoint.committed``, ``stoker.run.step``,
    ``stoker.run.stalled``, ``stoker.run.failed``) and the per-launch automation that marks a
    flow run stalled. Sent best-effort from the process that launches the ranks: emitting never
    waits for the server and never fails training. Not part of the run's identity."""

    enabled: bool = Field(
        True,
        description="Emit the run's Prefect events, and create the stalled-run automation of each "
        "launch (removed when the launch ends). Off: no event, no automation.",
    )
    step_interval_seconds: float = _field(
        10.0,
        "Heartbeats: at most one stoker.run.step event per this many seconds (each carries the "
        "step, the last loss and the recent median step time).",
        fix="give at least 1 second, e.g. 10",
        ge=1.0,
    )
    stall_factor: float = _field(
        20.0,
        "The stalled-run automation fires when no stoker.run.step event arrives for "
        "max(stall_min_seconds, stall_factor x the recent median step time) plus "
        "step_interval_seconds (the heartbeat period is added so the rate bound never looks like "
        "a stall). Keep the window above the longest pause between steps (an evaluation, a "
        "synchronous checkpoint save).",
        fix="give a factor of at least 2, e.g. 20",
        ge=2.0,
    )
    stall_min_seconds: float = _field(
        120.0,
        "The shortest stall window, whatever the step time (Prefect's proactive triggers need 10 s "
        "at least). Keep it above the step-0 evaluation and a checkpoint save.",
        fix="give at least 10 seconds, e.g. 120",
        ge=10.0,
    )
    stall_action: Literal["mark", "cancel"] = Field(
        "mark",
        description="What the stalled-run automation does: 'mark' sets the flow run's state to "
        "Running named 'Stalled' (the UI shows it; the run goes on, and stoker's own hang watchdog, "
        "launch.hang_timeout_seconds, still kills a gang that truly hangs); 'cancel' cancels the "
        "flow run (the gang is stopped as on any cancel).",
    )
