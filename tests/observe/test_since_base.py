"""The report's gain and forgetting since the base (observe.report since_base_*, the report
task's section) and which evaluation is the base of a branch (observe.report
records_with_the_base): hand-made metrics.jsonl records of two sources in a store folder, no
training. Values are binary fractions, so the expected changes are exact literals; each test
carries a control that a wrong base or swapped sources does not pass."""

from __future__ import annotations

import base64
import io
import json

import pytest

from stoker.arithmetic.gains import changes_since_base
from stoker.contracts.events import Eval
from stoker.contracts.results import PipelineResult
from stoker.observe.report import (
    GAINS_PLOT_FILE,
    records_with_the_base,
    since_base_markdown,
    since_base_png,
    since_base_rows,
)
from stoker.storage.branches import LINEAGE_FILE
from stoker.storage.layout import METRICS_FILE, run_file_key
from stoker.storage.store import Store


def _eval(step: int, losses: dict, bpbs: dict) -> dict:
    return Eval(
        step=step,
        val_loss=sum(losses.values()) / len(losses),
        val_ppl=1.0,
        sources=losses,
        sources_bpb=bpbs,
        time=1000.0 + step,
    ).to_dict()


# the run from the base: step 0 is the base's own evaluation
ROOT = [
    _eval(0, {"domain": 3.5, "general": 2.25}, {"domain": 1.5, "general": 1.0}),
    _eval(4, {"domain": 3.0, "general": 2.375}, {"domain": 1.25, "general": 1.0625}),
    _eval(8, {"domain": 2.75, "general": 2.5}, {"domain": 1.125}),  # general's bpb not measured
]
ROWS = [
    {
        "source": "domain",
        "step": 8,
        "base_loss": 3.5,
        "loss": 2.75,
        "loss_change": -0.75,
        "base_bpb": 1.5,
        "bpb": 1.125,
        "bpb_change": -0.375,
    },
    {
        "source": "general",
        "step": 8,
        "base_loss": 2.25,
        "loss": 2.5,
        "loss_change": 0.25,
        "base_bpb": 1.0,
        "bpb": None,
        "bpb_change": None,
    },
]


def _write_run(store: Store, run: str, records: list[dict], lineage: dict | None = None) -> None:
    store.write_bytes(run_file_key(run, METRICS_FILE), "".join(json.dumps(r) + "\n" for r in records).encode())
    if lineage is not None:
        store.write_json(run_file_key(run, LINEAGE_FILE), lineage)


def _branch(parent: str, step: int) -> dict:
    return {"parent": parent, "step": step, "checkpoint": f"runs/{parent}/step-{step:08d}", "sha256": "ab" * 32}


def _line_colours(png: bytes) -> set[tuple[int, int, int]]:
    """The line colours of matplotlib's default cycle (C0 blue, C1 orange) found in the image."""
    from PIL import Image

    colours = Image.open(io.BytesIO(png)).convert("RGB").getcolors(maxcolors=1 << 24)
    return {c for _, c in colours} & {(31, 119, 180), (255, 127, 14)}


def test_the_since_base_table_has_each_sources_values_at_the_base_and_now():
    rows = since_base_rows(changes_since_base(ROOT))
    assert rows == ROWS
    markdown = since_base_markdown(rows, "PLOT", "LINE")
    assert "\n| domain | 3.5000 | 2.7500 | -0.7500 | 1.5000 | 1.1250 | -0.3750 |\n" in markdown
    assert "\n| general | 2.2500 | 2.5000 | +0.2500 | 1.0000 | - | - |\n" in markdown  # '-': not measured
    assert "## Gain and forgetting since the base\nLINE." in markdown and markdown.rstrip().endswith("PLOT")
    # controls: the sources' values swapped, or the step-4 evaluation taken as the base, are other rows
    swapped = [{**r, "sources": {"domain": r["sources"]["general"], "general": r["sources"]["domain"]}} for r in ROOT]
    assert since_base_rows(changes_since_base(swapped)) != ROWS
    from_step_4 = [{**ROOT[1], "step": 0}, ROOT[2]]
    assert since_base_rows(changes_since_base(from_step_4)) != ROWS
    assert since_base_markdown([], "PLOT", "LINE") == ""


def test_the_since_base_plot_draws_a_line_per_source():
    png = since_base_png(changes_since_base(ROOT), "cpt: change since the base")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert len(_line_colours(png)) == 2
    # control: with one source's changes only, one line colour is drawn
    assert (
        len(
            _line_colours(
                since_base_png(
                    changes_since_base([{**r, "sources": {"domain": r["sources"]["domain"]}} for r in ROOT]), "x"
                )
            )
        )
        == 1
    )


