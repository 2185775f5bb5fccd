"""The final report: a markdown artifact, a checkpoint table, and the typed result."""

from __future__ import annotations

import base64

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from stoker.core.config import RunConfig
from stoker.core.results import EvalResult, PipelineResult, ResumePoint, ShardInfo, TrainingResult
from stoker.observe.report import (
    LOSS_CURVE_FILE,
    checkpoint_rows,
    loss_curve_png,
    report_markdown,
    rounded,
    run_history,
    slug,
    throughput_summary,
)
from stoker.storage.checkpoints import list_checkpoints
from stoker.storage.layout import METRICS_FILE, run_file_key, run_key
from stoker.storage.store import Store
from stoker.tasks.policy import stoker_task


def artifact_key(run: str, what: str) -> str:
    """`{run}-{what}-{flow run id[:8]}`: unique per flow run (a later no-op run never replaces
    an earlier report), findable per stoker run by its prefix."""
    from prefect.runtime import flow_run

    return f"{slug(run)}-{what}-{str(flow_run.id or 'local')[:8]}"


@stoker_task(name="report")
def report(
    config: RunConfig, shards: ShardInfo, resume: ResumePoint, training: TrainingResult, evaluation: EvalResult | None
) -> PipelineResult:
    """Summarize the run for the UI (artifacts) and for the caller (PipelineResult)."""
    store = Store(config.storage.root, config.storage.storage_options)
    run = config.resolved_run_name()
    last_val = evaluation.val_loss if evaluation else (training.val_losses[-1][1] if training.val_losses else None)
    retained = {store.url(ref.key) for ref in list_checkpoints(store, run)}
    rows = checkpoint_rows(training, evaluation, retained)
    result = PipelineResult(
        run_name=run,
        run_uri=store.url(run_key(run)),
        final_step=training.final_step,
        final_checkpoint_uri=training.final_checkpoint_uri,
        last_val_loss=last_val,
        shard_cache_key=shards.cache_key,
        shard_uri=shards.url,
        data_cache_hit=shards.cache_hit,
        resumed_from_step=resume.step,
        metrics_uri=store.url(run_file_key(run, METRICS_FILE)),
        val_losses=training.val_losses,
        first_train_loss=training.train_losses[0][1] if training.train_losses else None,
        last_train_loss=training.train_losses[-1][1] if training.train_losses else None,
        checkpoints=rows,
        attempts=training.attempt_log,
        num_attempts=len(training.attempt_log),
        steps_lost=sum(a.get("steps_lost", 0) for a in training.attempt_log),
        goodput=training.goodput,
        **throughput_summary(training.throughput),
    )
    if rows:
        create_table_artifact(
            rounded(rows),
            key=artifact_key(run, "checkpoints"),
            description=f"checkpoints of {run} committed by this flow run, "
            "evaluated one by one; 'retained' is no once retention deleted it",
        )
    train_curve, val_curve = run_history(store, run)
    curve = ""
    if train_curve or val_curve:
        png = loss_curve_png(train_curve, val_curve, evaluation, f"{run}: loss")
        store.write_bytes(run_file_key(run, LOSS_CURVE_FILE), png)
        curve = (
            f"![loss curve of {run}](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
            f"(also `{store.url(run_file_key(run, LOSS_CURVE_FILE))}`)\n"
        )
    nothing_trained = training.final_step == resume.step
    create_markdown_artifact(
        key=artifact_key(run, "report"),
        description=f"summary of {run}",
        markdown=report_markdown(
            run,
            store,
            shards,
            resume,
            training,
            evaluation,
            result,
            curve,
            val_curve,
            nothing_trained,
            config.tokenizer.vocab_size,
        ),
    )
    return result
