"""Rendering of a run for people: the loss history and curve, the report's markdown, the
checkpoint table's rows, throughput medians. Plain code (no Prefect, no torch); the Prefect
task that publishes it is tasks/report.py."""

from __future__ import annotations

import io
import json
import statistics

from stoker.core.results import EvalResult, TrainingResult
from stoker.observe.ledger import duration, ledger_line, ledger_rows
from stoker.storage.layout import METRICS_FILE, checkpoints_key, run_file_key
from stoker.storage.store import Store

LOSS_CURVE_FILE = "loss-curve.png"


def vocabulary_note(got: int, asked: int) -> str:
    """Said when the tokenizer has fewer ids than tokenizer.vocab_size (the run report too)."""
    return (
        f"the tokenizer has {got} ids, fewer than tokenizer.vocab_size={asked}: the corpus "
        f"gave BPE no more merges (or the given tokenizer is smaller); the model's embedding "
        f"keeps {asked} rows, {asked - got} of them never used. Use more data or set "
        f"tokenizer.vocab_size={got}."
    )


def vocabulary_line(got: int, asked: int) -> str:
    return f"{got} ids" if got >= asked else vocabulary_note(got, asked)


def run_history(store: Store, run: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train, validation) losses by step over every attempt of the run, from metrics.jsonl
    (a step logged twice, before and after a resume, keeps its last value)."""
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    key = run_file_key(run, METRICS_FILE)
    if not store.exists(key):
        return [], []
    for line in store.read_bytes(key).decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "train":
            train[int(record["step"])] = float(record["loss"])
        elif record.get("event") == "eval":
            val[int(record["step"])] = float(record["val_loss"])
    return sorted(train.items()), sorted(val.items())


def loss_curve_png(
    train: list[tuple[int, float]], val: list[tuple[int, float]], final: EvalResult | None, title: str
) -> bytes:
    """The loss curve (train, validation during training, the final checkpoint's evaluation)
    as a PNG, drawn with matplotlib's Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss (ranks' average at each log step)", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss during training (eval.num_batches batches)")
    if final is not None:
        ax.plot(
            [final.step],
            [final.val_loss],
            "*",
            markersize=14,
            label=f"final checkpoint, whole validation split ({final.windows} windows)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def report_markdown(
    run,
    store,
    shards,
    resume,
    training,
    evaluation,
    result,
    curve,
    val_curve,
    nothing_trained,
    config_vocab,
    ledger: dict | None = None,
    deployment_total: dict | None = None,
) -> str:
    final = (
        f"**{evaluation.val_loss:.4f}** (perplexity {evaluation.val_ppl:.1f}) at step "
        f"{evaluation.step}, over the whole validation split ({evaluation.windows} windows)"
        if evaluation
        else "n/a"
    )
    if evaluation is not None and (evaluation.bits_per_byte is not None or evaluation.mc_accuracy_norm is not None):
        final += f"; in all, {evaluation_line(evaluation)}"
    evals = "\n".join(f"| {s} | {v:.4f} |" for s, v in val_curve) or "| - | - |"
    what = (
        "nothing to train: the run had already reached train.max_steps"
        if nothing_trained
        else f"steps {resume.step} -> {training.final_step}"
    )
    return f"""# {run}
- {what}
- throughput: {throughput_line(result)}
- checkpoints given up or dropped (never committed): {training.failed_checkpoints or "none"}; in-place restarts: {training.restarts}
- steps skipped for a NaN/inf loss or gradient norm (train.nonfinite=skip): {training.skipped_steps or "none"}
- attempts: {result.num_attempts}, steps lost to failures: {result.steps_lost}, goodput of the launches: {_round(result.goodput, 2)}
{attempt_lines(training.attempt_log)}
- final checkpoint: `{training.final_checkpoint_uri}`
- shards: `{shards.url}` ({"cache hit" if shards.cache_hit else "tokenized"}; {shards.num_train_tokens:,} train tokens)
- tokenizer: {vocabulary_line(shards.vocab_size, config_vocab)}
- checkpoints: `{store.url(checkpoints_key(run))}`
- metrics: `{result.metrics_uri}`

## Loss
{curve}
Two validation losses, measured differently:
- **during training**, every eval.interval_steps, the ranks average the loss over
  eval.num_batches batches of the validation split (quick, a sample);
- **the final checkpoint's evaluation**, in a process of its own after training, reads the
  whole validation split: {final}.

| step | validation loss during training |
|---|---|
{evals}
{ledger_markdown(ledger, deployment_total)}"""


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def ledger_markdown(ledger: dict | None, deployment_total: dict | None = None) -> str:
    """The report's section on where this flow run's wall-clock (and money) went."""
    if ledger is None:
        return ""
    rows = "\n".join(
        f"| {r['cause']} | {r['seconds']:.1f} | {r['share']} | {_money(r['cost'])} |" for r in ledger_rows(ledger)
    )
    price = (
        f"priced at cost.per_accelerator_hour={ledger['price_per_accelerator_hour']:g} x "
        f"{ledger['accelerators']} accelerator(s) (launch.world_size); queueing is not priced"
        if ledger.get("cost_total") is not None
        else "no price: set cost.per_accelerator_hour to see the cost of each cause"
    )
    text = f"""
## Where the time went
{ledger_line(ledger)}; {ledger["lost_steps"]} step(s) done again after a restart. Every second of this
flow run, from when it was due to this report, is attributed to one cause ({price}):

| cause | seconds | share | cost |
|---|---|---|---|
{rows}
"""
    if deployment_total is not None:
        text += (
            f"\nDeployment total ({deployment_total['num_flow_runs']} flow run(s) of "
            f"{len(deployment_total['runs'])} run(s)): {ledger_line(deployment_total)}; "
            f"{duration(deployment_total['seconds']['productive'])} productive.\n"
        )
    return text


