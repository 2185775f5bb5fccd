"""examples/quickstart.ipynb, executed as a user would run it (nbclient, a real kernel),
against the session's Prefect server; and its own settings (per-checkpoint evaluation,
checkpoint.keep_latest_k=2, a checkpoint every 20 of 60 steps) checked on that same run:
retention used to delete a checkpoint before its evaluation read it. One execution serves
both tests (a module fixture; one xdist group)."""

import ast
import json
import os
import re
import shutil

import pytest

from tests.conftest import ROOT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("quickstart-notebook")]

# run after the notebook's own cells, in its kernel: what train_pipeline returned there
RESULT_CELL = (
    "import json\n"
    'print("CHECKPOINTS", json.dumps([[c["step"], c["val_loss"] is not None] for c in result.checkpoints]))'
)


def notebook_settings() -> tuple[str, dict]:
    """The recipe and overrides of the notebook's load_config call, read from the notebook."""
    with open(os.path.join(ROOT, "examples", "quickstart.ipynb")) as f:
        cells = json.load(f)["cells"]
    source = next("".join(c["source"]) for c in cells if "load_config(" in "".join(c["source"]))
    m = re.search(r'load_config\("([^"]+)",\s*\*\*(\{.*?\})\)', source, re.S)
    return m.group(1), ast.literal_eval(m.group(2))


@pytest.fixture(scope="module")
def notebook(prefect_server, tmp_path_factory):
    """The notebook executed once: (the executed notebook, the number of its own cells, its
    folder, the store root's folder)."""
    import nbformat
    from nbclient import NotebookClient
    from prefect.settings import PREFECT_API_URL

    tmp_path = tmp_path_factory.mktemp("notebook")
    work = tmp_path / "examples"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "quickstart.ipynb"), work)
    nb = nbformat.read(work / "quickstart.ipynb", as_version=4)
    num_cells = len(nb.cells)
    nb.cells.append(nbformat.v4.new_code_cell(RESULT_CELL))
    # the kernel inherits this environment: the session's server, a store of its own
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
        mp.setenv("STOKER_ROOT", str(tmp_path / "store"))
        mp.setenv("PYTHONPATH", ROOT)
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}}).execute()
    return nb, num_cells, work, tmp_path / "store"


def test_the_example_notebook_runs_the_pipeline_and_plots_the_loss(notebook):
    nb, num_cells, work, store = notebook
    cells = nb.cells[:num_cells]  # the notebook's own
    outputs = [o for cell in cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "step 0 -> 60, final validation loss" in text
    assert "ERROR" not in text  # no telemetry or other noise from Prefect
    last = cells[-1].outputs[-1]["data"]["text/plain"]
    n_train, n_val, final_val = eval(last)  # (train points, validation points, last checkpoint's loss)
    assert n_train >= 12 and n_val >= 3 and final_val is not None  # every 5 steps (and step 1)
    assert (work / "loss.png").stat().st_size > 10_000
    assert (store / "runs" / "notebook-quickstart" / "loss-curve.png").exists()


def test_the_notebooks_settings_evaluate_every_checkpoint_without_a_failure(notebook):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from stoker.config import load_config
    from stoker.storage.checkpoints import EVAL_PIN, list_checkpoints
    from stoker.storage.store import Store

    nb, _, _, store_dir = notebook
    recipe, settings = notebook_settings()
    assert settings["checkpoint.interval_steps"] < settings["train.max_steps"]  # still the case it covers
    root = "file://" + str(store_dir)
    config = load_config(recipe, **{**settings, "storage.root": root})  # what the notebook ran
    assert config.eval.per_checkpoint_enabled and config.checkpoint.keep_latest_k == 2
    [said] = [line for o in nb.cells[-1].outputs for line in o.get("text", "").splitlines()]
    checkpoints = json.loads(said.removeprefix("CHECKPOINTS "))  # the kernel's result.checkpoints

    steps = list(range(config.checkpoint.interval_steps, config.train.max_steps + 1, config.checkpoint.interval_steps))
    assert [tuple(c) for c in checkpoints] == [(s, True) for s in steps]
    run = config.resolved_run_name()
    with get_client(sync_client=True) as client:
        [flow_run] = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run}"])))

        def evaluations():  # task runs and their states reach the database as events, a little later
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]}))
            found = [t for t in runs if t.name.startswith("evaluate_checkpoint")]
            done = len(found) >= len(steps) and all(t.state is not None and t.state.is_final() for t in found)
            return found if done else None

        evaluations = wait_for("the evaluations' task runs in final states", evaluations, 60)
    assert len(evaluations) == len(steps)
    assert all(t.state.is_completed() and t.run_count == 1 for t in evaluations), [
        (t.name, t.state.name, t.state.message, t.run_count) for t in evaluations
    ]
    # every evaluation removed its pin, and the retention it held off has happened
    store = Store(root)
    refs = list_checkpoints(store, run)
    assert sorted(r.step for r in refs) == steps[-2:]
    assert not any(store.exists(f"{r.key}/{EVAL_PIN}") for r in refs)
