"""The record of every training launch of a flow run: where it started, how far it got,
why it ended. Kept in {root}/runs/{run}/attempts.jsonl so retries (new task-run attempts)
can see the earlier ones; the summary derives steps lost and goodput from it, and the run's
ledger (observe.ledger) its windows: started_at, gang_ended_at (the ranks gone), ended_at, and
slot_wait_seconds (the wait for an accelerator slot just before started_at)."""

from __future__ import annotations

import json
import statistics
import time

from stoker.contracts.results import TrainingResult
from stoker.launch.base import Launcher
from stoker.launch.monitor import TrainingMonitor
from stoker.storage.layout import ATTEMPTS_FILE, run_file_key
from stoker.storage.store import Store


def attempts_key(run_name: str) -> str:
    return run_file_key(run_name, ATTEMPTS_FILE)


def record_attempt(store: Store, run_name: str, **record) -> None:
    record.setdefault("ended_at", time.time())
    store.append_text(attempts_key(run_name), json.dumps(record, sort_keys=True) + "\n")


def read_attempts(store: Store, run_name: str, flow_run_id: str | None) -> list[dict]:
    """This flow run's attempts, oldest first."""
    if not store.exists(attempts_key(run_name)):
        return []
    rows = [json.loads(line) for line in store.read_bytes(attempts_key(run_name)).splitlines() if line.strip()]
    return [r for r in rows if r.get("flow_run_id") == flow_run_id]


def summarize(attempts: list[dict], final_step: int) -> dict:
    """Steps lost per attempt (work done past the checkpoint the next attempt resumed from)
    and goodput: net new steps x typical step time / wall time of all attempts (start of
    the first to end of the last, so failures, restarts and recomputed steps all count)."""
    step_seconds = [a["median_step_seconds"] for a in attempts if a.get("median_step_seconds")]
    for i, a in enumerate(attempts):
        nxt = attempts[i + 1]["resumed_from_step"] if i + 1 < len(attempts) else a["reached_step"]
        a["steps_lost"] = max(0, a["reached_step"] - nxt)
    if not attempts:
        return {"attempts": [], "num_attempts": 0, "steps_lost": 0, "goodput": None}
    wall = attempts[-1]["ended_at"] - attempts[0]["started_at"]
    net_steps = final_step - attempts[0]["resumed_from_step"]
    useful = net_steps * statistics.median(step_seconds) if step_seconds else None
    return {
        "attempts": attempts,
        "num_attempts": len(attempts),
        "steps_lost": sum(a["steps_lost"] for a in attempts),
        "goodput": round(useful / wall, 4) if useful is not None and wall > 0 else None,
        "wall_seconds": round(wall, 3),
        "useful_seconds": round(useful, 3) if useful is not None else None,
    }


def launch_attempt(
    launcher: Launcher,
    monitor: TrainingMonitor,
    store: Store,
    run_name: str,
    flow_run_id: str,
    attempt: int,
    resume_step: int,
    slot_wait_seconds: float = 0.0,
) -> TrainingResult:
    """Run one launch to its end, record it in attempts.jsonl, and raise TrainingFailed
    (transient or not) when it failed; else return the result with the attempts summary.
    `slot_wait_seconds`: how long the launch waited for its accelerator slot just before it
    (recorded: the ledger counts it as queueing)."""
    started_at = time.time()
    try:
        gang = launcher.run(on_line=monitor.logger.info, on_event=monitor)
    except BaseException as stop:  # Ctrl-C, a cancel, SIGTERM: the gang is stopped; say so
        result = monitor.result
        logged = result.train_losses[-1][0] if result.train_losses else resume_step
        try:
            record_attempt(
                store,
                run_name,
                flow_run_id=flow_run_id,
                attempt=attempt,
                started_at=started_at,
                resumed_from_step=resume_step,
                reached_step=max(logged, result.final_step),
                committed_step=result.final_step,
                outcome=f"interrupted ({type(stop).__name__})",
                median_step_seconds=monitor.median_step_seconds(),
                slot_wait_seconds=slot_wait_seconds,
            )
        except Exception as err:  # the store may be what failed; the interruption still wins
            monitor.logger.warning("the interrupted attempt could not be recorded: %s", err)
        raise
    gang_ended_at = time.time()  # after it: the wait for the evaluations submitted while training
    monitor.collect_evaluations()
    failure = launcher.classify_end(gang)
    result = monitor.result
    record_attempt(
        store,
        run_name,
        flow_run_id=flow_run_id,
        attempt=attempt,
        started_at=started_at,
        resumed_from_step=resume_step,
        reached_step=gang.last_step or resume_step,
        committed_step=result.final_step,
        outcome=failure.reason if failure else "completed",
        error=str(failure).split("\n", 1)[0][:500] if failure else None,  # why, in one line
        median_step_seconds=monitor.median_step_seconds(),
        gang_ended_at=gang_ended_at,
        slot_wait_seconds=slot_wait_seconds,
    )
    if failure is not None:
        raise failure
    summary = summarize(read_attempts(store, run_name, flow_run_id), result.final_step)
    result.seconds, result.attempt_log, result.goodput = gang.seconds, summary["attempts"], summary["goodput"]
    monitor.logger.info(
        "training done: %d attempt(s), %d step(s) lost, goodput %s",
        summary["num_attempts"],
        summary["steps_lost"],
        summary["goodput"],
    )
    return result
