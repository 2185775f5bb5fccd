"""The CLI answers a user's mistake with one `stoker: ...` line and exit code 2, never a
traceback, whether it is found before Prefect starts or by a task after it has."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args,says", [
    (["evaluate", "s3://bucket/not-a-checkpoint"], "checkpoint_uri: "),
    (["run", "--set", "train.lr"], "--set 'train.lr': expected KEY=VALUE"),
    (["run", "--set", "storage.root=s3://"], "storage.root: names no bucket"),
    (["run", "--recipe", "no-such-recipe"], "is neither a file nor a recipe"),
])
def test_a_mistake_found_before_prefect_starts_is_one_line_and_exit_2(args, says):
    out = _cli(*args, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("stoker: ") and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.e2e
def test_a_data_error_found_inside_the_flow_is_one_line_and_exit_2(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n{broken json\n")
    out = _cli("run", "--set", f"data.source={corpus}", "--set", f"storage.root=file://{tmp_path}/store",
               "--set", "train.max_steps=2", "--set", "train.warmup_steps=1")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    ours = [line for line in out.stderr.splitlines() if line.startswith("stoker: ")]
    assert len(ours) == 1 and "corpus.jsonl line 2 is not JSON" in ours[0], out.stderr[-2000:]
