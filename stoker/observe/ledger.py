"""The goodput and cost ledger: every second of a flow run's wall-clock attributed to one cause,
from stoker's own records, and priced. Plain code (no Prefect, no torch); tasks/report.py
publishes it, `stoker runs` reads it.

The records:
- ``{run}/attempts.jsonl`` (launch.attempts): each launch's window, started_at -> gang_ended_at
  (the ranks gone) -> ended_at (its record written), where it resumed from, how it ended;
- ``{run}/metrics.jsonl`` (rank 0's events): each Train (and the last, Done) carries its
  interval's own account: it began at wall time ``since`` after step ``since_step``, spent
  ``eval_seconds`` in evaluations and ``checkpoint_seconds`` in checkpoint stalls, and waited
  ``data_wait_share`` of the rest for batches; Eval carries its ``seconds``, Resumed its step;
- the flow run's own times (FlowTimes, from Prefect): when it was due, when it started, when
  its closing task (the report) began, and the final evaluation's seconds.

The causes, in the flow run's order:
    queueing      due (expected start) -> started: waiting for a worker or a slot; and each
                  launch's wait for an accelerator slot (launch.concurrency_limit), recorded
                  as its slot_wait_seconds, just before it started
    startup       started -> the first step: the flow's tasks (config, data, resume point) and
                  the first launch's process start (imports, model build, checkpoint load)
    productive    the steps' own time (the intervals less evaluation, checkpoint, data wait)
    data_wait     the steps waiting for batches
    checkpoint    the training thread held by checkpoints (host copy; the last commit)
    evaluation    evaluations in the loop, the wait for the per-checkpoint ones, the final one
    restart       restart and lost work: a failed launch's steps past the checkpoint the next
                  one resumed from, its end, the time between launches, the next one's start
    shutdown      after the last step: the processes ending, the report
    unattributed  what no record accounts for (the gaps between records); tests bound it
The causes always sum to the wall-clock exactly (unattributed closes the sum).

Cost: seconds x accelerators (launch.world_size) x cost.per_accelerator_hour / 3600 per cause;
queueing is not priced (no accelerator is held while the flow run waits to start, nor while a
launch waits for its slot).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from typing import Iterable

from stoker.storage.layout import ATTEMPTS_FILE, CONFIG_FILE, METRICS_FILE, run_file_key
from stoker.storage.store import Store

LEDGER_FILE = "ledger.json"  # {run}/ledger.json: one entry per flow run, written by its report
CAUSES = (
    "productive",
    "data_wait",
    "checkpoint",
    "evaluation",
    "restart",
    "startup",
    "shutdown",
    "queueing",
    "unattributed",
)
LABELS = {
    "productive": "productive steps",
    "data_wait": "data wait",
    "checkpoint": "checkpoint stall",
    "evaluation": "evaluation",
    "restart": "restart and lost work",
    "startup": "start-up",
    "shutdown": "wind-down",
    "queueing": "queueing",
    "unattributed": "unattributed",
}
UNPRICED = frozenset({"queueing"})
_KINDS = frozenset({"train", "done", "eval", "resumed"})  # the metrics records the ledger reads


@dataclass(frozen=True)
class FlowTimes:
    """What the orchestrator knows of one flow run, in wall-clock seconds (None: unknown; the
    ledger then spans the launches only)."""

    expected_start: float | None = None  # when the flow run was due: queueing starts
    start: float | None = None  # when it started running
    closing_start: float | None = None  # when its closing task (the report) began
    end: float | None = None  # when the ledger was taken (default: the last launch's end)
    evaluation_seconds: float = 0.0  # the final evaluation's, between training and the report


@dataclass
class _Interval:
    since: float
    until: float
    since_step: int
    step: int
    eval_seconds: float
    checkpoint_seconds: float
    data_wait_share: float


class _Account:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CAUSES, 0.0)
        self.lost_seconds = 0.0
        self.lost_steps = 0.0

    def add(self, cause: str, seconds: float) -> None:
        self.seconds[cause] += max(0.0, seconds)


def parse_records(lines: Iterable[str | bytes]) -> list[dict]:
    """The metrics records the ledger reads (Train, Done, Eval, Resumed), in file order."""
    out = []
    for line in lines:
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by a crash
            continue
        if isinstance(record, dict) and record.get("event") in _KINDS and isinstance(record.get("time"), (int, float)):
            out.append(record)
    return out


def _intervals(records: list[dict]) -> list[_Interval]:
    out = []
    for r in records:
        if r["event"] in ("train", "done") and r.get("since") is not None:
            step = int(r["step"])
            out.append(
                _Interval(
                    since=float(r["since"]),
                    until=float(r["time"]),
                    since_step=int(r.get("since_step", step)),
                    step=step,
                    eval_seconds=float(r.get("eval_seconds") or 0.0),
                    checkpoint_seconds=float(r.get("checkpoint_seconds") or 0.0),
                    data_wait_share=float(r.get("data_wait_share") or 0.0),
                )
            )
    return sorted(out, key=lambda i: i.until)


class _Resumes:
    """Where later launches went on from: for any moment, the lowest step a resume after it
    started at (work past that step, done before it, was lost and done again)."""

    def __init__(self, points: list[tuple[float, int]]):
        points.sort()
        self.times = [t for t, _ in points]
        self.suffix_min = [math.inf] * (len(points) + 1)
        for i in range(len(points) - 1, -1, -1):
            self.suffix_min[i] = min(points[i][1], self.suffix_min[i + 1])

    def after(self, moment: float) -> float:
        return self.suffix_min[bisect.bisect_right(self.times, moment)]

    def within(self, lo: float, hi: float) -> bool:
        return bisect.bisect_right(self.times, hi) > bisect.bisect_right(self.times, lo)


class _Evals:
    """Evaluations outside the intervals (the step-0 one, one after an in-place restart)."""

    def __init__(self, records: list[dict]):
        evals = sorted(
            (float(r["time"]), float(r["seconds"])) for r in records if r["event"] == "eval" and r.get("seconds")
        )
        self.times = [t for t, _ in evals]
        self.cumulative = [0.0]
        for _, s in evals:
            self.cumulative.append(self.cumulative[-1] + s)

    def seconds_in(self, lo: float, hi: float) -> float:
        a, b = bisect.bisect_right(self.times, lo), bisect.bisect_right(self.times, hi)
        return self.cumulative[b] - self.cumulative[a]


def _gap(acc: _Account, lo: float, hi: float, cause: str, evals: _Evals) -> None:
    """Time between intervals: its evaluations count as such, the rest goes to `cause`."""
    if hi <= lo:
        return
    evaluation = min(hi - lo, evals.seconds_in(lo, hi))
    acc.add("evaluation", evaluation)
    acc.add(cause, hi - lo - evaluation)


def _interval(acc: _Account, iv: _Interval, lo: float, resumes: _Resumes) -> None:
    """One interval of steps (clipped to start at `lo`): evaluation, checkpoint, data wait and
    the steps' own time; the part past a later resume's step is lost work."""
    wall = iv.until - lo
    if wall <= 0:
        return
    scale = wall / max(iv.until - iv.since, 1e-12)  # < 1 only when clipped
    evaluation = min(iv.eval_seconds * scale, wall)
    checkpoint = min(iv.checkpoint_seconds * scale, wall - evaluation)
    data_wait = min(1.0, max(0.0, iv.data_wait_share)) * (wall - evaluation)
    data_wait = min(data_wait, wall - evaluation - checkpoint)
    productive = wall - evaluation - checkpoint - data_wait
    resumed_at = resumes.after(iv.until)
    num_steps = iv.step - iv.since_step
    if iv.since_step > resumed_at:  # all of it redone, its evaluation and checkpoint too
        lost_share, kept_overhead = 1.0, False
    elif num_steps > 0 and iv.step > resumed_at:  # the steps past resumed_at were redone
        lost_share, kept_overhead = (iv.step - max(resumed_at, iv.since_step)) / num_steps, True
    else:
        lost_share, kept_overhead = 0.0, True
    if kept_overhead:
        acc.add("evaluation", evaluation)
        acc.add("checkpoint", checkpoint)
        lost = lost_share * (productive + data_wait)
    else:
        lost = wall
    # after the last step (Done's interval: no step), what is left is the loop's own end
    acc.add("productive" if num_steps > 0 else "shutdown", (1 - lost_share) * productive)
    acc.add("data_wait", (1 - lost_share) * data_wait)
    acc.add("restart", lost)
    acc.lost_seconds += lost
    acc.lost_steps += lost_share * max(0, num_steps)


def _attempt(acc, a: dict, first: bool, intervals, evals: _Evals, resumes: _Resumes) -> None:
    """One launch's window: start-up (the flow run's first; else restart), its intervals, its
    end (completed: wind-down, then the wait for the evaluations submitted while training;
    failed: restart)."""
    lo, hi = float(a["started_at"]), float(a["ended_at"])
    completed = a.get("outcome") == "completed"
    mine = [iv for iv in intervals if lo < iv.until <= hi]
    cursor = lo
    for n, iv in enumerate(mine):
        since = min(max(iv.since, cursor), iv.until)
        if n == 0:
            cause = "startup" if first else "restart"
        else:  # an in-place restart (a resume in the gap); else records' own gaps
            cause = "restart" if resumes.within(cursor, since) else "unattributed"
        _gap(acc, cursor, since, cause, evals)
        _interval(acc, iv, since, resumes)
        cursor = iv.until
    if completed:
        gang_end = min(max(float(a.get("gang_ended_at") or hi), cursor), hi)
        _gap(acc, cursor, gang_end, "shutdown" if mine else "startup", evals)
        acc.add("evaluation", hi - gang_end)
    else:
        acc.add("restart", hi - cursor)


def _slot_wait(a: dict, room: float) -> float:
    """The launch's wait for its accelerator slot, within the `room` before it started."""
    return min(max(0.0, float(a.get("slot_wait_seconds") or 0.0)), max(0.0, room))


