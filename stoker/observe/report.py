"""Rendering of a run for people: the loss history and curve, the report's markdown, the
checkpoint table's rows, throughput medians. Plain code (no Prefect, no torch); the Prefect
task that publishes it is tasks/report.py."""

from __future__ import annotations

import io
import json
import statistics

from stoker.arithmetic.mixture import Mixture, windows_of
from stoker.contracts.results import EvalResult, TrainingResult
from stoker.observe.ledger import duration, ledger_line, ledger_rows
from stoker.storage.layout import METRICS_FILE, checkpoints_key, run_file_key
from stoker.storage.store import Store

LOSS_CURVE_FILE = "loss-curve.png"
MIX_PLOT_FILE = "data-mix.png"
GAINS_PLOT_FILE = "since-base.png"


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


def mix_history(store: Store, run: str) -> dict:
    """A mixture's history from metrics.jsonl over every attempt (a step logged twice keeps
    its last value): per source, [(step, tokens)], [(step, epochs)] and [(step, val loss)].
    Empty for a run of one source."""
    seen: dict[int, dict] = {}
    val: dict[int, dict] = {}
    key = run_file_key(run, METRICS_FILE)
    if not store.exists(key):
        return {}
    for line in store.read_bytes(key).decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("sources") and record.get("event") == "train":
            seen[int(record["step"])] = record["sources"]
        elif record.get("sources") and record.get("event") == "eval":
            val[int(record["step"])] = record["sources"]
    if not seen and not val:
        return {}
    names = sorted({n for s in [*seen.values(), *val.values()] for n in s})
    return {
        name: {
            "tokens": [(step, s[name]["tokens"]) for step, s in sorted(seen.items()) if name in s],
            "epochs": [(step, s[name]["epochs"]) for step, s in sorted(seen.items()) if name in s],
            "val_loss": [(step, s[name]) for step, s in sorted(val.items()) if name in s],
        }
        for name in names
    }


def train_windows(store: Store, shards, block_size: int) -> dict[str, int]:
    """Each source's training windows (arithmetic.mixture.windows_of), from its shard manifest."""
    out = {}
    for s in shards.sets:
        manifest = store.read_json(f"{s.key}/manifest.json")
        out[s.name] = windows_of([manifest["files"][n]["tokens"] for n in manifest["splits"]["train"]], block_size)
    return out


def mixture_plan(config, shards, store: Store) -> list[str]:
    """What the mixture will do, before any compute: each schedule segment's exact quotas and
    K (arithmetic.mixture), and per source the epochs it will have given by train.max_steps."""
    from stoker.storage.branches import mixture_history

    windows = train_windows(store, shards, config.model.block_size)
    history = mixture_history(store, config.resolved_run_name())
    mixture = Mixture.of_config(config.data, config.train.seed, config.train.global_batch_size, windows, history)
    lines = mixture.describe()
    epochs = mixture.epochs_after(config.train.max_steps)
    limits = {s.name: s for s in config.data.sources}
    for i, name in enumerate(mixture.names):
        line = f"{name}: {windows[name]:,} training windows; {epochs[i]:.3f} epochs by step {config.train.max_steps}"
        src = limits.get(name)
        if src is not None and src.max_epochs is not None and epochs[i] > src.max_epochs:
            last = mixture.last_step_within(i, src.max_epochs, config.train.max_steps)
            line += f", past its max_epochs={src.max_epochs:g} after step {last}" + (
                ": the run stops there" if src.at_max_epochs == "stop" else " (at_max_epochs: warn)"
            )
        lines.append(line)
    return lines


def mix_summary(history: dict) -> str:
    """One line of a mixture: per source its tokens and epochs so far and last validation loss."""
    parts = []
    for name, h in history.items():
        text = name
        if h["tokens"]:
            text += f" {h['tokens'][-1][1] / 1e6:.3g}M tok {h['epochs'][-1][1]:.3g} ep"
        if h["val_loss"]:
            text += f" val {h['val_loss'][-1][1]:.3f}"
        parts.append(text)
    return "; ".join(parts)


