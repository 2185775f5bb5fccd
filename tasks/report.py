"""The final report: a markdown artifact, a checkpoint table, and the typed result."""

from __future__ import annotations

import statistics

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from storage.layout import METRICS_FILE, checkpoints_key, run_file_key, run_key
from storage.store import Store
from core.results import ShardInfo
from core.results import EvalResult, PipelineResult, ResumePoint, TrainingResult
from core.config import RunConfig


@task(name="report", cache_policy=NO_CACHE, persist_result=False)
def report(config: RunConfig, shards: ShardInfo, resume: ResumePoint, training: TrainingResult,
           evaluation: EvalResult | None) -> PipelineResult:
    """Summarize the run for the UI (artifacts) and for the caller (PipelineResult)."""
    store = Store(config.storage.root, config.storage.storage_options)
    run = config.resolved_run_name()
    last_val = evaluation.val_loss if evaluation else (training.val_losses[-1][1] if training.val_losses else None)
    rows = checkpoint_rows(training, evaluation)
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
        create_table_artifact(rows, key=f"checkpoints-{_slug(run)}",
                              description=f"committed checkpoints of {run}, evaluated one by one")
    evals = "\n".join(f"| {s} | {v:.4f} |" for s, v in training.val_losses) or "| - | - |"
    final = (f"{evaluation.val_loss:.4f} (perplexity {evaluation.val_ppl:.1f}, step {evaluation.step})"
             if evaluation else "n/a")
    create_markdown_artifact(
        key=f"run-report-{_slug(run)}",
        description=f"summary of {run}",
        markdown=f"""# {run}
- steps: {resume.step} -> {training.final_step}
- throughput: {_throughput_line(result)}
- checkpoints given up or dropped (never committed): {training.failed_checkpoints or 'none'}; in-place restarts: {training.restarts}
- attempts: {result.num_attempts}, steps lost to failures: {result.steps_lost}, goodput: {result.goodput}
{_attempt_lines(training.attempt_log)}
- final checkpoint: `{training.final_checkpoint_uri}`
- final validation loss: {final}
- shards: `{shards.url}` ({'cache hit' if shards.cache_hit else 'tokenized'}; {shards.num_train_tokens} train tokens)
- checkpoints: `{store.url(checkpoints_key(run))}`
- metrics: `{result.metrics_uri}`

| step | validation loss |
|---|---|
{evals}
""",
    )
    return result


def throughput_summary(rows: list[dict]) -> dict:
    """Medians over the log steps after the first (which holds start-up and compilation)."""
    steady = rows[1:] or rows
    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None
    peaks = [r["peak_memory_gb"] for r in rows if r.get("peak_memory_gb") is not None]
    return {"tokens_per_second": median("tokens_per_second"), "mfu": median("mfu"),
            "peak_memory_gb": max(peaks) if peaks else None}


def _throughput_line(result) -> str:
    if result.tokens_per_second is None:
        return "n/a"
    line = f"{result.tokens_per_second:,.0f} tokens/s (median)"
    if result.mfu is not None:
        line += f", MFU {100 * result.mfu:.1f}%"
    if result.peak_memory_gb is not None:
        line += f", peak GPU memory {result.peak_memory_gb:.1f} GB"
    return line


def checkpoint_rows(training: TrainingResult, final: EvalResult | None) -> list[dict]:
    """One row per committed checkpoint: step, URI, size, upload seconds, validation loss."""
    losses = {e.checkpoint_uri: e.val_loss for e in training.evaluations}
    if final is not None:
        losses[final.checkpoint_uri] = final.val_loss
    return [{"step": c["step"], "uri": c["uri"], "size_mb": round((c.get("bytes") or 0) / 1e6, 3),
             "upload_seconds": c.get("upload_seconds"), "val_loss": losses.get(c["uri"])}
            for c in training.checkpoints]


def _attempt_lines(attempts: list[dict]) -> str:
    return "\n".join(
        f"  - attempt {a['attempt']}: steps {a['resumed_from_step']} -> {a['reached_step']}, "
        f"{a['outcome']}, {a.get('steps_lost', 0)} step(s) lost" for a in attempts)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())
