"""examples/quickstart.ipynb, executed as a user would run it (nbclient, a real kernel),
against the session's Prefect server."""

import os
import shutil

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_the_example_notebook_runs_the_pipeline_and_plots_the_loss(prefect_server, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    from prefect.settings import PREFECT_API_URL

    work = tmp_path / "examples"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "quickstart.ipynb"), work)
    nb = nbformat.read(work / "quickstart.ipynb", as_version=4)
    # the kernel inherits this environment: the session's server, a store of its own
    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
    monkeypatch.setenv("STOKER_ROOT", str(tmp_path / "store"))
    monkeypatch.setenv("PYTHONPATH", ROOT)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}}).execute()

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "step 0 -> 60, final validation loss" in text
    assert "ERROR" not in text  # no telemetry or other noise from Prefect
    last = nb.cells[-1].outputs[-1]["data"]["text/plain"]
    n_train, n_val, final_val = eval(last)  # (train points, validation points, last checkpoint's loss)
    assert n_train >= 12 and n_val >= 3 and final_val is not None  # every 5 steps (and step 1)
    assert (work / "loss.png").stat().st_size > 10_000
    assert (tmp_path / "store" / "runs" / "notebook-quickstart" / "loss-curve.png").exists()