def mix_png(history: dict, title: str) -> bytes:
    """The mixture over steps: each source's share of the tokens of each log interval (the
    schedule's changes show as steps), and each source's validation loss (forgetting on the
    general data shows as its curve rising)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    share, losses = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    steps = sorted({step for h in history.values() for step, _ in h["tokens"]})
    if steps:
        per = {name: dict(h["tokens"]) for name, h in history.items()}
        rows = []
        for i, step in enumerate(steps):
            before = steps[i - 1] if i else None
            rows.append([per[n].get(step, 0) - (per[n].get(before, 0) if before is not None else 0) for n in per])
        totals = [max(1, sum(r)) for r in rows]
        shares = [[r[j] / t for r, t in zip(rows, totals)] for j in range(len(per))]
        share.stackplot(steps, shares, labels=list(per), step="post")
        share.set_ylim(0, 1)
        share.set_xlabel("step")
        share.set_ylabel("share of the interval's tokens")
        share.legend(fontsize=8, loc="upper left")
        share.grid(alpha=0.3)
    for name, h in history.items():
        if h["val_loss"]:
            losses.plot(*zip(*h["val_loss"]), "o-", label=name)
    losses.set_xlabel("step")
    losses.set_ylabel("validation loss per source")
    losses.grid(alpha=0.3)
    if any(h["val_loss"] for h in history.values()):
        losses.legend(fontsize=8)
    fig.suptitle(title)
    return _png(fig)


def source_rows(shards, history: dict, final: EvalResult | None) -> list[dict]:
    """Per source of a mixture: its shard set, its train tokens, what the run trained on of it
    (tokens, epochs), its last in-loop validation loss and its final evaluation."""
    rows = []
    for s in shards.sets:
        h = history.get(s.name, {})
        f = (final.sources or {}).get(s.name, {}) if final is not None else {}
        rows.append(
            {
                "source": s.name,
                "shards": s.url,
                "train_tokens": s.num_train_tokens,
                "tokens_trained": h["tokens"][-1][1] if h.get("tokens") else None,
                "epochs": h["epochs"][-1][1] if h.get("epochs") else None,
                "val_loss": h["val_loss"][-1][1] if h.get("val_loss") else None,
                "final_val_loss": f.get("val_loss"),
                "final_bits_per_byte": f.get("bits_per_byte"),
            }
        )
    return rows


def rounded_sources(rows: list[dict]) -> list[dict]:
    digits = {"epochs": 4, "val_loss": 4, "final_val_loss": 4, "final_bits_per_byte": 4}
    return [{k: _round(v, digits[k]) if k in digits else v for k, v in row.items()} for row in rows]


def _cell(v, fmt: str) -> str:
    """A table cell: '-' for a value not measured."""
    return "-" if v is None else format(v, fmt)


def _png(fig) -> bytes:
    """A matplotlib figure as PNG bytes, laid out."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def mix_markdown(rows: list[dict], plot: str, schedule: list[str]) -> str:
    """The report's section on a mixture."""
    if not rows:
        return ""

    table = "\n".join(
        f"| {r['source']} | {r['train_tokens']:,} | {_cell(r['tokens_trained'], ',')} | {_cell(r['epochs'], '.3f')} "
        f"| {_cell(r['val_loss'], '.4f')} | {_cell(r['final_val_loss'], '.4f')} | {_cell(r['final_bits_per_byte'], '.4f')} |"
        for r in rows
    )
    order = "\n".join(f"- {line}" for line in schedule)
    return f"""
## Data mixture
{order}

| source | train tokens in its shards | tokens trained on | epochs | validation loss (last, in training) | final evaluation loss | final bits per byte |
|---|---|---|---|---|---|---|
{table}

{plot}"""


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
    return _png(fig)


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
    mix: str = "",
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
{mix}{ledger_markdown(ledger, deployment_total)}"""


def run_plan(config, chosen_micro_batch: int | None = None):
    """The run's plan (arithmetic.plan) on its devices, at the micro-batch the ranks chose for
    'auto' when they said; None where no plan can be made (a device stoker does not know)."""
    from stoker.arithmetic import plan as plans

    if getattr(config.model, "init_from", None) and config.model.unresolved():
        return None  # the base's shape not read in here
    try:
        hardware = plans.hardware_of(config)
    except ValueError:
        return None
    micro = config.train.micro_batch_size
    if micro == "auto":
        micro = chosen_micro_batch or plans.auto_micro_batch(config, hardware)
    return plans.plan(config, hardware, micro_batch=micro)


def plan_markdown(plan) -> str:
    """The report's section with the run's plan: memory per device, time and cost."""
    if plan is None:
        return ""
    rows = "\n".join(f"| {what} | {value} |" for what, value in plan.rows())
    return f"""
## The plan
What this run was planned to need per device before it started (`stoker plan`; the memory is
an estimate, see docs/gpu-engine.md):

