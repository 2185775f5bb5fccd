"""scripts/host_speed.py, the flag for a slowed host that .ci/run prints around the suite."""

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "host_speed.py")


def test_host_speed_prints_one_line_of_median_cpu_and_wall_seconds():
    out = subprocess.run(
        [sys.executable, SCRIPT, "--reps", "3", "--count", "200000"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    line = re.fullmatch(
        r"host speed: (\d+\.\d\d) CPU-s and (\d+\.\d\d) s for 200,000 additions \(median of 3\)\n", out.stdout
    )
    assert line, out.stdout


def test_a_count_below_one_is_one_error_and_exit_2():
    out = subprocess.run([sys.executable, SCRIPT, "--reps", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert "--reps: must be at least 1, got 0" in out.stderr and "Traceback" not in out.stderr
