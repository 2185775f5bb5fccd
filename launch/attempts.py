"""The record of every training launch of a flow run: where it started, how far it got,
why it ended. Kept in {root}/runs/{run}/attempts.jsonl so retries (new task-run attempts)
can see the earlier ones; the summary derives steps lost and goodput from it."""

from __future__ import annotations

import json
import statistics
import time

from storage.checkpoints import run_key
from storage.store import Store, join


def attempts_key(run_name: str) -> str:
    return join(run_key(run_name), "attempts.jsonl")


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
