"""Evaluate a committed checkpoint in a separate process (stoker/training/evaluate.py)."""

from __future__ import annotations

import time

from prefect import get_run_logger

from stoker.core import events
from stoker.core.config import RunConfig
from stoker.core.failures import CheckpointUnavailable, EvaluationStopped, TrainingFailed, is_transient
from stoker.core.results import EvalResult
from stoker.launch.child import Child
from stoker.launch.env import child_env
from stoker.observe.report import evaluation_line
from stoker.storage import runs
from stoker.tasks.caching import StoreCache, evaluation_key
from stoker.tasks.policy import stoker_task

EVAL_TIMEOUT_SECONDS = 1800
_LIVE: set[Child] = set()  # evaluation processes running now, in this process
_STOPPED_BY_TRAINING = "the end of its training (Ctrl-C, a cancel, a failed launch)"


def check_checkpoint_uri(uri: str) -> None:
    """ConfigError naming checkpoint_uri when it is not a checkpoint URL; on a local store
    (no credentials involved), CheckpointUnavailable when it holds no committed checkpoint
    there, so `stoker evaluate` of a deleted one says so in one line, before any server starts.
    An object store is asked by the flow, with its credentials."""
    from stoker.storage.checkpoints import COMMIT_FILE, unavailable_message
    from stoker.storage.layout import parse_checkpoint_url
    from stoker.storage.store import Store, join

    where = parse_checkpoint_url(uri)
    store = Store(where.root)
    if store.is_local and not store.exists(join(where.key, COMMIT_FILE)):
        raise CheckpointUnavailable(unavailable_message(store, where.key, "no commit manifest"))


def kill_running_evaluations() -> int:
    """Kill every evaluation process this process started (on cancel); returns how many.
    Their tasks must not retry what the stop just ended: EvaluationStopped."""
    children = list(_LIVE)
    for child in children:
        child.kill()
    return len(children)


def run_evaluation(
    config: RunConfig, config_url: str, checkpoint_key: str, shard_key: str, timeout: float = EVAL_TIMEOUT_SECONDS
) -> EvalResult:
    """Run `python -m stoker.training.evaluate` in a process of its own (launch.child); parse
    its JSON line."""
    t0 = time.monotonic()
    args = ["--config", config_url, "--checkpoint", checkpoint_key, "--shards", shard_key]
    with Child("stoker.training.evaluate", args, child_env(config)) as child:
        _LIVE.add(child)
        try:
            ended = child.wait(timeout)
        finally:
            _LIVE.discard(child)
    stopped = _STOPPED_BY_TRAINING if ended.killed else ended.stop_signal
    if stopped and ended.returncode != 0:  # (one that finished just before the kill counts)
        raise EvaluationStopped(f"evaluation of {checkpoint_key} was stopped by {stopped}; not retried")
    if ended.timed_out:
        raise TrainingFailed(
            f"evaluation of {checkpoint_key} gave no answer within {timeout:.0f}s; it was killed (not retried)",
            transient=False,
            reason="evaluation",
        )
    said = [e for e in map(events.decode, ended.out.splitlines()) if e is not None]
    done = [e for e in said if isinstance(e, events.Evaluated)]
    if ended.returncode != 0 or not done:
        failure = next((e for e in said if isinstance(e, events.Failure)), None)
        why = f"{failure.type}: {failure.message}" if failure else ended.err.strip()[-3000:]
        # a killed process (negative exit code) or a transient error (storage) may heal on retry
        transient = failure.transient if failure else (ended.returncode or 0) < 0
        raise TrainingFailed(
            f"evaluation of {checkpoint_key} failed (exit {ended.returncode}): {why}",
            transient=transient,
            reason="evaluation",
        )
    return EvalResult.of_event(done[-1], seconds=time.monotonic() - t0)


def _unpin_cached(parameters: dict) -> None:
    """On a cache hit: the checkpoint's evaluation is done, so a pin still on it is one its
    evaluation failed to remove (best effort there); removed now, so a hit leaves none."""
    from stoker.storage.checkpoints import EVAL_PIN
    from stoker.storage.store import Store, join

    config, checkpoint_key = parameters["config"], parameters["checkpoint_key"]
    if Store(config.storage.root, config.storage.storage_options).exists(join(checkpoint_key, EVAL_PIN)):
        _finish_evaluation(config, checkpoint_key)


@stoker_task(
    name="evaluate_checkpoint",
    retries=2,
    # two triggers of one checkpoint at once (the automation, a user, the run itself): one
    # evaluates, the other waits for its lock and reads its result
    cache=StoreCache(
        content_key=evaluation_key,
        on_hit=_unpin_cached,
        storage_parameter="config.storage",
        isolation_level="SERIALIZABLE",
    ),
)
def evaluate_checkpoint(config: RunConfig, config_url: str, checkpoint_key: str, shard_key: str) -> EvalResult:
    """Validation loss and perplexity of one committed checkpoint, from a fresh process.
    Cached by the checkpoint's commit-manifest hash (and the eval settings): a checkpoint is
    evaluated once; a second evaluation shows Cached and starts no process, also when it
    started while the first was running (it waits for the first one's lock). Its time limit
    is run_evaluation's (EVAL_TIMEOUT_SECONDS, the process is killed): a Prefect task timeout could not stop a task submitted to a worker thread, and says so in a
    warning on every call."""
    try:
        result = run_evaluation(config, config_url, checkpoint_key, shard_key)
    except BaseException as exc:  # a retry keeps the pin; a failure for good (or a stop) ends it
        if not (isinstance(exc, Exception) and is_transient(exc)):
            _finish_evaluation(config, checkpoint_key)
        raise
    _finish_evaluation(config, checkpoint_key)
    get_run_logger().info(
        "evaluated %s: %s (%d windows, %.1fs)",
        result.checkpoint_uri,
        evaluation_line(result),
        result.windows,
        result.seconds,
    )
    return result


def _finish_evaluation(config: RunConfig, checkpoint_key: str) -> None:
    """Remove the checkpoint's evaluation pin and apply the retention it held off (best effort:
    a pin left behind expires after checkpoint.evaluation_pin_seconds)."""
    from stoker.storage.checkpoints import finish_evaluation
    from stoker.storage.store import Store

    try:
        deleted = finish_evaluation(
            Store(config.storage.root, config.storage.storage_options),
            config.resolved_run_name(),
            checkpoint_key,
            config.checkpoint.keep_latest_k,
            config.checkpoint.evaluation_pin_seconds,
        )
    except Exception as err:  # the evaluation's own outcome matters more than the cleanup
        get_run_logger().warning(
            "could not remove the evaluation pin of %s (%s); it expires after checkpoint.evaluation_pin_seconds",
            checkpoint_key,
            err,
        )
        return
    if deleted:
        get_run_logger().info("retention, held off during the evaluation, deleted %s", ", ".join(deleted))


@stoker_task(name="checkpoint_inputs", retries=2, timeout_seconds=300)
def checkpoint_inputs(
    checkpoint_uri: str, storage_options: dict, credentials_block: str | None = None
) -> tuple[RunConfig, str, str, str]:
    """From a checkpoint URI, the run's config, config URL, checkpoint key and shard key.
    The store is opened with the credentials of `credentials_block` when one is named."""
    from stoker.tasks.credentials import use_credentials_block

    use_credentials_block(credentials_block)
    return runs.checkpoint_inputs(checkpoint_uri, storage_options)
