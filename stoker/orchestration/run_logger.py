"""The task or flow run's logger (its lines show in the UI), else a plain one: the same code
runs inside a flow and called directly (the tests, a notebook calling a task's function)."""

from __future__ import annotations

import logging


def run_logger(fallback: str = "stoker"):
    """Prefect's run logger inside a flow or task run, else the logger named `fallback`."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(fallback)
