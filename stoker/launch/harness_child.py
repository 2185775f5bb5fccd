"""lm-evaluation-harness tasks on a committed checkpoint, in a process of its own
(stoker/training/harness_main.py, started by launch.child: the orchestrator's rooms never import
torch or run lm_eval). ``stoker harness`` calls ``run_harness``; a deployment can wrap it in a
task the same way."""

from __future__ import annotations

import json
import os

from stoker.config import RunConfig
from stoker.config.harness_tasks import OFFLINE_ENV, harness_problems
from stoker.contracts import events
from stoker.failures import CheckpointUnavailable, ConfigError, StokerError
from stoker.launch.child import Child, outcome
from stoker.launch.env import STORAGE_OPTIONS_ENV, child_env

HARNESS_TIMEOUT_SECONDS = 3600


class HarnessFailed(StokerError, RuntimeError):
    """The harness process ended without its result."""


def latest_checkpoint_uri(config: RunConfig) -> str:
    """The newest valid checkpoint of the config's run (storage.root, run_name): its URI.
    CheckpointUnavailable when the run has none."""
    from stoker.storage.checkpoints import find_latest_valid
    from stoker.storage.store import Store

    store = Store.of(config.storage)
    run = config.resolved_run_name()
    # the run's own config (its run folder) is what the export reads the checkpoint with
    choice = find_latest_valid(store, run, {"run_name": run})
    if choice.checkpoint is None:
        raise CheckpointUnavailable(
            f"run {run!r} has no valid checkpoint under {config.storage.root} to evaluate; give one with "
            "--checkpoint URI (stoker checkpoints RUN lists them), or name the run with --set run_name=..."
        )
    return store.url(choice.checkpoint.key)


def run_harness(
    source: str,
    tasks: list[str],
    include: list[str],
    limit: int | None = None,
    out: str | None = None,
    samples: bool = False,
    config: RunConfig | None = None,
    timeout: float = HARNESS_TIMEOUT_SECONDS,
    fields: tuple[str, str] = ("--tasks", "--include"),
) -> events.HarnessEvaluated:
    """The harness's metrics of `tasks` on `source` (a checkpoint URI, exported first into a
    temporary folder, or an exported folder). The names, the include folders and lm_eval
    itself are checked here first (ConfigError naming --tasks/--include), before any process
    starts; then ``python -m stoker.training.harness_main`` runs offline. HarnessFailed when it ends
    without a result. `fields`: what the problems call the tasks and the include folders."""
    found = harness_problems(tasks, include, *fields)
    if not tasks:
        found = [f"{fields[0]}: no task named; give task names, e.g. --tasks stoker_mc, or set eval.harness_tasks"]
    if found:
        raise ConfigError(found)
    env = child_env(config) if config is not None else dict(os.environ)
    env.update(OFFLINE_ENV)
    env.setdefault(STORAGE_OPTIONS_ENV, json.dumps(config.storage.storage_options if config else {}))
    args = [source, "--tasks", ",".join(tasks), *(a for d in include for a in ("--include", d))]
    args += ["--limit", str(limit)] if limit else []
    args += ["--out", os.path.abspath(out)] if out else []
    args += ["--samples"] if samples else []
    got = outcome(Child("stoker.training.harness_main", args, env).run(timeout), events.HarnessEvaluated, timeout)
    if got.result is not None:
        return got.result
    if got.failure is not None and got.failure.type == "ConfigError":
        raise ConfigError([got.failure.message])
    raise HarnessFailed(f"lm-evaluation-harness on {source} failed (exit {got.ended.returncode}): {got.why}")


def harness_line(done: events.HarnessEvaluated) -> str:
    """The metrics in one line per task."""
    lines = []
    for task in done.tasks:
        values = done.metrics.get(task, {})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items() if not k.endswith("_stderr"))
        lines.append(f"  {task}: {shown} ({done.num_items.get(task, '?')} items)")
    return "\n".join(lines)