| | |
|---|---|
{rows}
"""


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
        if e.mc_accuracy_norm_clean is not None:
            line += (
                f"; on the {e.num_mc_items_clean} items not found in the training data "
                f"{100 * e.mc_accuracy_norm_clean:.1f}% (acc {100 * (e.mc_accuracy_clean or 0):.1f}%)"
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


# ---- gain and forgetting against the base ------------------------------------------------------
def since_base_rows(changes: dict) -> list[dict]:
    """Per source: its loss and bits per byte at the base (step 0) and at the last evaluation,
    and their change (arithmetic.gains.changes_since_base)."""
    rows = []
    for name, h in changes.items():
        step, d_loss = h["loss"][-1] if h["loss"] else (0, 0.0)
        d_bpb = h["bpb"][-1][1] if h["bpb"] and h["bpb"][-1][0] == step else None
        rows.append(
            {
                "source": name,
                "step": step,
                "base_loss": round(h["base_loss"], 4),
                "loss": round(h["base_loss"] + d_loss, 4),
                "loss_change": round(d_loss, 4),
                "base_bpb": _round(h["base_bpb"], 4),
                "bpb": None if d_bpb is None else round(h["base_bpb"] + d_bpb, 4),
                "bpb_change": _round(d_bpb, 4),
            }
        )
    return rows


def since_base_png(changes: dict, title: str) -> bytes:
    """Each source's change since the base over the run's steps: validation loss (nats) and,
    where measured, bits per byte; below zero is gain, above it forgetting."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    nats, bits = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for ax, what, label in (
        (nats, "loss", "validation loss - the base's (nats)"),
        (bits, "bpb", "bits per byte - the base's"),
    ):
        for name, h in changes.items():
            if h[what]:
                ax.plot(*zip(*h[what]), "o-", label=name)
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if any(h[what] for h in changes.values()):
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return _png(fig)


def since_base_markdown(rows: list[dict], plot: str, line: str) -> str:
    """The report's section on gain and forgetting against the base."""
    if not rows:
        return ""

    table = "\n".join(
        f"| {r['source']} | {r['base_loss']:.4f} | {r['loss']:.4f} | {r['loss_change']:+.4f} "
        f"| {_cell(r['base_bpb'], '.4f')} | {_cell(r['bpb'], '.4f')} | {_cell(r['bpb_change'], '+.4f')} |"
        for r in rows
    )
    return f"""
## Gain and forgetting since the base
{line or "no evaluation after step 0 yet"}. The base's values are the step-0 evaluation (its own weights, on
the same validation windows as every later evaluation); a change below zero is gain, above it forgetting.

| source | base loss | loss | change (nats) | base bits per byte | bits per byte | change |
|---|---|---|---|---|---|---|
{table}

{plot}"""


# ---- lineage and the schedule -------------------------------------------------------------------
SCHEDULE_PLOT_FILE = "schedule.png"


def lineage_markdown(chain: list[dict]) -> str:
    """The report's lines on a branch's ancestry (storage.branches.lineage_chain), nearest first."""
    if not chain:
        return ""
    lines = "\n".join(
        f"- `{link['run']}` is a soup of "
        + ", ".join(f"`{i['run']}` at step {i['step']} x{i['weight']:.4g}" for i in link["soup"]["inputs"])
        + f" (soup {link['soup']['id'][:16]}...)"
        if link.get("soup")
        else f"- `{link['run']}` branched from `{link['parent']}` at step {link['step']}: `{link['checkpoint']}` "
        f"(commit manifest sha256 {str(link.get('sha256'))[:16]}...)"
        for link in chain
    )
    return f"\n## Lineage\n{lines}\n"


