"""The learning rate over a run's steps (train.lr_schedule), torch-free: what the ranks' LambdaLR
multiplies train.lr by, what the plan and the report draw, and what decides whether a checkpoint
is a sound place for a run to go on from under another schedule.

A schedule's *stable part* is the steps whose learning rate does not depend on where the run
ends: the warm-up and the stable lr of 'wsd' (up to its decay), all of 'constant', only the
warm-up of 'cosine' and 'linear'. Two schedules of one run agree on every step before both their
stable parts end, when their *prefix* (the fields the stable part depends on) is the same: a
checkpoint taken there is a step both trajectories share, so a run trained longer ('wsd' given a
larger max_steps) goes on from its newest checkpoint before its decay and ends bitwise equal to a
run given the larger max_steps from the start.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

# the names of the train section's fields it reads are the configuration's (stoker.config.train)
from stoker.config.train import EXTENSIBLE, PREFIX_FIELDS, REWARM_FIELDS, SCHEDULE_FIELDS


def origin(train: Any) -> int:
    """The step a run's own schedule starts at: 0, or a re-warmed branch's branch point."""
    if getattr(train, "rewarm", False) and getattr(train, "branch_step", None):
        return int(train.branch_step)
    return 0


def lr_multiplier(step: int, train: Any) -> float:
    """train.lr times this is the learning rate of optimizer step `step` (0-based: the step
    that makes the run's step step + 1). Warm-up: from warmup_from toward 1 over warmup_steps
    ('cosine' with warmup_from 0 is the schedule stoker always had, bit for bit); then:
    cosine and linear to min_lr/lr at max_steps; wsd: 1 until the last decay_steps steps, then
    decay_shape down to min_lr/lr at the last step; constant: 1."""
    t = train
    at = origin(t)  # a re-warmed branch: its warm-up, and a cosine's decay, count from its branch point
    if step - at < t.warmup_steps:
        return t.warmup_from + (1.0 - t.warmup_from) * (max(0, step - at) + 1) / (t.warmup_steps + 1)
    floor = t.min_lr / t.lr
    kind = getattr(t, "lr_schedule", "cosine")
    if kind == "constant":
        return 1.0
    if kind == "wsd":
        start = t.max_steps - t.decay_steps
        if step < start:
            return 1.0
        progress = min(1.0, (step - start + 1) / t.decay_steps)  # the last step at min_lr
        if t.decay_shape == "sqrt":
            left = 1.0 - math.sqrt(progress)
        elif t.decay_shape == "cosine":
            left = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            left = 1.0 - progress
        return floor + (1.0 - floor) * left
    progress = min(1.0, (step - at - t.warmup_steps) / max(1, t.max_steps - at - t.warmup_steps))
    if kind == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def stable_until(train: Any) -> int:
    """The number of steps whose learning rate does not depend on the run's end (see above)."""
    kind = getattr(train, "lr_schedule", "cosine")
    if kind == "constant":
        return train.max_steps
    if kind == "wsd":
        return train.max_steps - train.decay_steps
    return origin(train) + train.warmup_steps


def decay_start(train: Any) -> int | None:
    """The step a 'wsd' run's decay begins after (its last stable step): a checkpoint is committed
    there, where a run trained longer goes on from without replaying steps; None for the others."""
    if getattr(train, "lr_schedule", "cosine") != "wsd":
        return None
    return stable_until(train)


def may_go_on_from(saved: dict | None, step: int, train: Any) -> bool:
    """Whether a checkpoint at `step`, trained under the schedule `saved` (its signature), lies in
    the stable part of `train`'s schedule and may be gone on from under it: the newest such one is
    where a 'wsd' or 'constant' run trained longer (or given another decay) goes on from, so
    retention keeps it."""
    return step <= stable_until(train) and not continuation_problem(saved, step, train)


def _hash(train: Any, fields: tuple[str, ...]) -> str:
    if origin(train):
        fields = fields + REWARM_FIELDS
    values = {f: getattr(train, f, None) for f in fields}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def signature(train: Any) -> dict:
    """What a checkpoint's manifest records of the schedule it was trained under."""
    return {
        "kind": getattr(train, "lr_schedule", "cosine"),
        "hash": _hash(train, SCHEDULE_FIELDS),
        "prefix": _hash(train, PREFIX_FIELDS),
        "stable_until": stable_until(train),
    }


def continuation_problem(saved: dict | None, step: int, train: Any) -> str:
    """'' when a checkpoint at `step` trained under the schedule `saved` (its signature) is a
    sound place to go on from under `train`'s: the same schedule, or a step inside both stable
    parts of the same prefix; else why not (a checkpoint taken inside a decay this schedule
    does not have). A manifest older than schedules (no signature) is not judged."""
    if not saved:
        return ""
    now = signature(train)
    if saved.get("hash") == now["hash"]:
        return ""
    shared = min(int(saved.get("stable_until", 0)), now["stable_until"])
    if saved.get("prefix") == now["prefix"] and step <= shared:
        return ""
    return (
        f"was trained under another learning-rate schedule past the steps it shares with this one (step {step}; "
        f"they agree up to step {shared if saved.get('prefix') == now['prefix'] else 0}): a checkpoint inside a decay "
        "is kept and evaluated, never gone on from"
    )


def curve(train: Any, points: int = 200) -> list[tuple[int, float]]:
    """(step, learning rate) over the run, at most `points` of them (the plan, the report)."""
    at = origin(train)  # a re-warmed branch: drawn from its branch point (the steps before are its parent's)
    every = max(1, (train.max_steps - at) // points)
    steps = sorted({*range(at, train.max_steps, every), train.max_steps - 1})
    return [(s + 1, train.lr * lr_multiplier(s, train)) for s in steps]


def describe(train: Any) -> str:
    """The schedule in a line (the plan)."""
    t = train
    warm = f"warm-up {t.warmup_steps} steps from {t.warmup_from * t.lr:.3g} to {t.lr:.3g}"
    if origin(t):
        warm = f"re-warmed at the branch point (step {origin(t)}): {warm}"
    kind = getattr(t, "lr_schedule", "cosine")
    if kind == "constant":
        return f"{warm}, then constant {t.lr:.3g} (trained longer as the same run)"
    if kind == "wsd":
        start = t.max_steps - t.decay_steps
        return (
            f"{warm}, stable {t.lr:.3g} to step {start}, then a {t.decay_shape} decay to {t.min_lr:.3g} at step "
            f"{t.max_steps} (trained longer as the same run, from a checkpoint before step {start})"
        )
    return f"{warm}, then {kind} to {t.min_lr:.3g} at step {t.max_steps}"


def change_problem(old: Any, new: Any, run: str) -> str:
    """'' when a run trained under `old` may go on under `new` (the same schedule, or a 'wsd' or
    'constant' one with the same stable part: trained longer, or with another decay); else the
    one line that refuses it, naming the field and the fixes."""
    if signature(old)["hash"] == signature(new)["hash"]:
        return ""
    both = old.lr_schedule in EXTENSIBLE and new.lr_schedule in EXTENSIBLE
    if both and signature(old)["prefix"] == signature(new)["prefix"]:
        return ""
    name = next(f for f in SCHEDULE_FIELDS if getattr(old, f, None) != getattr(new, f, None))
    why = (
        "its learning rate at every step after the warm-up depends on max_steps: stretched, it would jump"
        if old.lr_schedule not in EXTENSIBLE
        else "it would change steps the run has trained"
    )
    return (
        f"train.{name}: run {run!r} was trained under a {old.lr_schedule!r} schedule with {name}="
        f"{getattr(old, name, None)!r}, and this config has {getattr(new, name, None)!r}; {why}. To train longer, "
        "give a run train.lr_schedule 'wsd' (or 'constant') from its start; to change course, branch from one of "
        "its checkpoints (train.branch_from, or stoker run --branch-from URI) under a new run name"
    )
