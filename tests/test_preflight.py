"""The one preflight (stoker/preflight.py): every problem of a config on this host from one
call, and the same list wherever a run is checked: `stoker run` and `stoker validate` before
anything starts, and the pipeline's first task (so every deployment of it)."""

import os
import subprocess
import sys

import pytest

from stoker import preflight
from stoker.config import build_config
from stoker.failures import ConfigError, is_transient
from tests.conftest import ROOT, free_port

NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # this host's GPUs, if any, hidden as CUDA hides them


def _file_in_the_way(tmp_path) -> str:
    """A store root that cannot be made: a file where its folder would be (even root fails)."""
    (tmp_path / "a-file").write_text("")
    return f"file://{tmp_path}/a-file/store"


def _read_only_folder(tmp_path) -> str:
    if os.geteuid() == 0:
        pytest.skip("root may write into a read-only folder")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return f"file://{folder}/store"


def _three_problems(tmp_path, root: str) -> dict:
    return {"data.source": str(tmp_path / "no-such-corpus.jsonl"), "launch.backend": "nccl", "storage.root": root}


@pytest.mark.parametrize("unwritable", [_read_only_folder, _file_in_the_way])
def test_a_missing_file_nccl_without_gpus_and_an_unwritable_root_come_back_from_one_call(
    tmp_path, monkeypatch, unwritable
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    root = unwritable(tmp_path)
    config = build_config("tiny-cpu", **_three_problems(tmp_path, root))
    found = preflight.problems(config)
    assert [line.split(":")[0] for line in found] == ["data.source", "launch.backend", "storage.root"], found
    assert "no file matches" in found[0] and "no-such-corpus.jsonl" in found[0]
    assert "'nccl' needs NVIDIA GPUs" in found[1]
    assert found[2].startswith(f"storage.root: {root} cannot be written"), found[2]
    with pytest.raises(ConfigError) as err:
        preflight.check(config)
    assert err.value.problems == found


def test_the_cli_and_the_flows_first_task_check_with_the_same_list(tmp_path, monkeypatch):
    """`stoker validate`, `stoker run` (before it starts Prefect) and validate_config answer
    the same config with the same lines, in the same order."""
    from stoker import cli
    from stoker.tasks.training import validate_config

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    over = _three_problems(tmp_path, _file_in_the_way(tmp_path))
    sets = [f"{key}={value}" for key, value in over.items()]
    expected = preflight.problems(build_config("tiny-cpu", **over))
    assert len(expected) == 3, expected
    with pytest.raises(ConfigError) as by_cli:
        cli.checked_config("tiny-cpu", sets)
    with pytest.raises(ConfigError) as by_task:
        validate_config.fn(build_config("tiny-cpu", **over))
    assert by_cli.value.problems == by_task.value.problems == expected
    args = [arg for item in sets for arg in ("--set", item)]
    for command in ("validate", "run"):
        out = subprocess.run(
            [sys.executable, "-m", "stoker.cli", command, *args],
            cwd=ROOT,
            env={**os.environ, **NO_GPUS},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
        assert out.stderr.startswith("stoker: 3 problem(s) in the run config:"), out.stderr
        assert [line[4:] for line in out.stderr.splitlines() if line.startswith("  - ")] == expected
        assert "Starting temporary server" not in out.stdout + out.stderr  # before Prefect starts


def test_a_config_that_may_run_here_has_none_and_the_probe_leaves_no_folder(tmp_path):
    root = f"file://{tmp_path}/new/store"
    assert preflight.problems(build_config("tiny-cpu", **{"storage.root": root, "launch.backend": "gloo"})) == []
    assert list(tmp_path.iterdir()) == []  # the store probe was written where the folder would be made
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "validate", "--set", f"storage.root={root}", "--set", "run_name=ok"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "run ok: no problem found on this host" in out.stdout, out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_config_built_in_code_gets_the_models_rules_with_the_hosts(tmp_path):
    config = build_config("tiny-cpu", **{"storage.root": f"file://{tmp_path}/store", "launch.backend": "gloo"})
    tokenizer = config.tokenizer.model_copy(update={"path": str(tmp_path / "tokenizer.json")})
    bad = config.model_copy(update={"train": config.train.model_copy(update={"lr": -1.0}), "tokenizer": tokenizer})
    found = preflight.problems(bad)  # model_copy validates nothing: the preflight does
    assert [line.split(":")[0] for line in found] == ["train.lr", "tokenizer.path"], found


def test_a_named_credentials_block_is_loaded_with_the_other_checks(prefect_server, tmp_path):
    from stoker.orchestration.credentials import use_store_credentials

    over = {
        "storage.root": _file_in_the_way(tmp_path),
        "storage.credentials_block": "no-such-block-preflight",
        "tokenizer.path": str(tmp_path / "tokenizer.json"),
        "launch.backend": "gloo",
    }
    config = build_config("tiny-cpu", **over)
    found = preflight.problems(config, load_credentials=use_store_credentials)
    assert [line.split(":")[0] for line in found] == ["tokenizer.path", "storage.credentials_block"], found
    assert "no Prefect block 'secret/no-such-block-preflight'" in found[1]
    # no loader (the CLI without a Prefect server): the block and the store probe that needs
    # its keys are left to the flow's first task
    assert [line.split(":")[0] for line in preflight.problems(config)] == ["tokenizer.path"]


def test_an_unreachable_store_raises_only_when_nothing_else_refuses_the_config(tmp_path, monkeypatch):
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    nobody = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "config_kwargs": {"retries": {"max_attempts": 1}}}
    over = {"storage.root": "s3://bucket/root", "storage.storage_options": nobody, "launch.backend": "gloo"}
    with pytest.raises(Exception) as err:  # a retry may find it back
        preflight.problems(build_config("tiny-cpu", **over))
    assert is_transient(err.value), repr(err.value)
    missing = build_config("tiny-cpu", **over, **{"tokenizer.path": str(tmp_path / "tokenizer.json")})
    [line] = preflight.problems(missing)  # refused anyway: the problem, not the outage
    assert line.startswith("tokenizer.path:")


def test_the_preflight_imports_neither_torch_nor_prefect():
    code = "import sys, stoker.preflight; print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
