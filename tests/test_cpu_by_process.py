"""scripts/cpu_by_process.py, which says which processes a command's CPU went to: a child that
burns CPU is counted under its kind, a sleeping one is not, and the kinds tell a Ray worker
(whose command line names the raylet) from the raylet."""

import importlib.util
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "cpu_by_process.py")
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass  # stoker-burner"


def test_a_burning_child_is_counted_and_a_sleeping_one_is_not(tmp_path):
    out = tmp_path / "kinds.json"
    command = (
        "import subprocess, sys; "
        f"subprocess.run([sys.executable, '-c', {BURN!r}], check=True); "
        "subprocess.run(['sleep', '1.5'], check=True)"
    )
    done = subprocess.run(
        [sys.executable, SCRIPT, "--interval", "0.1", "--out", str(out), "--", sys.executable, "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cpu_by_process:" in done.stdout and "kind" in done.stdout
    rows = json.loads(out.read_text())["processes"]
    burner = [r for r in rows if r["cmdline"].endswith("# stoker-burner")]  # not its parent
    # counted up to its last sample (a lower bound): most of its 1.0 CPU-s, even on a loaded
    # machine where the sampler wakes late
    assert len(burner) == 1 and burner[0]["cpu"] >= 0.5, burner
    assert not [r for r in rows if r["cmdline"] == "sleep 1.5" and r["cpu"] > 0.05]


def test_the_kinds_of_ray_and_torchrun_processes():
    spec = importlib.util.spec_from_file_location("cpu_by_process", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kinds = {
        "python3 /x/ray/_private/workers/default_worker.py --raylet-ip-address=10.0.0.1": "Ray worker or actor",
        "ray::RayTrainWorker": "Ray worker or actor",
        "/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/s": "Ray raylet",
        "python3 -m torch.distributed.run --nnodes=1 -m stoker.training.train --config c": "torchrun agent",
        "python3 -m stoker.training.train --config c": "rank (stoker.training.train)",
        "python3 -m stoker.training.evaluation_main --checkpoint s3://b/c": "evaluation",
    }
    assert {line: module.kind(line) for line in kinds} == kinds
