"""The final report: a markdown artifact, a checkpoint table, and the typed result."""

from __future__ import annotations

import base64
import dataclasses
import time

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from stoker.arithmetic.gains import changes_since_base, since_base_text
from stoker.config import RunConfig
from stoker.contracts.results import DataShards, EvalResult, PipelineResult, ResumePoint, TrainingResult
from stoker.observe.ledger import (
    FlowTimes,
    compute_ledger,
    deployment_ledgers,
    ledger_rows,
    read_attempt_log,
    read_records,
    store_ledger,
)
from stoker.observe.report import (
    DEDUP_SAMPLES_FILE,
    FILTER_SAMPLES_FILE,
    GAINS_PLOT_FILE,
    LOSS_CURVE_FILE,
    MIX_PLOT_FILE,
    checkpoint_rows,
    dedup_markdown,
    filters_markdown,
    lineage_markdown,
    loss_curve_png,
    mix_history,
    mix_markdown,
    mix_png,
    mixture_plan,
    plan_markdown,
    records_with_the_base,
    report_markdown,
    rounded,
    rounded_sources,
    run_history,
    run_plan,
    schedule_markdown,
    since_base_markdown,
    since_base_png,
    since_base_rows,
    slug,
    source_rows,
    stages_markdown,
    throughput_summary,
)
from stoker.observe.router import router_markdown
from stoker.storage.branches import lineage_chain
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
    config: RunConfig, shards: DataShards, resume: ResumePoint, training: TrainingResult, evaluation: EvalResult | None
) -> PipelineResult:
    """Summarize the run for the UI (artifacts) and for the caller (PipelineResult)."""
    started = time.time()
    store = Store.of(config.storage)
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
    mix = ""
    if shards.is_mixture:
        history = mix_history(store, run)
        sources = source_rows(shards, history, evaluation)
        result.sources = sources
        plot = ""
        if history:
            png = mix_png(history, f"{run}: data mixture")
            store.write_bytes(run_file_key(run, MIX_PLOT_FILE), png)
            plot = (
                f"![data mixture of {run}](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
                f"(also `{store.url(run_file_key(run, MIX_PLOT_FILE))}`)\n"
            )
        mix = mix_markdown(sources, plot, mixture_plan(config, shards, store))
        create_table_artifact(
            rounded_sources(sources),
            key=artifact_key(run, "sources"),
            description=f"the data mixture of {run}: per source, what it trained on and its validation losses",
        )
    if getattr(config.model, "init_from", None):  # gain and forgetting against the base
        mix += _since_base_section(store, run, result)
    if getattr(config.model, "num_experts", None):  # a mixture: the router's load and loss
        mix += router_markdown(store, run, config.model.num_experts)
    result.lineage = lineage_chain(store, run)
    mix += lineage_markdown(result.lineage)
    mix += schedule_markdown(config, store, run)
    planned = run_plan(config, training.micro_batch_size)
    result.plan = planned.to_dict() if planned is not None else None
    result.micro_batch_size = training.micro_batch_size
    mix += plan_markdown(planned)
    mix += stages_markdown(shards.stage_rows())  # the data stage, per source and stage
    if shards.filtered:  # what the quality filters removed, and a sample of it in the run folder
        mix += filters_markdown(shards.filtered, store.url(run_file_key(run, FILTER_SAMPLES_FILE)))
    if shards.dedup:  # what the data stage removed, and the sample of it in the run folder
        mix += dedup_markdown(shards.dedup, store.url(run_file_key(run, DEDUP_SAMPLES_FILE)))
    ledger, deployment_total = flow_run_ledger(config, store, started, evaluation)
    result.ledger = ledger
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
            # a loaded tokenizer (a base's) may have fewer ids than the model's rows
            shards.vocab_size if config.tokenizer.path else config.tokenizer.vocab_size,
            ledger=ledger,
            deployment_total=deployment_total,
            mix=mix,
        ),
    )
    return result


def _since_base_section(store: Store, run: str, result: PipelineResult) -> str:
    """The report's section on gain and forgetting per source (its plot kept in the run folder),
    the table artifact, and result.since_base."""
    changes = changes_since_base(records_with_the_base(store, run))
    if not changes:
        return ""
    rows = since_base_rows(changes)
    result.since_base = {r["source"]: {k: v for k, v in r.items() if k != "source"} for r in rows}
    png = since_base_png(changes, f"{run}: change since the base")
    store.write_bytes(run_file_key(run, GAINS_PLOT_FILE), png)
    plot = (
        f"![change since the base of {run}](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
        f"(also `{store.url(run_file_key(run, GAINS_PLOT_FILE))}`)\n"
    )
    create_table_artifact(
        rows,
        key=artifact_key(run, "since-base"),
        description=f"{run}: per source, the validation loss and bits per byte at the base and now",
    )
    return since_base_markdown(rows, plot, since_base_text(changes))


def _flow_times(report_started: float, evaluation: EvalResult | None) -> tuple[FlowTimes, str | None]:
    """This flow run's times from the Prefect server (due, started) and its deployment's name;
    without the server, the ledger spans the launches and the closing tasks only."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    due = began = deployment = None
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run.id)
            due = run.expected_start_time.timestamp() if run.expected_start_time else None
            began = run.start_time.timestamp() if run.start_time else None
            if run.deployment_id is not None:
                deployment = client.read_deployment(run.deployment_id).name
    except Exception as err:  # the ledger is told all the same, from stoker's own records
        get_run_logger().warning("the flow run's times could not be read (%s); the ledger starts at training", err)
    final_eval = evaluation.seconds if evaluation is not None else 0.0
    times = FlowTimes(expected_start=due, start=began, closing_start=report_started, evaluation_seconds=final_eval)
    return times, deployment


def flow_run_ledger(
    config: RunConfig, store: Store, report_started: float, evaluation: EvalResult | None
) -> tuple[dict, dict | None]:
    """This flow run's ledger (observe.ledger), kept in {run}/ledger.json and shown as a table
    artifact; with the sum over its deployment's runs when it came from a deployment."""
    from prefect.runtime import flow_run

    run, flow_run_id = config.resolved_run_name(), str(flow_run.id)
    times, deployment = _flow_times(report_started, evaluation)
    attempts = [a for a in read_attempt_log(store, run) if a.get("flow_run_id") == flow_run_id]
    records = read_records(store, run)
    ledger = compute_ledger(
        records,
        attempts,
        dataclasses.replace(times, end=time.time()),  # the wall-clock so far: up to this report
        accelerators=config.launch.world_size,
        price_per_accelerator_hour=config.cost.per_accelerator_hour,
        flow_run_id=flow_run_id,
        deployment=deployment,
    )
    store_ledger(store, run, ledger)
    create_table_artifact(
        ledger_rows(ledger),
        key=artifact_key(run, "ledger"),
        description=f"where the wall-clock of this flow run of {run} went, and its cost "
        "(cost.per_accelerator_hour x launch.world_size; queueing unpriced)",
    )
    total = deployment_ledgers(store).get(deployment) if deployment else None
    return ledger, total
