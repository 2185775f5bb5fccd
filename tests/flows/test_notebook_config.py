"""examples/quickstart.ipynb's own settings (per-checkpoint evaluation, checkpoint.keep_latest_k=2,
a checkpoint every 20 of 60 steps) through the flow, without a notebook kernel: retention used
to delete a checkpoint before its evaluation read it."""

import ast
import json
import os
import re

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def notebook_settings() -> tuple[str, dict]:
    """The recipe and overrides of the notebook's load_config call, read from the notebook."""
    with open(os.path.join(ROOT, "examples", "quickstart.ipynb")) as f:
        cells = json.load(f)["cells"]
    source = next("".join(c["source"]) for c in cells if "load_config(" in "".join(c["source"]))
    m = re.search(r'load_config\("([^"]+)",\s*\*\*(\{.*?\})\)', source, re.S)
    return m.group(1), ast.literal_eval(m.group(2))


def test_the_notebooks_settings_evaluate_every_checkpoint_without_a_failure(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from stoker.core.config import load_config
    from stoker.flows.pipeline import train_pipeline
    from stoker.storage.checkpoints import EVAL_PIN, list_checkpoints
    from stoker.storage.store import Store

    recipe, settings = notebook_settings()
    assert settings["checkpoint.interval_steps"] < settings["train.max_steps"]  # still the case it covers
    root = "file://" + str(tmp_path / "store")
    # a run name of its own: the notebook's test (same server) runs the notebook's run name too
    config = load_config(
        recipe, **{**settings, "storage.root": root, "run_name": f"{settings.get('run_name', 'notebook')}-settings"}
    )
    assert config.eval.per_checkpoint_enabled and config.checkpoint.keep_latest_k == 2
    result = train_pipeline(config)

    steps = list(range(config.checkpoint.interval_steps, config.train.max_steps + 1, config.checkpoint.interval_steps))
    assert [(c["step"], c["val_loss"] is not None) for c in result.checkpoints] == [(s, True) for s in steps]
    run = config.resolved_run_name()
    with get_client(sync_client=True) as client:
        [flow_run] = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run}"])))
        evaluations = [
            t
            for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]}))
            if t.name.startswith("evaluate_checkpoint")
        ]
    assert len(evaluations) == len(steps)
    assert all(t.state.is_completed() and t.run_count == 1 for t in evaluations), [
        (t.name, t.state.name, t.state.message, t.run_count) for t in evaluations
    ]
    # every evaluation removed its pin, and the retention it held off has happened
    store = Store(root)
    refs = list_checkpoints(store, run)
    assert sorted(r.step for r in refs) == steps[-2:]
    assert not any(store.exists(f"{r.key}/{EVAL_PIN}") for r in refs)