def _round(value, digits: int):
    return None if value is None else round(value, digits)


def throughput_summary(rows: list[dict]) -> dict:
    """Medians over the log steps after the first (which holds start-up and compilation)."""
    steady = rows[1:] or rows

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    peaks = [r["peak_memory_gb"] for r in rows if r.get("peak_memory_gb") is not None]
    return {
        "tokens_per_second": median("tokens_per_second"),
        "mfu": median("mfu"),
        "peak_memory_gb": max(peaks) if peaks else None,
    }


def throughput_line(result) -> str:
    if result.tokens_per_second is None:
        return "n/a"
    line = f"{result.tokens_per_second:,.0f} tokens/s (median)"
    if result.mfu is not None:
        line += f", MFU {100 * result.mfu:.1f}%"
    if result.peak_memory_gb is not None:
        line += f", peak GPU memory {result.peak_memory_gb:.1f} GB"
    return line


def checkpoint_rows(training: TrainingResult, final: EvalResult | None, retained: set[str] | None = None) -> list[dict]:
    """One row per committed checkpoint: step, URI, whether retention kept it, size, upload
    seconds, and its evaluation's validation loss, bits per byte and multiple-choice accuracy
    (acc_norm) where measured (eval.sets)."""
    evaluated = {e.checkpoint_uri: e for e in training.evaluations}
    if final is not None:
        evaluated[final.checkpoint_uri] = final
    rows = []
    for c in training.checkpoints:
        e = evaluated.get(c["uri"])
        rows.append(
            {
                "step": c["step"],
                "uri": c["uri"],
                "retained": "yes" if retained is None or c["uri"] in retained else "no (deleted by retention)",
                "size_mb": (c.get("bytes") or 0) / 1e6,
                "upload_seconds": c.get("upload_seconds"),
                "val_loss": e.val_loss if e else None,
                "bits_per_byte": e.bits_per_byte if e else None,
                "mc_acc_norm": e.mc_accuracy_norm if e else None,
            }
        )
    return rows


def evaluation_line(e: EvalResult) -> str:
    """An evaluation's numbers in one line (the sets it measured)."""
    line = f"validation loss {e.val_loss:.4f}, perplexity {e.val_ppl:.1f}"
    if e.bits_per_byte is not None:
        line += f", {e.bits_per_byte:.4f} bits per byte"
    if e.mc_accuracy_norm is not None:
        line += (
            f", multiple choice {100 * e.mc_accuracy_norm:.1f}% (acc_norm; acc {100 * (e.mc_accuracy or 0):.1f}%, "
            f"{e.num_mc_items} items, chance 25%)"
        )
    return line


def rounded(rows: list[dict]) -> list[dict]:
    """The rows as the UI's table shows them: numbers rounded for reading (the result keeps
    them whole)."""
    digits = {"size_mb": 1, "upload_seconds": 2, "val_loss": 4, "bits_per_byte": 4, "mc_acc_norm": 3}
    return [{k: _round(v, digits[k]) if k in digits else v for k, v in row.items()} for row in rows]


def attempt_lines(attempts: list[dict]) -> str:
    return "\n".join(
        f"  - attempt {a['attempt']}: steps {a['resumed_from_step']} -> {a['reached_step']}, "
        f"{a['outcome']}, {a.get('steps_lost', 0)} step(s) lost"
        for a in attempts
    )


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())
