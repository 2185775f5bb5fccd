"""What is in a store, for `stoker runs`, `stoker checkpoints` and `stoker verify`: plain
functions (no flow run), reading manifests and listings; only verify reads every byte."""

from __future__ import annotations

import datetime
import json
import re

from stoker.arithmetic.gains import changes_since_base, since_base_text
from stoker.config import RunConfig
from stoker.failures import ConfigError
from stoker.observe.ledger import (
    deployment_ledgers,
    duration,
    ledger_line,
    ledger_rows,
    run_ledgers,
    sum_ledgers,
)
from stoker.observe.report import mix_history, mix_summary, records_with_the_base, stages_summary
from stoker.storage.bases import base_summary
from stoker.storage.branches import LINEAGE_FILE
from stoker.storage.checkpoints import first_nonfinite_step, list_checkpoints, numerics_problem, validate_checkpoint
from stoker.storage.layout import CONFIG_FILE, METRICS_FILE, SHARDS_FILE, parse_checkpoint_url, run_file_key
from stoker.storage.manifest import Verdict
from stoker.storage.shards import validate_shard_set
from stoker.storage.store import Store

_SHARD_URL = re.compile(r"^(?P<root>.+)/shards/(?P<key>[^/]+)/?$")


def _existing_store(root: str, options: dict | None = None) -> Store:
    store = Store(root, options or {})
    if not store.exists(""):
        raise ConfigError(
            [
                f"storage.root: {store.root} does not exist; give the root the runs "
                "were written to (--root or $STOKER_ROOT)"
            ]
        )
    return store


def _verdicts(store: Store, run: str) -> list[tuple]:
    """(ref, Verdict) of every checkpoint of a run, newest first; a committed one known to hold
    NaN/inf (storage.checkpoints.numerics_problem) counts as not valid, with that reason."""
    since = first_nonfinite_step(store, run)
    out = []
    for ref in list_checkpoints(store, run):
        verdict = validate_checkpoint(store, ref.key)
        problem = numerics_problem(verdict.manifest, ref.step, since) if verdict else ""
        out.append((ref, Verdict(False, problem, verdict.manifest) if problem else verdict))
    return out


def run_ending(store: Store, run: str) -> str | None:
    """How the run's last launch ended, from metrics.jsonl: done, stopped, or failed with
    non-finite numerics (the step named); None when the metrics say nothing of it."""
    try:
        lines = store.read_bytes(run_file_key(run, METRICS_FILE)).decode().splitlines()
    except Exception:  # no metrics yet
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        kind = record.get("event")
        if kind == "nonfinite" and record.get("action") == "failed":
            return f"failed: non-finite {record.get('what')} at step {record.get('first_step')}"
        if kind in ("done", "stopped"):
            return f"{kind} at step {record.get('step')}"
        if kind == "resumed":
            return None
    return None


def list_runs(root: str, options: dict | None = None) -> list[dict]:
    """One row per run folder: its newest valid checkpoint step, how many checkpoint folders
    it has, how its last launch ended (from metrics.jsonl), train.max_steps and the model's
    shape from its config.json, and its ledger over every flow run: goodput (productive step
    time / wall-clock) and cost (none without cost.per_accelerator_hour)."""
    store = _existing_store(root, options)
    rows = []
    names = store.listdir("runs") if store.exists("runs") else []
    for run in sorted(names):
        verdicts = _verdicts(store, run)
        newest = next((ref for ref, verdict in verdicts if verdict), None)
        row = {
            "run": run,
            "newest_valid_step": newest.step if newest else None,
            "checkpoints": len(verdicts),
            "max_steps": None,
            "model": None,
            "base": None,
            "metrics": store.exists(run_file_key(run, METRICS_FILE)),
            "ended": run_ending(store, run),
            **_ledger_columns(store, run),
            "data": mix_summary(mix_history(store, run)) or None,
            "removed": removed_summary(store, run),
            "stages": _stages(store, run),
            "filtered": _filtered(store, run),
        }
        try:
            cfg = RunConfig.model_validate_json(store.read_bytes(run_file_key(run, CONFIG_FILE)))
            row.update(max_steps=cfg.train.max_steps, model=cfg.model.describe(), base=base_summary(cfg) or None)
        except Exception:  # a run folder without a readable config is listed all the same
            cfg = None
        if cfg is not None and getattr(cfg.model, "init_from", None):  # gain and forgetting
            row["since_base"] = since_base_text(changes_since_base(records_with_the_base(store, run))) or None
        lineage_key = run_file_key(run, LINEAGE_FILE)
        if store.exists(lineage_key):
            was = store.read_json(lineage_key)
            row["branch_of"] = f"{was.get('parent')} at step {was.get('step')}"
            row["parent"] = was.get("parent")
            if was.get("soup"):  # drawn under its lead; every input and weight named
                from stoker.storage.soups import soup_of

                row["branch_of"], row["soup_of"] = None, soup_of(was)
        rows.append(row)
    return as_tree(rows)


def _filtered(store: Store, run: str) -> str | None:
    """What data.filters removed, per source and filter: 'web: gopher_quality 12, c4 3'."""
    try:
        infos = store.read_json(run_file_key(run, SHARDS_FILE)).get("filtered") or []
        words = [f"{f['name']}: " + (", ".join(f"{k} {v}" for k, v in f["removed"].items()) or "none") for f in infos]
    except (FileNotFoundError, ValueError, AttributeError, KeyError, TypeError):
        return None
    return "; ".join(words) or None


def _stages(store: Store, run: str) -> str | None:
    """The data stage per source, in a few words (shards.json's stage rows); None before any."""
    try:
        rows = store.read_json(run_file_key(run, SHARDS_FILE)).get("stages") or []
        return stages_summary(rows)
    except (FileNotFoundError, ValueError, AttributeError, KeyError, TypeError):
        return None


