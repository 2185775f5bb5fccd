"""Gain and forgetting against the base: how each source's validation loss and bits per byte
changed since the run's step-0 evaluation, which for a run from a base (model.init_from) is the
base's own. Plain functions of the in-loop evaluation records (events.Eval, or their JSON in
metrics.jsonl), shared by the flow's log, the report and `stoker runs`.

A run of one source names it as data.source does ('main'); a mixture, each source by its name."""

from __future__ import annotations

from typing import Any

from stoker.config.data import DEFAULT_SOURCE_NAME


def eval_values(record: Any) -> tuple[dict[str, float], dict[str, float]]:
    """({source: validation loss}, {source: bits per byte}) of one in-loop evaluation (an
    events.Eval or its dict); bits per byte is empty where it was not measured."""
    get = record.get if isinstance(record, dict) else (lambda k, d=None: getattr(record, k, d))
    losses = dict(get("sources") or {}) or {DEFAULT_SOURCE_NAME: float(get("val_loss"))}
    bpbs = dict(get("sources_bpb") or {})
    if not bpbs and get("bits_per_byte") is not None and not get("sources"):
        bpbs = {DEFAULT_SOURCE_NAME: float(get("bits_per_byte"))}
    return losses, bpbs


def changes_since_base(records: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Per source, {"loss": [(step, change)], "bpb": [(step, change)], "base_loss", "base_bpb"}
    since the step-0 evaluation, over the in-loop evaluation records of metrics.jsonl (a step
    evaluated twice, before and after a resume, keeps its last); {} without a step-0 record."""
    by_step: dict[int, dict] = {}
    for record in records:
        if record.get("event") == "eval" and record.get("val_loss") is not None:
            by_step[int(record["step"])] = record
    if 0 not in by_step:
        return {}
    base_loss, base_bpb = eval_values(by_step[0])
    out: dict[str, dict] = {
        name: {"loss": [], "bpb": [], "base_loss": loss, "base_bpb": base_bpb.get(name)}
        for name, loss in base_loss.items()
    }
    for step in sorted(by_step):
        losses, bpbs = eval_values(by_step[step])
        for name, h in out.items():
            if name in losses:
                h["loss"].append((step, losses[name] - h["base_loss"]))
            if name in bpbs and h["base_bpb"] is not None:
                h["bpb"].append((step, bpbs[name] - h["base_bpb"]))
    return out


def since_base_text(changes: dict) -> str:
    """'domain -0.41 nats (-0.052 bpb), general +0.03 nats (+0.004 bpb) since the base' at the
    last evaluation; '' before any evaluation after step 0."""
    parts = []
    for name, h in changes.items():
        if not h["loss"] or h["loss"][-1][0] == 0:
            continue
        text = f"{name} {h['loss'][-1][1]:+.2f} nats"
        if h["bpb"] and h["bpb"][-1][0] == h["loss"][-1][0]:
            text += f" ({h['bpb'][-1][1]:+.3f} bpb)"
        parts.append(text)
    if not parts:
        return ""
    step = max(h["loss"][-1][0] for h in changes.values() if h["loss"])
    return f"{', '.join(parts)} since the base (step {step})"
