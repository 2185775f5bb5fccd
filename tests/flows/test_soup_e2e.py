"""The soup flow end to end on a real Prefect server: a run's own window (one phase) averaged into a
new run, evaluated beside each input, its lineage read back by `stoker runs`, exported and loaded
by transformers; the same soup twice computes nothing; a branch from the soup resumes from it as
docs/soups.md says (the averaged state, at its lead's step)."""

import pytest

from stoker import preflight
from stoker.config import load_config
from stoker.storage.checkpoints import list_checkpoints
from stoker.storage.runs import pin_run_folder
from tests.conftest import prepare_shards, tiny_dict
from tests.forked_ranks import run_forked

pytestmark = pytest.mark.e2e
WSD = {"lr_schedule": "wsd", "decay_steps": 2, "warmup_steps": 2, "max_steps": 8}


def _cfg(root, run, **train):
    # every checkpoint kept: none dropped by the upload backpressure (two pending by default)
    sections = tiny_dict(
        root, run_name=run, checkpoint={"interval_steps": 2, "keep_latest_k": 8, "max_pending_uploads": 8}
    )
    sections["train"].update({**WSD, **train})
    return load_config(sections)


def test_a_soup_is_a_run_evaluated_reported_exported_cached_and_branched_from(prefect_server, tmp_path):
    from transformers import AutoModelForCausalLM

    from stoker.flows.soup import soup
    from stoker.launch.export import export_checkpoint
    from stoker.observe.inspect import list_runs

    root = "file://" + str(tmp_path / "store")
    cfg = _cfg(root, "p")
    store, shards = prepare_shards(cfg)
    run_forked(pin_run_folder(store, cfg, shards), shards.key, nproc=2)
    assert [c.step for c in list_checkpoints(store, "p")] == [8, 6, 4, 2]

    first = soup(["p"], steps="4..6", root=root, run_name="lawa")
    assert first.computed and first.step == 6 and first.checkpoint_uri.endswith("runs/lawa/checkpoints/step-00000006")
    assert [(i["run"], i["step"], i["weight"]) for i in first.lineage["soup"]["inputs"]] == [
        ("p", 4, 0.5),
        ("p", 6, 0.5),
    ]
    [row] = first.rows  # one source: the soup beside each input
    assert row["soup_loss"] == first.evaluation.val_loss
    assert row["p@4 loss"] == first.inputs[0].val_loss and row["p@6 loss"] == first.inputs[1].val_loss
    assert row["beats_each"] in ("yes", "no")

    again = soup(["p"], steps="4..6", root=root, run_name="lawa")  # the same soup: one run, nothing recomputed
    assert not again.computed and again.checkpoint_uri == first.checkpoint_uri
    assert again.evaluation.seconds == first.evaluation.seconds  # the stored evaluation, no new process
    assert [c.step for c in list_checkpoints(store, "lawa")] == [6]

    rows = {r["run"]: r for r in list_runs(root)}
    assert rows["lawa"]["tree"] == "└─ lawa" and rows["lawa"]["soup_of"] == "p@4 x0.5 + p@6 x0.5"

    out = tmp_path / "hf"
    done = export_checkpoint(first.checkpoint_uri, str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.num_parameters() > 0 and done.step == 6
    import json

    [link] = json.loads((out / "config.json").read_text())["stoker"]["lineage"]
    assert link["run"] == "lawa" and link["soup"]["id"] == first.soup_id

    # a run continued from the soup: a branch from its checkpoint, at its lead's step and data position
    branch = preflight.check(_cfg(root, "after-soup", branch_from=first.checkpoint_uri))
    got = run_forked(pin_run_folder(store, branch, shards), shards.key, nproc=2)
    [resumed] = [r for r in got if r["event"] == "resumed"]
    assert resumed["step"] == 6 and resumed["checkpoint"] == first.checkpoint_uri
    assert list_checkpoints(store, "after-soup")[0].step == 8
    assert [c.step for c in list_checkpoints(store, "lawa")] == [6]  # the soup is never written