def removed_summary(store: Store, run: str) -> str | None:
    """What data.dedup and data.decontaminate removed from the run's data (shards.json), in a
    few words: 'exact 12, near 3, eval 2 (2 items)'; None before any record."""
    try:
        dedup = store.read_json(run_file_key(run, SHARDS_FILE)).get("dedup") or []
    except (FileNotFoundError, ValueError, AttributeError):
        return None
    if not dedup:
        return None
    exact, near, eval_docs, cut = (
        sum(d.get(k, 0) for d in dedup) for k in ("num_exact", "num_near", "num_contaminated", "num_cut")
    )
    found: dict[str, set] = {}
    for d in dedup:
        for item in d.get("items", {}):
            found.setdefault(item.split(":")[0], set()).add(item)
    sets = ", ".join(f"{name} {len(ids)}" for name, ids in sorted(found.items()))
    return f"exact {exact}, near {near}, eval {eval_docs} removed {cut} cut (items found: {sets or 'none'})"


def as_tree(rows: list[dict]) -> list[dict]:
    """The runs in a tree: each branch under its parent (its `tree` column indented), in name order."""
    names = {r["run"] for r in rows}
    children: dict[str | None, list[dict]] = {}
    for r in rows:
        children.setdefault(r.get("parent") if r.get("parent") in names else None, []).append(r)
    out: list[dict] = []

    def walk(parent: str | None, depth: int) -> None:
        for r in sorted(children.get(parent, []), key=lambda x: x["run"]):
            r["tree"] = ("   " * (depth - 1) + "└─ " if depth else "") + r["run"]
            out.append(r)
            walk(r["run"], depth + 1)

    walk(None, 0)
    return out


def _ledger_columns(store: Store, run: str) -> dict:
    ledgers = run_ledgers(store, run)
    if not ledgers:
        return {"goodput": None, "cost": None}
    total = sum_ledgers(ledgers)
    return {
        "goodput": None if total["goodput"] is None else round(total["goodput"], 3),
        "cost": None if total["cost_total"] is None else round(total["cost_total"], 2),
    }


def run_ledger(root: str, run: str, options: dict | None = None) -> tuple[list[str], list[dict]]:
    """`stoker runs --ledger RUN`: one line per flow run (its ledger stored by its report, or
    computed from the records for one whose report never ran), a line for the run, and the
    rows of the causes over all of them (no lines: no launch recorded)."""
    ledgers = run_ledgers(_existing_store(root, options), run)
    if not ledgers:
        return [], []
    lines = []
    for one in ledgers:
        began = datetime.datetime.fromtimestamp(one["from"]).strftime("%Y-%m-%d %H:%M:%S")
        where = f" (deployment {one['deployment']})" if one.get("deployment") else ""
        told = " (its launches only: it never reported, it failed or was stopped)" if one.get("launches_only") else ""
        lines.append(f"flow run {one.get('flow_run_id')}{where}, {began}: {ledger_line(one)}{told}")
    total = sum_ledgers(ledgers)
    lines.append(
        f"run {run}: {ledger_line(total)}, {total['num_attempts']} launch(es), {total['lost_steps']} step(s) lost"
    )
    return lines, ledger_rows(total)


def deployment_rows(root: str, options: dict | None = None) -> list[dict]:
    """Per deployment, the sum of the ledgers of its flow runs over the runs in the store."""
    return [
        {
            "deployment": name,
            "runs": len(total["runs"]),
            "flow_runs": total["num_flow_runs"],
            "wall": duration(total["wall_seconds"]),
            "goodput": None if total["goodput"] is None else round(total["goodput"], 3),
            "cost": None if total["cost_total"] is None else round(total["cost_total"], 2),
        }
        for name, total in sorted(deployment_ledgers(_existing_store(root, options)).items())
    ]


def list_checkpoint_folders(root: str, run: str, options: dict | None = None) -> list[dict]:
    """Every checkpoint folder of a run, newest first, with whether it is committed (manifest
    present, every listed file at its size, not marked invalid: no byte read, so a flipped byte
    is not seen; `verify` reads them) and the reason when it is not."""
    store = _existing_store(root, options)
    rows = []
    for ref, verdict in _verdicts(store, run):
        files = verdict.manifest.get("files", {}) if verdict.manifest else {}
        rows.append(
            {
                "step": ref.step,
                "name": ref.name,
                "uri": store.url(ref.key),
                "valid": bool(verdict),
                "reason": verdict.reason,
                "size_mb": round(sum(e.get("size", 0) for e in files.values()) / 1e6, 1),
            }
        )
    return rows


def verify(uri: str, options: dict | None = None) -> tuple[str, Verdict]:
    """The full check of a checkpoint or shard-set URL: every listed file's sha256. Returns
    what was checked and the verdict; ConfigError for a URL of neither form."""
    shard = _SHARD_URL.match(uri.strip())
    if shard:
        store = Store(shard.group("root"), options or {})
        return "shard set", validate_shard_set(store, shard.group("key"), deep=True)
    try:
        where = parse_checkpoint_url(uri)
    except ConfigError:
        raise ConfigError(
            [
                f"uri: {uri!r} is neither a checkpoint ({{root}}/runs/{{run}}/checkpoints/"
                "step-NNNNNNNN) nor a shard set ({root}/shards/{key}); copy one from "
                "`stoker checkpoints RUN` or the run report"
            ]
        ) from None
    store = Store(where.root, options or {})
    return "checkpoint", validate_checkpoint(store, where.key, deep=True)