def compute_ledger(
    records: list[dict],
    attempts: list[dict],
    times: FlowTimes = FlowTimes(),
    *,
    accelerators: int = 1,
    price_per_accelerator_hour: float | None = None,
    flow_run_id: str | None = None,
    deployment: str | None = None,
) -> dict:
    """The ledger of one flow run: seconds, share and cost per cause, goodput (productive /
    wall). `records`: parse_records of metrics.jsonl (any span: only those inside the flow
    run's launches count); `attempts`: the flow run's launch records."""
    attempts = sorted(attempts, key=lambda a: a["started_at"])
    first = float(attempts[0]["started_at"]) if attempts else None
    last_end = float(attempts[-1]["ended_at"]) if attempts else None
    # without the flow run's own times, the ledger begins where the first launch began waiting
    # for its slot
    first_asked = first - _slot_wait(attempts[0], math.inf) if attempts else None
    start = next((t for t in (times.start, first_asked, times.closing_start, times.end) if t is not None), 0.0)
    queued = min(start, times.expected_start) if times.expected_start is not None else start
    end = next((t for t in (times.end, last_end, times.closing_start) if t is not None), start)
    closing = min(max(times.closing_start if times.closing_start is not None else end, start), end)
    acc = _Account()
    acc.add("queueing", start - queued)
    if attempts:
        window = [r for r in records if first <= r["time"] <= last_end]
        points = [(float(r["time"]), int(r["step"])) for r in window if r["event"] == "resumed"]
        points += [(float(a["started_at"]), int(a.get("resumed_from_step", 0))) for a in attempts]
        if attempts[-1].get("outcome") != "completed":  # the next launch goes on from its last commit
            points.append((last_end, int(attempts[-1].get("committed_step", 0))))
        resumes, evals, intervals = _Resumes(points), _Evals(window), _intervals(window)
        waited = _slot_wait(attempts[0], first - start)  # for an accelerator slot: queueing
        acc.add("queueing", waited)
        acc.add("startup", first - start - waited)
        for i, a in enumerate(attempts):
            _attempt(acc, a, i == 0, intervals, evals, resumes)
            if i + 1 < len(attempts):
                between = float(attempts[i + 1]["started_at"]) - float(a["ended_at"])
                waited = _slot_wait(attempts[i + 1], between)
                acc.add("queueing", waited)
                acc.add("restart", between - waited)
        after_training, before = "shutdown", max(last_end, start)
    else:
        after_training, before = "startup", start
    # between training and the closing task: the final evaluation; then the closing task
    gap = max(0.0, closing - before)
    evaluation = min(gap, max(0.0, times.evaluation_seconds))
    acc.add("evaluation", evaluation)
    acc.add(after_training, gap - evaluation)
    acc.add("shutdown", end - max(closing, before))
    wall = max(0.0, end - queued)
    acc.seconds["unattributed"] = wall - sum(s for c, s in acc.seconds.items() if c != "unattributed")
    return _finish(
        {
            "flow_run_id": flow_run_id,
            "deployment": deployment,
            "launches_only": times.start is None,  # the flow run's own times unknown (no report)
            "from": queued,
            "to": end,
            "wall_seconds": wall,
            "seconds": acc.seconds,
            "lost_seconds": acc.lost_seconds,
            "lost_steps": round(acc.lost_steps),
            "num_attempts": len(attempts),
            "accelerators": accelerators,
            "price_per_accelerator_hour": price_per_accelerator_hour or None,
            "cost": _priced_costs(acc.seconds, accelerators, price_per_accelerator_hour),
        }
    )


