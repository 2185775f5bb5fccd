"""Evaluating a committed checkpoint in a process of its own (``python -m
stoker.training.evaluation_main``, started by launch.child: the orchestrator's rooms never import
torch); the task is tasks.evaluation.evaluate_checkpoint."""

from __future__ import annotations

import time

from stoker.config import RunConfig
from stoker.contracts import events
from stoker.contracts.results import EvalResult
from stoker.failures import EvaluationStopped, TrainingFailed
from stoker.launch.child import Child, outcome
from stoker.launch.env import child_env

EVAL_TIMEOUT_SECONDS = 1800
_LIVE: set[Child] = set()  # evaluation processes running now, in this process
_STOPPED_BY_TRAINING = "the end of its training (Ctrl-C, a cancel, a failed launch)"


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
    """Run `python -m stoker.training.evaluation_main` in a process of its own (launch.child); parse
    its JSON line."""
    t0 = time.monotonic()
    args = ["--config", config_url, "--checkpoint", checkpoint_key, "--shards", shard_key]
    with Child("stoker.training.evaluation_main", args, child_env(config)) as child:
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
    got = outcome(ended, events.Evaluated, timeout, err_words=500)
    if got.result is None:
        # a killed process (negative exit code) or a transient error (storage) may heal on retry
        transient = got.failure.transient if got.failure else (ended.returncode or 0) < 0
        raise TrainingFailed(
            f"evaluation of {checkpoint_key} failed (exit {ended.returncode}): {got.why}",
            transient=transient,
            reason="evaluation",
        )
    return EvalResult.of_event(got.result, seconds=time.monotonic() - t0)
