"""Prefect tasks around training: check the config, pin the run folder, find the resume
point, launch the gang. The work lives in storage/ and launch/; the torch side in training/."""

from __future__ import annotations

import time
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.runtime import flow_run, task_run

from stoker import preflight
from stoker.arithmetic.token_bytes import bits_per_byte_problem
from stoker.config import ConfigError, RunConfig
from stoker.contracts import events
from stoker.contracts.results import DataShards, ResumePoint, TrainingResult
from stoker.launch import make_launcher
from stoker.launch.attempts import launch_attempt
from stoker.launch.evaluation_child import kill_running_evaluations
from stoker.launch.monitor import TrainingMonitor
from stoker.observe.report import mixture_plan, records_with_the_base, rounded, run_plan
from stoker.observe.sinks import open_sinks
from stoker.orchestration.credentials import use_store_credentials
from stoker.orchestration.prefect_events import open_launch_events
from stoker.orchestration.publish import FLUSH_SECONDS, BestEffortPublisher, create_artifact, update_artifact
from stoker.orchestration.run_logger import run_logger
from stoker.storage.bases import document_end_note
from stoker.storage.branches import branch_point
from stoker.storage.checkpoints import find_latest_valid
from stoker.storage.layout import TOKENIZER_FILE
from stoker.storage.runs import pin_run_folder
from stoker.storage.store import Store, join
from stoker.tasks.evaluation import evaluate_checkpoint
from stoker.tasks.lease import held_lease, on_lease_lost
from stoker.tasks.policy import stoker_task
from stoker.tasks.report import artifact_key


@contextmanager
def accelerator_slot(limit_name: str, logger):
    """Hold a slot of the Prefect global concurrency limit `limit_name` while the ranks run,
    so two runs never take the same accelerators (`stoker deploy` creates it with one slot).
    No limit of that name on the server (an embedded server, a notebook): nothing to hold.
    Yields the seconds it waited for the slot (the ledger's queueing, not start-up)."""
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    if not limit_name:
        yield 0.0
        return
    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(limit_name)
    except ObjectNotFound:
        yield 0.0
        return
    if not limit.active:
        yield 0.0
        return
    logger.info(
        "taking a slot of concurrency limit %r (%d slot(s); waits while other runs hold them)", limit_name, limit.limit
    )
    asked = time.time()
    # a lease renewal that fails while the server is away must not end a healthy run
    with concurrency(limit_name, occupy=1, strict=True, raise_on_lease_renewal_failure=False):
        yield time.time() - asked


@stoker_task(name="validate_config")
def validate_config(config: RunConfig) -> RunConfig:
    """Every problem of the config at once, before anything is computed or written: the one
    preflight (``stoker.preflight``: the model's rules, the local files it names, the GPUs and
    torch it needs, the credentials block, whether the store root can be written and the
    MLflow tracking URI used). The credentials block stays in use for the run's tasks."""
    return preflight.check(config, load_credentials=use_store_credentials)


@stoker_task(name="write_run_config", retries=3)
def write_run_config(config: RunConfig, shards: DataShards) -> str:
    """Pin config.json, the tokenizer and the shard set in the run folder; return the config
    URL. First, what needs the shards' tokenizer: with 'bpb' in eval.sets, that its tokens can
    be counted in bytes exactly (a base's tokenizer may not), else one ConfigError before launch.
    No task timeout (policy.stoker_task): a few small store writes, each ended by the store
    client's own timeouts, and retried by this task."""
    store = Store.of(config.storage)
    unencodable = {
        s.name if shards.is_mixture else "": (s.unencodable_bytes, s.unencodable_example) for s in shards.sets
    }
    if "bpb" in config.eval.sets:
        tokenizer_json = store.read_bytes(join(shards.sets[0].key, TOKENIZER_FILE))
        problem = bits_per_byte_problem(tokenizer_json, shards.vocab_size, unencodable)
        if problem:
            raise ConfigError([problem])
    for name, (count, example) in unencodable.items():  # said even where nothing refuses it
        if count:
            run_logger().warning(
                "data%s: %d byte(s) of the text are ones the tokenizer's vocabulary cannot encode, dropped when "
                "tokenized (first: %s)",
                f" source {name!r}" if name else "",
                count,
                example,
            )
    url = pin_run_folder(store, config, shards)
    note = document_end_note(config)
    if note is not None:
        run_logger().info("%s; model.attention %r", note, config.model.attention)
    planned = run_plan(config)
    if planned is not None:  # what the run will need, logged before it spends anything
        logger = run_logger()
        for what, value in planned.rows():
            logger.info("plan: %s: %s", what, value)
    if shards.is_mixture:
        logger = get_run_logger()
        for line in mixture_plan(config, shards, store):
            logger.info("data mixture: %s", line)
    return url


