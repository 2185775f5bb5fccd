import subprocess
import sys

from tests.conftest import ROOT


def test_training_package_runs_without_the_orchestrator():
    code = (
        "import sys, stoker.training.train, stoker.training.evaluation_main, stoker.training.loop, "
        "stoker.training.distributed, stoker.training.metrics, stoker.training.checkpoint, "
        "stoker.training.export, stoker.training.harness_main, stoker.training.ray_main; "
        "bad = [m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