def _priced_costs(seconds: dict, accelerators: int, price: float | None) -> dict | None:
    rate = (price or 0.0) * accelerators / 3600.0
    return {c: (0.0 if c in UNPRICED else s * rate) for c, s in seconds.items()} if rate > 0 else None


def _finish(ledger: dict) -> dict:
    """Shares, goodput and the cost total from the seconds and costs; rounded for storage."""
    wall, seconds, cost = ledger["wall_seconds"], ledger["seconds"], ledger["cost"]
    ledger["share"] = {c: (round(s / wall, 6) if wall > 0 else 0.0) for c, s in seconds.items()}
    ledger["goodput"] = round(seconds["productive"] / wall, 6) if wall > 0 else None
    ledger["cost_total"] = round(sum(cost.values()), 9) if cost is not None else None
    ledger["cost"] = {c: round(v, 9) for c, v in cost.items()} if cost is not None else None
    ledger["seconds"] = {c: round(s, 4) for c, s in seconds.items()}
    ledger["wall_seconds"] = round(wall, 4)
    ledger["lost_seconds"] = round(ledger.get("lost_seconds", 0.0), 4)
    return ledger


def sum_ledgers(ledgers: list[dict]) -> dict:
    """Several flow runs' ledgers (of one run, or of one deployment's runs) as one: seconds and
    costs added, shares and goodput of the sum. Cost counts the priced flow runs only
    (`num_priced` of `num_flow_runs`)."""
    seconds = dict.fromkeys(CAUSES, 0.0)
    cost = dict.fromkeys(CAUSES, 0.0)
    priced = 0
    for one in ledgers:
        for c in CAUSES:
            seconds[c] += one["seconds"].get(c, 0.0)
        if one.get("cost") is not None:
            priced += 1
            for c in CAUSES:
                cost[c] += one["cost"].get(c, 0.0)
    total = {
        "num_flow_runs": len(ledgers),
        "num_priced": priced,
        "wall_seconds": sum(one["wall_seconds"] for one in ledgers),
        "seconds": seconds,
        "lost_seconds": sum(one.get("lost_seconds", 0.0) for one in ledgers),
        "lost_steps": sum(one.get("lost_steps", 0) for one in ledgers),
        "num_attempts": sum(one.get("num_attempts", 0) for one in ledgers),
        "cost": cost if priced else None,
    }
    return _finish(total)


