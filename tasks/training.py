"""Prefect tasks around training: check the config, pin the run folder, find the resume
point, launch the gang. The work lives in storage/ and launch/; the torch side in training/."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from core.config import RunConfig, StorageConfig, local_resource_problems
from core.failures import ConfigError
from core.results import ResumePoint, ShardInfo, TrainingResult
from launch import make_launcher
from launch.attempts import launch_attempt
from launch.monitor import TrainingMonitor
from storage.checkpoints import find_latest_valid
from storage.runs import pin_run_folder, store_problem
from storage.store import Store
from tasks.evaluate import evaluate_checkpoint, kill_running_evaluations
from tasks.policy import BACKOFF, JITTER, retry_if_transient


def _store(storage: StorageConfig) -> Store:
    return Store(storage.root, storage.storage_options)


@task(name="validate_config", cache_policy=NO_CACHE, persist_result=False)
def validate_config(config: RunConfig) -> RunConfig:
    """Every problem of the config at once, before anything is computed or written: the
    model's rules, the local files it names, and whether the store root can be written."""
    problems = local_resource_problems(config)
    try:
        config = config.check()
    except ConfigError as err:
        problems = err.problems + problems
    if problems:
        raise ConfigError(problems)
    problem = store_problem(_store(config.storage))
    if problem:
        raise ConfigError([problem])
    return config


@task(name="write_run_config", retries=3, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE, persist_result=False,
      timeout_seconds=600)
def write_run_config(config: RunConfig, shards: ShardInfo) -> str:
    """Pin config.json, the tokenizer and the shard set in the run folder; return the config URL."""
    return pin_run_folder(_store(config.storage), config, shards)


@task(name="find_resume_checkpoint", retries=3, retry_delay_seconds=BACKOFF,
      retry_jitter_factor=JITTER, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE,
      persist_result=False, timeout_seconds=3600)
def find_resume_checkpoint(config: RunConfig) -> ResumePoint:
    """Newest checkpoint of this run and model whose manifest and listing check out (no
    tensor is downloaded here: the full check is the ranks' load); every newer one skipped
    is reported with its reason."""
    return _resume_point(config)


def _resume_point(config: RunConfig) -> ResumePoint:
    logger = get_run_logger()
    run = config.resolved_run_name()
    choice = find_latest_valid(_store(config.storage), run,
                               expected={"run_name": run, "model_hash": config.model_hash()})
    skipped = [f"{ref.url}: {reason}" for ref, reason in choice.skipped]
    for line in skipped:
        logger.warning("skipping invalid checkpoint %s", line)
    if choice.checkpoint is None:
        logger.info("no valid checkpoint: training starts at step 0")
        return ResumePoint(skipped=skipped)
    ref = choice.checkpoint
    logger.info("resuming from %s (step %d)", ref.url, ref.step)
    return ResumePoint(checkpoint_key=ref.key, checkpoint_uri=ref.url, step=ref.step, skipped=skipped)


@task(name="launch_training", retry_delay_seconds=5, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE, persist_result=False)
def launch_training(config: RunConfig, config_url: str, shards: ShardInfo,
                    resume: ResumePoint) -> TrainingResult:
    """Launch the gang (launch.launcher), stream every rank's log, stop it on any exit path.
    Retries (launch.max_attempts, set by the flow from the config) first look again for the
    newest valid checkpoint; the time limit is launch.timeout_seconds, kept by the launcher."""
    logger = get_run_logger()
    attempt = task_run.run_count or 1
    if attempt > 1:
        resume = _resume_point(config)
    result = TrainingResult(final_step=resume.step, final_checkpoint_key=resume.checkpoint_key,
                            final_checkpoint_uri=resume.checkpoint_uri,
                            resumed_from_step=resume.step, attempts=attempt, seconds=0.0)
    max_steps = config.train.max_steps
    if resume.step >= max_steps:
        logger.info("run already complete at step %d; nothing to train", resume.step)
        return result
    progress = create_progress_artifact(progress=100.0 * resume.step / max_steps, key="training-progress",
                                        description=f"steps of {config.resolved_run_name()}")

    def evaluate_while_training(key: str, step: int):
        return evaluate_checkpoint.submit(config, config_url, key, shards.key)

    monitor = TrainingMonitor(
        result, max_steps, logger,
        on_progress=lambda pct: update_progress_artifact(progress, progress=pct),
        on_commit=evaluate_while_training if config.eval.per_checkpoint_enabled else None)
    launcher = make_launcher(config, config_url, shards.key, resume.checkpoint_key)
    logger.info("launching %s", getattr(launcher, "description", config.launch.launcher))
    try:
        result = launch_attempt(launcher, monitor, _store(config.storage), config.resolved_run_name(),
                                str(flow_run.id), attempt, resume.step)
    except BaseException:  # failed, cancelled (Prefect's TerminationSignal) or crashed: no evaluation left
        kill_running_evaluations()
        raise
    update_progress_artifact(progress, progress=100.0)
    return result
