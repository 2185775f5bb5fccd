"""Evaluate a committed checkpoint in a separate process (stoker/training/evaluation_main.py)."""

from __future__ import annotations

from prefect import get_run_logger

from stoker.config import RunConfig
from stoker.contracts.results import EvalResult
from stoker.failures import CheckpointUnavailable, is_transient
from stoker.launch.evaluation_child import run_evaluation
from stoker.observe.report import evaluation_line
from stoker.orchestration.caching import StoreCache, digest, result_shape
from stoker.storage import runs
from stoker.storage.checkpoints import validate_checkpoint
from stoker.storage.store import Store
from stoker.tasks.policy import stoker_task

# bump when what an evaluation computes changes without a change of its settings or result type
EVALUATION_VERSION = 1


def evaluation_key(store: Store, parameters: dict) -> str | None:
    """evaluate_checkpoint: the checkpoint's commit-manifest hash, when the checkpoint is
    committed and its files are there at their sizes (else no key: the evaluation says what is
    wrong), plus what the evaluation depends on besides (the validation shards, the eval
    settings, the precision, the result type). A deleted or replaced checkpoint has another
    manifest, so another key."""
    config, checkpoint_key = parameters["config"], parameters["checkpoint_key"]
    if not checkpoint_key:
        return None
    verdict = validate_checkpoint(store, checkpoint_key)
    if not verdict:
        return None
    settings = {
        "version": EVALUATION_VERSION,
        "shards": parameters["shard_key"],
        "eval": config.eval.model_dump(mode="json"),
        "precision": config.engine.precision,
        "result": result_shape(EvalResult),
    }
    return f"{digest(verdict.manifest)}-{digest(settings)}"


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


def _unpin_cached(parameters: dict) -> None:
    """On a cache hit: the checkpoint's evaluation is done, so a pin still on it is one its
    evaluation failed to remove (best effort there); removed now, so a hit leaves none."""
    from stoker.storage.checkpoints import EVAL_PIN
    from stoker.storage.store import Store, join

    config, checkpoint_key = parameters["config"], parameters["checkpoint_key"]
    if Store.of(config.storage).exists(join(checkpoint_key, EVAL_PIN)):
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
    is run_evaluation's (EVAL_TIMEOUT_SECONDS, the process is killed): a Prefect task timeout
    could not stop a task submitted to a worker thread, as training submits this one
    (policy.stoker_task)."""
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
            Store.of(config.storage),
            config.resolved_run_name(),
            checkpoint_key,
            config.checkpoint.keep_latest_k,
            config.checkpoint.evaluation_pin_seconds,
            train=config.train,  # the newest stable checkpoint stays, as the ranks' retention keeps it
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


@stoker_task(name="checkpoint_inputs", retries=2)
def checkpoint_inputs(
    checkpoint_uri: str, storage_options: dict, credentials_block: str | None = None
) -> tuple[RunConfig, str, str, str]:
    """From a checkpoint URI, the run's config, config URL, checkpoint key and shard key.
    The store is opened with the credentials of `credentials_block` when one is named.
    No task timeout (policy.stoker_task): a few small store reads, each ended by the store
    client's own timeouts, and retried by this task."""
    from stoker.orchestration.credentials import use_credentials_block

    use_credentials_block(credentials_block)
    return runs.checkpoint_inputs(checkpoint_uri, storage_options)
