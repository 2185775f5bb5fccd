"""Make a soup in a process of its own (stoker/training/soup_main.py, started by launch.child: the
orchestrator's rooms never import torch). The soup flow's make_soup task calls ``run_soup``."""

from __future__ import annotations

import json
import os
import tempfile

from stoker.contracts.soups import Souped
from stoker.failures import TrainingFailed
from stoker.launch.child import Child, outcome
from stoker.launch.env import STORAGE_OPTIONS_ENV, child_env
from stoker.storage.soups import SoupPlan, resolve_soup

SOUP_TIMEOUT_SECONDS = 3600


def check_soup(checkpoints: list[str], weights: list[float] | None, run_name: str | None, **kw) -> SoupPlan:
    """The soup's checks before anything starts (storage.soups.resolve_soup), for `stoker soup`."""
    return resolve_soup(checkpoints, weights, run_name, **kw)


def run_soup(plan: SoupPlan, timeout: float = SOUP_TIMEOUT_SECONDS) -> Souped:
    """`python -m stoker.training.soup_main` on the plan; its Souped event. TrainingFailed
    (reason 'soup') otherwise, transient when the process was killed or its failure is."""
    env = child_env(plan.config)
    env[STORAGE_OPTIONS_ENV] = json.dumps(plan.storage_options or {})
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="stoker-soup-", delete=False) as f:
        f.write(plan.to_json())
    try:
        got = outcome(Child("stoker.training.soup_main", ["--plan", f.name], env).run(timeout), Souped, timeout, 500)
    finally:
        os.unlink(f.name)
    if got.result is not None:
        return got.result
    transient = got.failure.transient if got.failure else (got.ended.returncode or 0) < 0
    raise TrainingFailed(
        f"soup {plan.run_name} failed (exit {got.ended.returncode}): {got.why}", transient=transient, reason="soup"
    )