def _is_base_eval(record: dict) -> bool:
    return record.get("event") == "eval" and record.get("step") == 0


@stoker_task(name="find_resume_checkpoint", retries=3)
def find_resume_checkpoint(config: RunConfig) -> ResumePoint:
    """Newest checkpoint of this run and model whose manifest and listing check out (no
    tensor is downloaded here: the full check is the ranks' load); every newer one skipped
    is reported with its reason. No task timeout (policy.stoker_task): listings and manifest
    reads, each ended by the store client's own timeouts, and retried by this task."""
    return _resume_point(config)


def _resume_point(config: RunConfig) -> ResumePoint:
    logger = get_run_logger()
    run = config.resolved_run_name()
    choice = find_latest_valid(
        Store.of(config.storage), run, expected={"run_name": run, "model_hash": config.model_hash()}, train=config.train
    )
    skipped = [f"{ref.url}: {reason}" for ref, reason in choice.skipped]
    for line in skipped:
        logger.warning("skipping invalid checkpoint %s", line)
    if choice.checkpoint is None and config.train.branch_from:  # a branch's first start: its branch point
        key, parent, step = branch_point(config)
        logger.info(
            "no checkpoint of its own: the branch starts from %s (run %s, step %d)",
            config.train.branch_from,
            parent,
            step,
        )
        return ResumePoint(checkpoint_key=key, checkpoint_uri=config.train.branch_from, step=step, skipped=skipped)
    if choice.checkpoint is None:
        logger.info("no valid checkpoint: training starts at step 0")
        return ResumePoint(skipped=skipped)
    ref = choice.checkpoint
    logger.info("resuming from %s (step %d)", ref.url, ref.step)
    return ResumePoint(checkpoint_key=ref.key, checkpoint_uri=ref.url, step=ref.step, skipped=skipped)


@stoker_task(name="launch_training", retry_delay_seconds=5)
def launch_training(config: RunConfig, config_url: str, shards: DataShards, resume: ResumePoint) -> TrainingResult:
    """Launch the gang (launch.launcher), stream every rank's log, stop it on any exit path.
    Retries (launch.max_attempts, set by the flow from the config) first look again for the
    newest valid checkpoint; the time limit is launch.timeout_seconds, kept by the launcher."""
    logger = get_run_logger()
    attempt = task_run.run_count or 1
    if attempt > 1:
        resume = _resume_point(config)
    result = TrainingResult(
        final_step=resume.step,
        final_checkpoint_key=resume.checkpoint_key,
        final_checkpoint_uri=resume.checkpoint_uri,
        resumed_from_step=resume.step,
        attempts=attempt,
        seconds=0.0,
    )
    max_steps = config.train.max_steps
    if resume.step >= max_steps:
        logger.info("run already complete at step %d; nothing to train", resume.step)
        return result
    ui = TrainingUI(config.resolved_run_name(), BestEffortPublisher(logger))
    ui.progress(100.0 * resume.step / max_steps)

    def evaluate_while_training(key: str, step: int):
        return evaluate_checkpoint.submit(config, config_url, key, shards.key)

    lease = held_lease(config, logger)  # this flow run's (a retry re-takes its own); LeaseLost if taken
    launcher = make_launcher(config, config_url, shards.key, resume.checkpoint_key)
    sinks = open_sinks(config, logger)  # TensorBoard, MLflow (metrics.*), or None
    # Prefect events (events.*) and this launch's stalled-run automation, or None
    prefect_events = open_launch_events(config, attempt, Store.of(config.storage), logger)
    monitor = TrainingMonitor(
        result,
        max_steps,
        logger,
        on_progress=ui.progress,
        on_commit=evaluate_while_training if config.eval.per_checkpoint_enabled else None,
        sink=ui.feeding(sinks, prefect_events),
    )
    if getattr(config.model, "init_from", None):  # each evaluation told against the base's (step 0)
        records = records_with_the_base(Store.of(config.storage), config.resolved_run_name())
        base = [r for r in records if _is_base_eval(r)]
        monitor.base_eval = base[-1] if base else {}
    try:
        # another launch took the run over (launch.takeover): stop the gang at once
        with (
            accelerator_slot(config.launch.concurrency_limit, logger) as slot_wait_seconds,
            on_lease_lost(config, lambda why: launcher.stop()),
        ):
            logger.info("launching %s", getattr(launcher, "description", config.launch.launcher))
            result = launch_attempt(
                launcher,
                monitor,
                Store.of(config.storage),
                config.resolved_run_name(),
                str(flow_run.id),
                attempt,
                resume.step,
                slot_wait_seconds=slot_wait_seconds,
            )
    except BaseException as exc:  # failed, cancelled (Prefect's TerminationSignal) or crashed: no evaluation left
        kill_running_evaluations()
        if prefect_events is not None:
            # stoker.run.failed (and .stalled), the automation removed; a cancel's grace is short
            prefect_events.ended(exc, timeout=5.0 if isinstance(exc, Exception) else 2.0)
        if sinks is not None:
            sinks.close("FAILED" if isinstance(exc, Exception) else "KILLED")
        ui.close(timeout=2.0)  # a cancel's grace is short; the UI is not worth waiting for
        if lease.lost and isinstance(exc, Exception):
            lease.check()  # LeaseLost (permanent): the gang was stopped for the new holder; no retry
        raise
    if prefect_events is not None:
        prefect_events.ended(None)
    if sinks is not None:
        sinks.close("FINISHED")
    ui.progress(100.0)
    ui.close()
    return result