def ledger_rows(ledger: dict) -> list[dict]:
    """The ledger as table rows (the UI's table artifact, `stoker runs --ledger`): one per
    cause with any time, then the total."""
    cost = ledger.get("cost")
    rows = [
        {
            "cause": LABELS[c],
            "seconds": round(ledger["seconds"][c], 2),
            "share": f"{100 * ledger['share'][c]:.1f}%",
            "cost": round(cost[c], 4) if cost is not None else None,
        }
        for c in CAUSES
        if abs(ledger["seconds"].get(c, 0.0)) >= 0.005
    ]
    rows.append(
        {
            "cause": "total (wall-clock)",
            "seconds": round(ledger["wall_seconds"], 2),
            "share": "100.0%",
            "cost": round(ledger["cost_total"], 4) if ledger.get("cost_total") is not None else None,
        }
    )
    return rows


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def ledger_line(ledger: dict) -> str:
    """'goodput 0.42 of 1m23s (productive steps), cost 1.23 (4 accelerators at 0.75/h)'."""
    goodput = "n/a" if ledger.get("goodput") is None else f"{ledger['goodput']:.2f}"
    line = f"goodput {goodput} of {duration(ledger['wall_seconds'])} wall-clock"
    if ledger.get("cost_total") is not None:
        line += f", cost {ledger['cost_total']:.2f}"
        if ledger.get("price_per_accelerator_hour"):
            line += f" ({ledger['accelerators']} accelerator(s) at {ledger['price_per_accelerator_hour']:g}/h)"
    return line


