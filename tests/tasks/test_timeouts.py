"""Task time limits that work: no stoker task configures a Prefect timeout that Prefect can only
warn about. Prefect 3 logs "Timeout of ... seconds configured for this task, but the task is
running in a worker thread ... cannot interrupt blocking operations" for every sync task with a
timeout that runs off the main thread (prefect/task_engine.py, SyncTaskRunEngine.run_context),
as every submitted task does; such a limit cannot end the task. Work that can block has a
deadline of its own instead (a child process killed at its limit, a call with a timeout)."""

import importlib
import inspect
import logging
import pkgutil

import pytest

import stoker.tasks

WORKER_THREAD_WARNING = "cannot interrupt blocking operations"


def stoker_tasks() -> dict:
    """Every Prefect task defined in stoker/tasks/, by name."""
    from prefect import Task

    found = {}
    for info in pkgutil.iter_modules(stoker.tasks.__path__):
        module = importlib.import_module(f"stoker.tasks.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Task) and value.fn.__module__ == module.__name__:
                found[value.name] = value
    return found


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_stoker_tasks_are_found():
    names = set(stoker_tasks())
    assert {"download_dataset", "tokenize_and_shard", "evaluate_checkpoint", "launch_training"} <= names


@pytest.mark.e2e
def test_no_stoker_task_submitted_to_a_worker_thread_logs_prefects_timeout_warning(prefect_server):
    """Each stoker task submitted as the flows submit theirs (the default thread pool), with
    arguments that end it at once: the warning is logged before the task's body runs, so each
    run shows what its timeout would say. A plain Prefect task with a timeout, submitted the
    same way, shows the warning is seen here."""
    from prefect import flow, task

    tasks = stoker_tasks()

    @task(name="control_with_timeout", timeout_seconds=60)
    def control_with_timeout() -> None:
        return None

    @flow(name="timeouts-in-worker-threads")
    def submit_each() -> list[str]:
        futures = {"control_with_timeout": control_with_timeout.submit()}
        for name, made in tasks.items():
            futures[name] = made.submit(**{p: None for p in inspect.signature(made.fn).parameters})
        for future in futures.values():
            future.wait()
        return sorted(name for name, future in futures.items() if future.state.is_final())

    handler = Records()
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        state = submit_each(return_state=True)
    finally:
        logger.removeHandler(handler)
    assert state.is_completed(), state.message
    assert state.result() == sorted([*tasks, "control_with_timeout"])  # every task ran to its end
    warned = sorted(
        r.task_name for r in handler.records if r.levelno == logging.WARNING and WORKER_THREAD_WARNING in r.getMessage()
    )
    assert "control_with_timeout" in warned, "the warning was not seen: the test sees nothing"
    only_warned = [name for name in warned if name != "control_with_timeout"]
    assert only_warned == [], f"Prefect warns that the timeout of {only_warned} cannot interrupt them"


def test_a_timeout_on_a_sync_stoker_task_is_refused_where_it_is_written():
    """A sync task's Prefect timeout would only warn in a worker thread: stoker_task refuses
    it, naming what to do instead; an async task's timeout (anyio cancellation) is kept."""
    from stoker.tasks.policy import stoker_task

    def blocking() -> None:
        return None

    async def awaiting() -> None:
        return None

    with pytest.raises(ValueError, match="timeout_seconds.*worker thread"):
        stoker_task(name="blocking", timeout_seconds=60)(blocking)
    assert stoker_task(name="awaiting", timeout_seconds=60)(awaiting).timeout_seconds == 60
    assert all(t.timeout_seconds is None for t in stoker_tasks().values() if not t.isasync)