class TrainingUI:
    """The progress bar and the live checkpoint table of one launch, sent best-effort: the
    stream loop only hands over the newest value (orchestration.publish), never waits for the server."""

    def __init__(self, run: str, publisher: BestEffortPublisher):
        self.run, self.publisher = run, publisher
        self.progress_id = None  # the artifact, once the server has it
        self.progress_key = artifact_key(run, "progress")
        # a key of its own: the report's final table (with each checkpoint's losses) keeps
        # "checkpoints", so the run's page shows one card of each, not two of one name
        self.table_key = artifact_key(run, "checkpoints-live")
        self.rows: list[dict] = []

    def progress(self, pct: float) -> None:
        self.publisher.latest("progress artifact", lambda: self._send_progress(pct))

    def _send_progress(self, pct: float) -> None:
        if self.progress_id is None:
            self.progress_id = create_artifact("progress", self.progress_key, f"steps of {self.run}", pct)
        else:
            update_artifact(self.progress_id, pct)

    def checkpoints(self, checkpoints: list[dict]) -> None:
        """The checkpoints committed so far (the report's final table adds their losses)."""
        rows = rounded(
            [
                {
                    "step": c["step"],
                    "uri": c["uri"],
                    "size_mb": (c.get("bytes") or 0) / 1e6,
                    "upload_seconds": c.get("upload_seconds"),
                }
                for c in checkpoints
            ]
        )
        if rows:
            self.publisher.latest(
                "checkpoint table",
                lambda: create_artifact("table", self.table_key, f"checkpoints of {self.run} committed so far", rows),
            )

    def feeding(self, sinks, prefect_events=None):
        """The monitor's sink: the metric sinks and the Prefect events (if any), and this
        table at each commit."""

        def sink(event: events.Event) -> None:
            if prefect_events is not None:
                prefect_events.sink(event)
            if isinstance(event, events.Step):  # a heartbeat: nothing else wants it
                return
            if isinstance(event, events.CheckpointCommitted):
                self.rows.append(
                    {"step": event.step, "uri": event.uri, "bytes": event.bytes, "upload_seconds": event.upload_seconds}
                )
                self.checkpoints(self.rows)
            if sinks is not None:
                sinks(event)

        return sink

    def close(self, timeout: float = FLUSH_SECONDS) -> None:
        """Send what is still pending (the server may be back), for `timeout` at most."""
        self.publisher.close(timeout)
