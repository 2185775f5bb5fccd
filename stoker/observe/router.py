"""A mixture of experts' router, for people: the busiest and idlest expert's share of the
tokens per sparse layer over the run (from metrics.jsonl's train records, ``expert_load``),
as the report's plot and a few lines; and the load-balancing loss beside the language-model
loss. Plain code (no Prefect, no torch)."""

from __future__ import annotations

import base64
import json

from stoker.observe.report import _png
from stoker.storage.layout import METRICS_FILE, run_file_key
from stoker.storage.store import Store

ROUTER_PLOT_FILE = "router-load.png"


def router_history(store: Store, run: str) -> dict:
    """{"steps", "layers", "busiest": {layer: [share]}, "idlest": {...}, "aux_loss": [..],
    "lm_loss": [..]} over every attempt (a step logged twice keeps its last record); empty for a
    dense run."""
    key = run_file_key(run, METRICS_FILE)
    if not store.exists(key):
        return {}
    by_step: dict[int, dict] = {}
    for line in store.read_bytes(key).decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "train" and record.get("expert_load"):
            by_step[int(record["step"])] = record
    if not by_step:
        return {}
    steps = sorted(by_step)
    layers = by_step[steps[-1]]["expert_load"]["layers"]
    out = {"steps": steps, "layers": layers, "busiest": {}, "idlest": {}}
    for which in ("busiest", "idlest"):
        for i, layer in enumerate(layers):
            out[which][layer] = [by_step[s]["expert_load"][which][i] for s in steps]
    out["aux_loss"] = [by_step[s].get("aux_loss") for s in steps]
    out["lm_loss"] = [by_step[s].get("lm_loss") for s in steps]
    return out


def router_png(history: dict, experts: int, title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    load, aux = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    steps = history["steps"]
    for layer in history["layers"]:
        (line,) = load.plot(steps, history["busiest"][layer], "-", label=f"layer {layer} busiest")
        load.plot(steps, history["idlest"][layer], "--", color=line.get_color(), label=f"layer {layer} idlest")
    load.axhline(1 / experts, color="gray", lw=0.8, label="balanced (1/E)")
    load.set_xlabel("step")
    load.set_ylabel("expert's share of the interval's tokens")
    load.legend(fontsize=7, ncol=2)
    load.grid(alpha=0.3)
    aux.plot(steps, history["aux_loss"], "o-", label="load balancing (1 when balanced)")
    aux.set_xlabel("step")
    aux.set_ylabel("router's loss")
    aux.grid(alpha=0.3)
    aux.legend(fontsize=8)
    fig.suptitle(title)
    return _png(fig)


def router_markdown(store: Store, run: str, experts: int) -> str:
    """The report's section on the router (its plot kept in the run folder); '' for a dense run."""
    history = router_history(store, run)
    if not history:
        return ""
    png = router_png(history, experts, f"{run}: the router's load")
    store.write_bytes(run_file_key(run, ROUTER_PLOT_FILE), png)
    last = {layer: (history["busiest"][layer][-1], history["idlest"][layer][-1]) for layer in history["layers"]}
    lines = "\n".join(
        f"- layer {layer}: busiest expert {b:.1%}, idlest {i:.1%} of the last interval's tokens (balanced: {1 / experts:.1%})"
        for layer, (b, i) in last.items()
    )
    aux = history["aux_loss"][-1]
    return (
        "\n### The router\n\n"
        f"{lines}\n- load-balancing loss {aux:.4f} at step {history['steps'][-1]} (1 when balanced; in the training "
        "loss only, never in a validation loss or score)\n\n"
        f"![router load of {run}](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
        f"(also `{store.url(run_file_key(run, ROUTER_PLOT_FILE))}`)\n"
    )