def test_the_report_section_writes_the_plot_to_the_run_folder_and_the_table_artifact(tmp_path, monkeypatch):
    import stoker.tasks.report as report_task

    tables = []
    monkeypatch.setattr(report_task, "create_table_artifact", lambda rows, **kw: tables.append((rows, kw)))
    store = Store(f"file://{tmp_path}/store")
    _write_run(store, "cpt", ROOT)
    result = PipelineResult(
        run_name="cpt",
        run_uri="u",
        final_step=8,
        final_checkpoint_uri=None,
        last_val_loss=None,
        shard_cache_key="k",
        shard_uri="u",
        data_cache_hit=False,
        resumed_from_step=0,
        metrics_uri="u",
    )
    section = report_task._since_base_section(store, "cpt", result)
    png = store.read_bytes(run_file_key("cpt", GAINS_PLOT_FILE))
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and base64.b64encode(png).decode() in section
    assert "domain -0.75 nats (-0.375 bpb), general +0.25 nats since the base (step 8)." in section
    assert [rows for rows, _ in tables] == [ROWS]
    assert result.since_base == {r["source"]: {k: v for k, v in r.items() if k != "source"} for r in ROWS}
    # control: a run with no base evaluation has no section, no plot and no table
    _write_run(store, "scratch", ROOT[1:])
    assert report_task._since_base_section(store, "scratch", result) == "" and len(tables) == 1
    assert not store.exists(run_file_key("scratch", GAINS_PLOT_FILE))


@pytest.mark.parametrize("leaf", ["cpt-lr-mix", "soup-1"])
def test_a_branchs_gain_is_told_against_its_lineages_base_not_its_parents_checkpoint(tmp_path, leaf):
    """cpt (from the base) -> cpt-lr (branched at step 4) -> cpt-lr-mix (branched at step 8),
    and soup-1, a soup whose lead is cpt-lr at step 8: their changes are against cpt's step-0
    evaluation (the base's own weights), not the evaluation of the checkpoint they left."""
    store = Store(f"file://{tmp_path}/store")
    _write_run(store, "cpt", ROOT)
    # the branch's first evaluation is of the checkpoint it left (cpt's step 4)
    parent_step_8 = _eval(8, {"domain": 2.5, "general": 2.625}, {"domain": 1.0, "general": 1.25})
    _write_run(
        store, "cpt-lr", [_eval(4, ROOT[1]["sources"], ROOT[1]["sources_bpb"]), parent_step_8], _branch("cpt", 4)
    )
    last = _eval(12, {"domain": 2.25, "general": 2.75}, {"domain": 0.875, "general": 1.375})
    _write_run(store, "cpt-lr-mix", [parent_step_8, last], _branch("cpt-lr", 8))
    soup = {**_branch("cpt-lr", 8), "soup": {"id": "f" * 64, "inputs": []}}
    _write_run(store, "soup-1", [{**last, "step": 8}], soup)

    changes = changes_since_base(records_with_the_base(store, leaf))
    step = 12 if leaf == "cpt-lr-mix" else 8
    assert (changes["domain"]["base_loss"], changes["general"]["base_bpb"]) == (3.5, 1.0)  # cpt's step 0
    assert changes["domain"]["loss"][-1] == (step, -1.25) and changes["domain"]["bpb"][-1] == (step, -0.625)
    assert changes["general"]["loss"][-1] == (step, 0.5) and changes["general"]["bpb"][-1] == (step, 0.375)
    # controls: against the parent's checkpoint (its step-8 evaluation) the changes are other numbers;
    # the nearest parent's own records hold no base at all
    against_parent = changes_since_base([{**parent_step_8, "step": 0}, {**last, "step": step}])
    assert against_parent["domain"]["loss"][-1] == (step, -0.25) != changes["domain"]["loss"][-1]
    parent_records = [json.loads(line) for line in store.read_bytes(run_file_key("cpt-lr", METRICS_FILE)).splitlines()]
    assert changes_since_base(parent_records + [last]) == {}


def test_a_run_with_no_lineage_and_no_base_evaluation_gets_no_base_added(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    _write_run(store, "cpt", ROOT)
    _write_run(store, "scratch", ROOT[1:])  # a run from scratch evaluated at steps 4 and 8 only
    assert records_with_the_base(store, "scratch") == ROOT[1:]
    assert records_with_the_base(store, "cpt") == ROOT  # its own step 0: nothing added
    # control: the same records as a branch of cpt do get cpt's base
    store.write_json(run_file_key("scratch", LINEAGE_FILE), _branch("cpt", 4))
    assert records_with_the_base(store, "scratch") == ROOT[:1] + ROOT[1:]