def schedule_png(config, title: str, branch_step: int | None) -> bytes:
    """The learning rate over the run's steps and, for a mixture, each source's weight; a dashed
    line where a branch left its parent."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from stoker.arithmetic.schedule import curve

    sources = config.data.sources or []
    fig = Figure(figsize=(10 if sources else 6, 3.5), dpi=100)
    lr = fig.add_subplot(1, 2 if sources else 1, 1)
    lr.plot(*zip(*curve(config.train)), label=config.train.lr_schedule)
    lr.set_xlabel("step")
    lr.set_ylabel("learning rate")
    axes = [lr]
    if sources:
        mix = fig.add_subplot(1, 2, 2)
        changes = [(0, {s.name: s.weight for s in sources})] + [(c.at_step, c.weights) for c in config.data.schedule]
        for s in sources:
            steps, weights = [], []
            for i, (at, w) in enumerate(changes):
                end = changes[i + 1][0] if i + 1 < len(changes) else config.train.max_steps
                total = sum(w.values())
                steps += [at, end]
                weights += [w.get(s.name, 0.0) / total] * 2
            mix.plot(steps, weights, label=s.name)
        mix.set_xlabel("step")
        mix.set_ylabel("share of the batch")
        mix.set_ylim(0, 1)
        axes.append(mix)
    for ax in axes:
        if branch_step is not None:
            ax.axvline(branch_step, linestyle="--", color="gray", label=f"branch point (step {branch_step})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _png(fig)


def schedule_markdown(config, store: Store, run: str) -> str:
    """The report's section on the learning rate and the data mix over the run's steps (its
    plot kept in the run folder), with where a branch left its parent."""
    import base64

    from stoker.arithmetic.plan import mix_over_steps
    from stoker.arithmetic.schedule import describe

    chain_key = run_file_key(run, "lineage.json")
    branch_step = store.read_json(chain_key).get("step") if store.exists(chain_key) else None
    png = schedule_png(config, f"{run}: learning rate and data mix", branch_step)
    store.write_bytes(run_file_key(run, SCHEDULE_PLOT_FILE), png)
    mix = mix_over_steps(config)
    return (
        f"\n## Schedule\n- learning rate: {describe(config.train)}\n"
        + (f"- data mix: {mix}\n" if mix else "")
        + (f"- branched at step {branch_step}\n" if branch_step is not None else "")
        + f"\n![schedule of {run}](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
        f"(also `{store.url(run_file_key(run, SCHEDULE_PLOT_FILE))}`)\n"
    )


def records_with_the_base(store: Store, run: str) -> list[dict]:
    """A run's metrics.jsonl records, with the base's own step-0 evaluation of the run its
    lineage starts from when it has none of its own (a branch: its gain and forgetting are told
    against the same base as its parent's)."""
    from stoker.observe.ledger import read_records
    from stoker.storage.branches import lineage_chain

    records = read_records(store, run)
    if any(r.get("event") == "eval" and r.get("step") == 0 for r in records):
        return records
    chain = lineage_chain(store, run)
    if not chain:
        return records
    base = [r for r in read_records(store, chain[-1]["parent"]) if r.get("event") == "eval" and r.get("step") == 0]
    return base[-1:] + records


# ---- the data stage: what data.dedup and data.decontaminate removed -------------------------
DEDUP_SAMPLES_FILE = "dedup-removed.jsonl"
FILTER_SAMPLES_FILE = "filter-removed.jsonl"  # in the run folder: documents data.filters removed, with why  # in the run folder: removed documents beside what they matched


def dedup_rows(infos) -> list[dict]:
    """One row per source (stoker.contracts.results.DedupInfo): documents and bytes in, what was
    removed and why, what is left."""
    return [
        {
            "source": d.name,
            "dedup": d.dedup,
            "decontaminate": d.decontaminate,
            "docs_in": d.num_docs_in,
            "MB_in": round(d.num_bytes_in / 1e6, 3),
            "exact_dups": d.num_exact,
            "near_dups": d.num_near,
            "contaminated": d.num_contaminated,
            "cut": getattr(d, "num_cut", 0),
            "docs_out": d.num_docs_out,
            "MB_out": round(d.num_bytes_out / 1e6, 3),
            "items_matched": len(d.items),
            "cached": d.cache_hit,
        }
        for d in infos
    ]


def filter_line(f) -> str:
    """One log line of what data.filters removed from a source (contracts.results.FilterInfo)."""
    by = ", ".join(f"{name} {n}" for name, n in f.removed.items()) or "none"
    edited = f", {f.num_edited} edited (lines dropped)" if f.num_edited else ""
    return (
        f"source {f.name!r}: filters {', '.join(f.filters)}: {f.num_docs_in} documents "
        f"({f.num_bytes_in / 1e6:.2f} MB) in; removed {sum(f.removed.values())} ({by}){edited}; "
        f"{f.num_docs_out} documents ({f.num_bytes_out / 1e6:.2f} MB) kept{' (cached)' if f.cache_hit else ''}"
    )


def filters_markdown(infos, samples_url: str | None = None) -> str:
    """The report's section on what data.filters removed, per source and filter."""
    if not infos:
        return ""
    head = "| source | filters | docs in | removed | by filter | edited | docs out |\n|---|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {f.name} | {', '.join(f.filters)} | {f.num_docs_in} | {sum(f.removed.values())} | "
        f"{', '.join(f'{k} {v}' for k, v in f.removed.items()) or '-'} | {f.num_edited} | {f.num_docs_out} |\n"
        for f in infos
    )
    out = "\n## Data: quality filters\n\n" + head + body
    if samples_url:
        out += f"\nA sample of the removed documents, with why: `{samples_url}`\n"
    return out