# ---- the records in a store ------------------------------------------------------------
def read_records(store: Store, run: str) -> list[dict]:
    key = run_file_key(run, METRICS_FILE)
    return parse_records(store.read_bytes(key).splitlines()) if store.exists(key) else []


def read_attempt_log(store: Store, run: str) -> list[dict]:
    """Every launch record of the run (all flow runs), oldest first."""
    key = run_file_key(run, ATTEMPTS_FILE)
    if not store.exists(key):
        return []
    rows = []
    for line in store.read_bytes(key).splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return sorted((r for r in rows if "started_at" in r and "ended_at" in r), key=lambda r: r["started_at"])


def read_ledgers(store: Store, run: str) -> list[dict]:
    """The stored ledgers of the run's flow runs (ledger.json), oldest first."""
    key = run_file_key(run, LEDGER_FILE)
    if not store.exists(key):
        return []
    try:
        return list(json.loads(store.read_bytes(key)).get("flow_runs", []))
    except (ValueError, AttributeError):  # a damaged file: the ledgers are recomputed from records
        return []


def store_ledger(store: Store, run: str, ledger: dict) -> None:
    """Add (or replace) this flow run's ledger in {run}/ledger.json. One writer per run (the
    run lease), so read, change, write."""
    kept = [one for one in read_ledgers(store, run) if one.get("flow_run_id") != ledger.get("flow_run_id")]
    flow_runs = sorted(kept + [ledger], key=lambda one: one.get("from") or 0.0)
    store.write_bytes(run_file_key(run, LEDGER_FILE), json.dumps({"flow_runs": flow_runs}, indent=1).encode())


def _priced(store: Store, run: str) -> tuple[int, float | None]:
    """(accelerators, price) from the run's config.json: for flow runs whose report never ran."""
    try:
        cfg = json.loads(store.read_bytes(run_file_key(run, CONFIG_FILE)))
        launch = cfg.get("launch", {})
        return int(launch.get("num_nodes", 1)) * int(launch.get("nproc_per_node", 1)), (cfg.get("cost") or {}).get(
            "per_accelerator_hour"
        )
    except Exception:  # no readable config: unpriced
        return 1, None


def run_ledgers(store: Store, run: str) -> list[dict]:
    """One ledger per flow run of the run: the stored ones (each written by its report, with
    the flow run's own times), and, computed from the records, those of flow runs whose report
    never ran (failed or stopped: their launches' windows only)."""
    stored = read_ledgers(store, run)
    known = {one.get("flow_run_id") for one in stored}
    by_flow_run: dict[str, list[dict]] = {}
    for a in read_attempt_log(store, run):
        if a.get("flow_run_id") not in known:
            by_flow_run.setdefault(a.get("flow_run_id"), []).append(a)
    if not by_flow_run:
        return stored
    records = read_records(store, run)
    accelerators, price = _priced(store, run)
    computed = [
        compute_ledger(
            records, rows, accelerators=accelerators, price_per_accelerator_hour=price, flow_run_id=flow_run_id
        )
        for flow_run_id, rows in by_flow_run.items()
    ]
    return sorted(stored + computed, key=lambda one: one.get("from") or 0.0)


def deployment_ledgers(store: Store) -> dict[str, dict]:
    """Per deployment, the sum of the stored ledgers of its flow runs over every run in the
    store (each with `runs`: the run names)."""
    by_deployment: dict[str, list[dict]] = {}
    runs: dict[str, set[str]] = {}
    for run in sorted(store.listdir("runs")) if store.exists("runs") else []:
        for one in read_ledgers(store, run):
            name = one.get("deployment")
            if name:
                by_deployment.setdefault(name, []).append(one)
                runs.setdefault(name, set()).add(run)
    return {name: {**sum_ledgers(found), "runs": sorted(runs[name])} for name, found in by_deployment.items()}
