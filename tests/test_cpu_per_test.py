"""tests/cpu_per_test.py, the plugin that says where the suite's CPU goes: a test's row counts
the CPU of the processes it starts, and not the time it only waits."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.cpu_per_test import CGROUP_ROOT

TESTS = """
import subprocess, sys, time

BURN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass"

def test_a_child_burns_one_cpu_second():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_waits_a_second():
    time.sleep(1.0)
"""


@pytest.mark.skipif(not os.path.isdir(CGROUP_ROOT) or os.geteuid() != 0, reason="needs cgroup v1 cpuacct and root")
def test_a_tests_row_holds_its_childrens_cpu_and_not_its_waiting(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_two.py").write_text(TESTS)
    out = tmp_path / "rows.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_per_test", "-p", "no:cacheprovider", "test_two.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT, "CPU_PER_TEST_OUT": str(out)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = proc.communicate(timeout=120)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    burn, wait = rows["test_a_child_burns_one_cpu_second"], rows["test_waits_a_second"]
    assert burn["cpu"] >= 1.0, burn  # the child's second, and its start-up
    assert wait["wall"] >= 1.0 and wait["cpu"] < 0.3, wait
    assert "cpu_per_test:" in done.stdout and "test_a_child_burns_one_cpu_second" in done.stdout
    assert not os.path.exists(os.path.join(CGROUP_ROOT, f"stoker-cpu-per-test-{proc.pid}"))  # removed
