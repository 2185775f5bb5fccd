"""Prefect tasks around training: check the config, pin the run folder, find the resume
point, launch the gang. The torch side lives in training/ and knows nothing of Prefect."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from storage.checkpoints import find_latest_valid, run_key
from storage.store import Store, default_cache_dir, join
from launch.attempts import read_attempts, record_attempt, summarize
from core.results import ShardInfo
from tasks.evaluate import evaluate_checkpoint, kill_running_evaluations
from launch.torchrun import child_env, classify, free_port, run_gang, torchrun_commands
from launch.monitor import TrainingMonitor
from tasks.policy import BACKOFF, JITTER, retry_if_transient
from core.results import ResumePoint, TrainingResult
from core.config import ConfigError, RunConfig


def _store(cfg: RunConfig) -> Store:
    return Store(cfg.storage.root, cfg.storage.storage_options)


@task(name="validate_config", cache_policy=NO_CACHE, persist_result=False)
def validate_config(config: RunConfig) -> RunConfig:
    """Every problem of the config at once, before anything is computed or written."""
    return config.check()


@task(name="write_run_config", retries=3, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE, persist_result=False)
def write_run_config(config: RunConfig, shards: ShardInfo) -> str:
    """Write config.json (and the tokenizer) into the run folder; return the config URL.

    A run folder that already holds checkpoints of another model is refused: resuming
    from it could not load, and overwriting it would lose work."""
    store = _store(config)
    run = run_key(config.resolved_run_name())
    key = join(run, "config.json")
    if store.exists(key):
        old = RunConfig.model_validate_json(store.read_bytes(key))
        if old.model_hash() != config.model_hash():
            raise ConfigError([
                f"run_name: run {config.resolved_run_name()!r} already holds a different model "
                "(model or tokenizer.vocab_size changed); choose a new run_name."])
    store.write_bytes(key, config.to_json().encode())
    store.copy(join(shards.key, "tokenizer.json"), join(run, "tokenizer.json"))
    store.write_json(join(run, "shards.json"), shards.as_dict())
    return store.url(key)


@task(name="find_resume_checkpoint", retries=3, retry_delay_seconds=BACKOFF,
      retry_jitter_factor=JITTER, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE,
      persist_result=False)
def find_resume_checkpoint(config: RunConfig) -> ResumePoint:
    """Newest checkpoint that passes a deep check; every newer invalid one is reported."""
    return _resume_point(config)


def _resume_point(config: RunConfig) -> ResumePoint:
    store, logger = _store(config), get_run_logger()
    choice = find_latest_valid(store, config.resolved_run_name(), cache_dir=default_cache_dir())
    skipped = [f"{ref.url}: {reason}" for ref, reason in choice.skipped]
    for line in skipped:
        logger.warning("skipping invalid checkpoint %s", line)
    if choice.checkpoint is None:
        logger.info("no valid checkpoint: training starts at step 0")
        return ResumePoint(skipped=skipped)
    ref = choice.checkpoint
    logger.info("resuming from %s (step %d)", ref.url, ref.step)
    return ResumePoint(checkpoint_key=ref.key, checkpoint_uri=ref.url, step=ref.step, skipped=skipped)


@task(name="launch_training", retries=1, retry_delay_seconds=5, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE, persist_result=False)
def launch_training(config: RunConfig, config_url: str, shards: ShardInfo,
                    resume: ResumePoint) -> TrainingResult:
    """Start torchrun agents (own process groups), stream every rank's log, kill the gang on
    any exit path. A retry first looks again for the newest valid checkpoint."""
    logger = get_run_logger()
    attempt = task_run.run_count or 1
    if attempt > 1:
        resume = _resume_point(config)
    cfg = config
    if resume.step >= cfg.train.max_steps:
        logger.info("run already complete at step %d; nothing to train", resume.step)
        return TrainingResult(final_step=resume.step, final_checkpoint_key=resume.checkpoint_key,
                              final_checkpoint_uri=resume.checkpoint_uri,
                              resumed_from_step=resume.step, attempts=attempt, seconds=0.0)
    progress = create_progress_artifact(
        progress=100.0 * resume.step / cfg.train.max_steps, key="training-progress",
        description=f"steps of {cfg.resolved_run_name()}")
    result = TrainingResult(final_step=resume.step, final_checkpoint_key=resume.checkpoint_key,
                            final_checkpoint_uri=resume.checkpoint_uri,
                            resumed_from_step=resume.step, attempts=attempt, seconds=0.0)

    def evaluate_while_training(key: str, step: int):
        return evaluate_checkpoint.submit(cfg, config_url, key, shards.key)

    monitor = TrainingMonitor(
        result, cfg.train.max_steps, _store(cfg).root, logger,
        on_progress=lambda pct: update_progress_artifact(progress, progress=pct),
        on_commit=evaluate_while_training if cfg.eval.per_checkpoint_enabled else None)
    cmds = torchrun_commands(cfg, config_url, shards.key, resume.checkpoint_key,
                             free_port(cfg.launch.rdzv_host))
    logger.info("launching %d node(s) x %d rank(s): %s", cfg.launch.num_nodes,
                cfg.launch.nproc_per_node, " ".join(cmds[0][2:]))
    started_at = time.time()
    try:
        gang = run_gang(cmds, child_env(cfg), cfg.launch.nproc_per_node, on_line=logger.info,
                        on_metric=monitor, timeout=cfg.launch.timeout_seconds,
                        hang_timeout=cfg.launch.hang_timeout_seconds)
    except BaseException:  # cancelled (Prefect's TerminationSignal) or crashed: leave nothing behind
        kill_running_evaluations()
        raise
    monitor.collect_evaluations()
    failure = None if gang.reason == "completed" else classify(gang)
    store, run = _store(cfg), cfg.resolved_run_name()
    record_attempt(store, run, flow_run_id=str(flow_run.id), attempt=attempt, started_at=started_at,
                   resumed_from_step=resume.step, reached_step=gang.last_step or resume.step,
                   committed_step=result.final_step,
                   outcome=failure.reason if failure else "completed",
                   median_step_seconds=monitor.median_step_seconds())
    if failure is not None:
        raise failure
    attempts = read_attempts(store, run, str(flow_run.id))
    summary = summarize(attempts, result.final_step)
    result.seconds, result.attempt_log, result.goodput = gang.seconds, summary["attempts"], summary["goodput"]
    logger.info("training done: %d attempt(s), %d step(s) lost, goodput %s", summary["num_attempts"],
                summary["steps_lost"], summary["goodput"])
    update_progress_artifact(progress, progress=100.0)
    return result


@task(name="checkpoint_inputs", retries=2, retry_delay_seconds=BACKOFF, retry_condition_fn=retry_if_transient,
      cache_policy=NO_CACHE, persist_result=False)
def checkpoint_inputs(checkpoint_uri: str, storage_options: dict) -> tuple[RunConfig, str, str, str]:
    """From a checkpoint URI, the run's config, config URL, checkpoint key and shard key."""
    marker = "/runs/"
    if marker not in checkpoint_uri or "/checkpoints/" not in checkpoint_uri:
        raise ConfigError([f"checkpoint_uri: {checkpoint_uri!r} is not of the form "
                           "{root}/runs/{run}/checkpoints/step-NNNNNNNN"])
    root, rest = checkpoint_uri.rstrip("/").rsplit(marker, 1)
    run_name = rest.split("/", 1)[0]
    store = Store(root, storage_options)
    config = RunConfig.model_validate_json(store.read_bytes(join(run_key(run_name), "config.json")))
    config = config.model_copy(update={"storage": config.storage.model_copy(
        update={"root": root, "storage_options": storage_options or config.storage.storage_options})})
    shard_key = store.read_json(join(run_key(run_name), "shards.json"))["key"]
    return (config, store.url(join(run_key(run_name), "config.json")),
            "runs/" + rest, shard_key)
