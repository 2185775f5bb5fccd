"""The policy every stoker task shares, on one decorator: retry what can heal, never a user
mistake. The verdict is failures.classify's, the same one the ranks and the launcher use."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from stoker.failures import is_transient

if TYPE_CHECKING:
    from stoker.orchestration.caching import StoreCache

# 10 s, 20 s, 40 s ... with jitter, so many failed runs do not retry in lockstep
BACKOFF = exponential_backoff(backoff_factor=10)
JITTER = 0.5


def retry_if_transient(task, task_run, state) -> bool:
    """retry_condition_fn for Prefect tasks: retry only a transient failure."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return is_transient(exc if isinstance(exc, BaseException) else None)


def stoker_task(
    name: str,
    *,
    retries: int = 0,
    timeout_seconds: float | None = None,
    retry_delay_seconds: float | Callable = BACKOFF,
    cache: StoreCache | None = None,
) -> Callable:
    """Prefect's ``@task`` with the policy every stoker task shares, so each says only what
    differs (its name, how often it retries, its cache): a failure is retried only when
    transient (`retry_if_transient`), after `BACKOFF` with `JITTER`.

    `timeout_seconds` is refused on a sync function (ValueError where the task is written).
    Prefect interrupts a sync task at its timeout only on the main thread (a SIGALRM); on a
    worker thread, where every submitted task runs (and every task of a flow run started off
    the main thread), the timeout cannot interrupt a blocking call and Prefect logs a WARNING
    on each run saying so (prefect/task_engine.py, SyncTaskRunEngine.run_context). A task's
    limit must not depend on the thread it lands on: work that can block gets a deadline that
    ends it instead, a child process killed at its limit (run_evaluation; the launcher's
    launch.timeout_seconds) or a call with its own timeout. An async task's timeout (a
    cancellation at its next ``await``) works on any thread and is passed on.

    Without `cache`, results are neither cached nor persisted. With one (orchestration.caching), the
    cache key is the store's content key of the task's output, and a cached record counts only
    while the store holds the output it names with a valid manifest (the manifests stay the
    truth: a deleted store is never masked by a stale entry); records persist in the store
    itself (``{root}/prefect-results/``) as JSON, and a hit shows Cached in the UI. Such a task
    keeps its result storage on the task object: make a variant with stoker_task, not
    ``with_options`` (Prefect's Task refuses the unsaved block there)."""
    policy = dict(
        name=name,
        retries=retries,
        retry_delay_seconds=retry_delay_seconds,
        retry_jitter_factor=JITTER,
        retry_condition_fn=retry_if_transient,
        timeout_seconds=timeout_seconds,
    )

    def decorate(fn: Callable):
        if timeout_seconds is not None and not inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"task {name!r}: timeout_seconds on a sync task cannot interrupt it in a worker thread "
                "(Prefect only warns); drop it and give the blocking work its own deadline (a child "
                "process killed at its limit, a call with a timeout)"
            )
        if cache is None:
            return task(**policy, cache_policy=NO_CACHE, persist_result=False)(fn)
        from stoker.orchestration.caching import StoreResultSerializer, attach_results

        made = task(
            **policy,
            cache_policy=cache,
            persist_result=True,
            result_serializer=StoreResultSerializer(),
            # records are read back from the store, never from memory: a hit says so (cache_hit)
            cache_result_in_memory=False,
        )(fn)
        return attach_results(made, cache)

    return decorate


def with_run_name(made, run_name: str):
    """A variant of a stoker task whose runs are named `run_name` in the UI (a data task of one
    source of a mixture: 'tokenize_and_shard[web]'). A cached task's result storage is an
    unsaved block, which Prefect's Task refuses at construction: the variant is made without it
    (the task itself untouched, so flows in other threads are not affected) and gets it after."""
    variant = made.with_options(task_run_name=run_name, result_storage=None)
    variant.result_storage = made.result_storage
    return variant
