"""Retry policy shared by the task decorators: retry what can heal, never a user mistake.
The verdict is core.failures.classify's, the same one the ranks and the launcher use."""

from __future__ import annotations

from prefect.tasks import exponential_backoff

from stoker.core.failures import is_transient

# 10 s, 20 s, 40 s ... with jitter, so many failed runs do not retry in lockstep
BACKOFF = exponential_backoff(backoff_factor=10)
JITTER = 0.5


def retry_if_transient(task, task_run, state) -> bool:
    """retry_condition_fn for Prefect tasks: retry only a transient failure."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return is_transient(exc if isinstance(exc, BaseException) else None)
