"""How a soup reads: per source, the soup's validation loss and bits per byte beside each
input's and the base's, so a person sees at once whether it beats its ingredients."""

from __future__ import annotations

from stoker.arithmetic.gains import eval_values
from stoker.contracts.results import EvalResult
from stoker.storage.store import Store


def _per_source(e: EvalResult) -> tuple[dict[str, float], dict[str, float]]:
    if e.sources:
        losses = {n: float(s["val_loss"]) for n, s in e.sources.items()}
        bpbs = {n: float(s["bits_per_byte"]) for n, s in e.sources.items() if s.get("bits_per_byte") is not None}
        return losses, bpbs
    return eval_values({"val_loss": e.val_loss, "bits_per_byte": e.bits_per_byte})


def base_record(store: Store, run: str) -> dict | None:
    """The step-0 (base) evaluation the soup's lineage starts from, or None (random weights)."""
    from stoker.observe.report import records_with_the_base

    base = [r for r in records_with_the_base(store, run) if r.get("event") == "eval" and r.get("step") == 0]
    return base[-1] if base else None


def soup_rows(labels: list[str], inputs: list[EvalResult], soup: EvalResult, base: dict | None) -> list[dict]:
    """One row per source: base, each input (`labels`: 'run@step') and the soup, loss and bits
    per byte; `vs_best_input`: the soup's loss minus its best input's (negative: it beats them);
    `beats_each`: whether its loss is below every input's."""
    soup_loss, soup_bpb = _per_source(soup)
    base_loss, base_bpb = eval_values(base) if base else ({}, {})
    per_input = [_per_source(e) for e in inputs]
    rows = []
    for source in soup_loss:
        row: dict = {"source": source}
        if base:
            row.update(base_loss=base_loss.get(source), base_bpb=base_bpb.get(source))
        for label, (losses, bpbs) in zip(labels, per_input):
            row[f"{label} loss"] = losses.get(source)
            row[f"{label} bpb"] = bpbs.get(source)
        row.update(soup_loss=soup_loss[source], soup_bpb=soup_bpb.get(source))
        theirs = [losses[source] for losses, _ in per_input if source in losses]
        row["vs_best_input"] = soup_loss[source] - min(theirs) if theirs else None
        row["beats_each"] = "yes" if theirs and soup_loss[source] < min(theirs) else "no"
        rows.append(row)
    return rows


def soup_markdown(run: str, lineage: dict, rows: list[dict], computed: bool, checkpoint: str) -> str:
    """The soup's report: its inputs and weights, the per-source table, where it is."""
    inputs = (lineage.get("soup") or {}).get("inputs", [])
    lines = [f"# Soup `{run}`", ""]
    lines.append(
        f"The weighted average of {len(inputs)} committed checkpoints ({'computed now' if computed else 'made before: nothing recomputed'}): `{checkpoint}`."
    )
    lines += ["", "## Inputs", ""]
    lines += [
        f"- `{i['run']}` at step {i['step']}, weight {i['weight']:.4g}: `{i['checkpoint']}` (sha256 {i['sha256'][:16]}...)"
        for i in inputs
    ]
    if rows:
        columns = list(rows[0])
        lines += ["", "## Per source: the soup beside its inputs and the base", ""]
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for r in rows:
            lines.append("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "" if value is None else str(value)


def rounded_rows(rows: list[dict]) -> list[dict]:
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
