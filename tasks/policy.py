"""Retry policy shared by the task decorators: retry what can heal, never a user mistake."""

from __future__ import annotations

from prefect.tasks import exponential_backoff

from tasks.data_prep import DataError
from tasks.launcher import TrainingFailed
from training.config import ConfigError

PERMANENT = (ConfigError, DataError, FileNotFoundError, PermissionError, NotADirectoryError,
             ValueError, TypeError, KeyError, MemoryError)

# 10 s, 20 s, 40 s ... with jitter, so many failed runs do not retry in lockstep
BACKOFF = exponential_backoff(backoff_factor=10)
JITTER = 0.5


def is_transient(exc: BaseException | None) -> bool:
    """Lost nodes, network and storage blips, time-outs: yes. Bad config or data: no."""
    if isinstance(exc, TrainingFailed):
        return exc.transient
    if isinstance(exc, PERMANENT):
        return False
    return isinstance(exc, (ConnectionError, TimeoutError, OSError)) or exc is None


def retry_if_transient(task, task_run, state) -> bool:
    """retry_condition_fn for Prefect tasks."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return is_transient(exc if isinstance(exc, BaseException) else None)