def stages_markdown(rows: list[dict]) -> str:
    """The report's table of the data stage, per source and stage (DataShards.stage_rows)."""
    if not rows:
        return ""
    cols = ("source", "stage", "docs_in", "MB_in", "docs_out", "MB_out", "tokens_out", "parts", "cached")

    def cell(v) -> str:
        return "" if v is None else (f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))

    head = "| " + " | ".join(c.replace("_", " ") for c in cols) + " |\n|" + "---|" * len(cols) + "\n"
    body = "".join("| " + " | ".join(cell(r.get(c)) for c in cols) + " |\n" for r in rows)
    return "\n## Data: per source and stage, documents and bytes in and out\n\n" + head + body


def stages_summary(rows: list[dict]) -> str | None:
    """`stoker runs`' few words per source: 'main: 970 docs in 5 parts > 965 > 210,112 tokens'."""
    by_source: dict[str, list[dict]] = {}
    for r in rows or []:
        by_source.setdefault(r["source"], []).append(r)
    out = []
    for name, stages in by_source.items():
        words = []
        for r in stages:
            if r["stage"] == "download":
                words.append(f"{r['docs_out']:,} docs in {r['parts']} parts")
            elif r["stage"] == "tokenize":
                words.append(f"{r['tokens_out']:,} tokens")
            else:
                words.append(f"{r['docs_out']:,}")
        out.append(f"{name}: {' > '.join(words)}")
    return "; ".join(out) or None


def dedup_line(d) -> str:
    """One log line of a source's removals."""
    items = ", ".join(list(d.items)[:8]) + (f" and {len(d.items) - 8} more" if len(d.items) > 8 else "")
    return (
        f"source {d.name!r}: {d.num_docs_in} documents ({d.num_bytes_in / 1e6:.2f} MB) in; removed "
        f"{d.num_exact} exact and {d.num_near} near duplicates (data.dedup {d.dedup}); evaluation items "
        f"found in {d.num_contaminated + d.num_cut} ({d.num_contaminated} removed whole, {d.num_cut} cut in pieces)"
        f"{f' ({items})' if d.items else ''}; {d.num_docs_out} documents "
        f"({d.num_bytes_out / 1e6:.2f} MB) kept{' (cached)' if d.cache_hit else ''}"
    )


def items_by_set(infos) -> dict[str, tuple[list[str], int]]:
    """Per evaluation set, (the items found in the training data, the items checked), over
    every source (DedupInfo.items: 'set:number' -> documents)."""
    out: dict[str, tuple[list[str], int]] = {}
    totals: dict[str, int] = {}
    for d in infos:
        for name, n in (getattr(d, "items_checked", None) or {}).items():
            totals[name] = max(totals.get(name, 0), n)
    found: dict[str, set[str]] = {}
    for d in infos:
        for item in d.items:
            found.setdefault(item.split(":")[0], set()).add(item)
    for name in sorted(found):
        ids = sorted(found[name], key=lambda i: (len(i), i))
        out[name] = (ids, totals.get(name, 0))
    return out


def dedup_markdown(infos, samples_url: str | None = None) -> str:
    """The report's section on the data stage's removals (empty without dedup records)."""
    if not infos:
        return ""
    head = "| source | dedup | docs in | MB in | exact dups | near dups | contaminated | cut | items matched | docs out |\n"
    head += "|---|---|---|---|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {r['source']} | {r['dedup']} | {r['docs_in']} | {r['MB_in']} | {r['exact_dups']} | {r['near_dups']} | "
        f"{r['contaminated']} | {r['cut']} | {r['items_matched']} | {r['docs_out']} |\n"
        for r in dedup_rows(infos)
    )
    out = "\n## Data: duplicates and evaluation items removed\n\n" + head + body
    found = items_by_set(infos)
    if found:
        out += (
            "\nEvaluation items found in the training data (their n-grams cut out, or the document removed where "
            "cut into more than 10 pieces), per set: "
            + "; ".join(
                f"{name}: {len(ids)} of {total or '?'} ({', '.join(ids[:20])}{' ...' if len(ids) > 20 else ''})"
                for name, (ids, total) in found.items()
            )
            + "\n"
        )
    if samples_url:
        out += f"\nA sample of removed documents beside what they matched: `{samples_url}`\n"
    return out
