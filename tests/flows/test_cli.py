"""The CLI answers a user's mistake with one `stoker: ...` line and exit code 2, never a
traceback, whether it is found before Prefect starts or by a task after it has. What is
refused before the flow's process would start is asked of `stoker.cli.main` in this process;
the exit code and stderr of a real `stoker` process are checked where a task finds the mistake
(and on Ctrl-C)."""

import contextlib
import io
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT


def _cli(*args, timeout=300, env=None):
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture
def stoker_main(monkeypatch):
    """`stoker ARGS` in this process, for what needs no Prefect (a process start is ~2 s of
    CPU; the subprocess tests here keep the real exit code and stderr): returncode, stdout and
    stderr, as `_cli` gives them. Not capsys: Prefect's console handler would keep its stream.
    What it runs must end before the flow's process would start (asserted): no server, no flow."""
    from stoker import cli
    from stoker.cli import main

    def no_flow_process(argv):
        raise AssertionError(f"`stoker {' '.join(argv)}` got past the checks made before Prefect starts")

    monkeypatch.delenv("STOKER_CLI_CHILD", raising=False)
    monkeypatch.setattr(cli, "_supervise", no_flow_process)

    def run(*args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
        return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())

    return run


@pytest.mark.parametrize(
    "args,says",
    [
        (["evaluate", "s3://bucket/not-a-checkpoint"], "checkpoint_uri: "),
        (["run", "--set", "train.lr"], "--set 'train.lr': expected KEY=VALUE"),
        (["run", "--set", "storage.root=s3://"], "storage.root: names no bucket"),
        (["run", "--recipe", "no-such-recipe"], "is neither a file nor a recipe"),
    ],
)
def test_a_mistake_found_before_prefect_starts_is_one_line_and_exit_2(args, says, stoker_main):
    out = stoker_main(*args)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("stoker: ") and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.e2e
def test_a_data_error_found_inside_the_flow_is_one_line_and_exit_2(tmp_path, session_server_env):
    """(On the session's Prefect server: a temporary one of its own is not the subject.)"""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n{broken json\n")
    out = _cli(
        "run",
        "--set",
        f"data.source={corpus}",
        "--set",
        f"storage.root=file://{tmp_path}/store",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.warmup_steps=1",
        env=session_server_env,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    ours = [line for line in out.stderr.splitlines() if line.startswith("stoker: ")]
    assert len(ours) == 1 and "corpus.jsonl line 2 is not JSON" in ours[0], out.stderr[-2000:]
    assert "Traceback" not in out.stdout + out.stderr  # the Prefect log keeps tracebacks for bugs


@pytest.mark.parametrize("where", ["validate_config", "download_dataset"])
def test_a_project_error_fails_the_flow_run_with_the_same_line_and_no_traceback(prefect_server, tmp_path, where):
    """Called as a notebook would: the flow run ends Failed with the message the CLI prints,
    the task and flow logs name the problem without a traceback, and calling the flow raises
    the project error itself. validate_config has no retries (Prefect logs its failure with
    the exception); download_dataset fails on bad data without retrying."""
    import logging

    from stoker.config import load_config
    from stoker.failures import StokerError
    from stoker.flows.pipeline import train_pipeline

    cfg = load_config("tiny-cpu", **{"storage.root": f"file://{tmp_path}/store"})
    if where == "validate_config":  # a config built in code skips load_config's file checks
        missing = str(tmp_path / "missing-tokenizer.json")
        cfg = cfg.model_copy(update={"tokenizer": cfg.tokenizer.model_copy(update={"path": missing})})
        expected = "tokenizer.path: "
    else:
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text(json.dumps({"text": "fine"}) + "\n{broken json\n")
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": str(corpus)})})
        expected = "data.source: "
    records: list[logging.LogRecord] = []
    keep = logging.Handler(level=logging.ERROR)
    keep.emit = records.append  # sees each record as Prefect's own handlers do, after the filters
    loggers = [logging.getLogger(name) for name in ("prefect.task_runs", "prefect.flow_runs")]
    for logger in loggers:
        logger.addHandler(keep)
    try:
        state = train_pipeline(cfg, return_state=True)
    finally:
        for logger in loggers:
            logger.removeHandler(keep)
    assert state.is_failed()
    assert state.message.startswith("stoker: ") and expected in state.message, state.message
    assert records and all(r.exc_info is None for r in records), [r.getMessage() for r in records]
    assert any(expected in r.getMessage() for r in records)
    with pytest.raises(StokerError, match=expected):
        train_pipeline(cfg)
    # the server's copy of that state has no data: an engine left holding it (a final state
    # proposed twice by a client that tried again, under load) raises Prefect's FailedRun
    # with the message instead; the CLI says that line all the same, with exit 2
    from prefect.client.orchestration import get_client
    from prefect.exceptions import FailedRun
    from prefect.states import get_state_exception

    from stoker.cli import project_error_line

    with get_client(sync_client=True) as client:
        server_copy = client.read_flow_run(state.state_details.flow_run_id).state
    assert server_copy.data is None and server_copy.message == state.message
    failed = get_state_exception(server_copy)
    assert isinstance(failed, FailedRun) and project_error_line(failed) == state.message
    assert project_error_line(get_state_exception(state)) is None  # the error itself: StokerError's path
    assert project_error_line(FailedRun("Run failed.")) is None  # not a project error: a traceback
    # Prefect's own error while it reported the project error's end ('database is locked'):
    # the project error, its cause or context, is still the one line
    try:
        try:
            raise get_state_exception(state)
        except Exception:
            raise RuntimeError("sqlite3.OperationalError: database is locked") from None
    except RuntimeError as err:
        assert project_error_line(err) is None  # `from None`: nothing says it was ours
    try:
        try:
            raise get_state_exception(state)
        except Exception:
            raise RuntimeError("sqlite3.OperationalError: database is locked")  # noqa: B904
    except RuntimeError as err:
        assert project_error_line(err) == state.message


@pytest.mark.e2e
def test_a_missing_bucket_is_one_line_and_exit_2_with_nothing_written(s3_server, tmp_path, stoker_main):
    import boto3

    out = stoker_main(
        "run",
        "--set",
        "storage.root=s3://no-such-bucket-stoker/root",
        "--set",
        "storage.storage_options=" + json.dumps({"endpoint_url": s3_server.url}),
        "--set",
        "train.max_steps=2",
        "--set",
        "train.warmup_steps=1",
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    ours = [line for line in out.stderr.splitlines() if line.startswith("stoker: ")]
    assert len(ours) == 1, out.stderr[-2000:]
    problem = out.stderr[out.stderr.index("stoker: ") :]
    assert "storage.root: s3://no-such-bucket-stoker/root cannot be written" in problem
    client = boto3.client("s3", endpoint_url=s3_server.url)
    assert "no-such-bucket-stoker" not in [b["Name"] for b in client.list_buckets()["Buckets"]]


@pytest.mark.e2e
def test_ctrl_c_is_one_line_exit_130_and_leaves_nothing_running(tmp_path):
    """Ctrl-C mid-training stops the gang the way a cancel does: one line, exit 130, no process
    left, the attempt recorded as interrupted, and the flow run Crashed in Prefect's database
    (not left Running: the embedded server is out of the terminal's reach until the end)."""
    import json
    import os
    import signal
    import sqlite3
    import time

    from tests.conftest import live_processes, seeded_prefect_home, tiny_sets, wait_for_none, wait_until_training

    home = tmp_path / "prefect-home"
    seeded_prefect_home(home)  # the temporary server's database, migrated already
    env = {**os.environ, "STOKER_ROOT": str(tmp_path / "store"), "GLOO_SOCKET_IFNAME": "lo", "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        # one rank: the CLI's answer to Ctrl-C is the subject; a gang stopped on a signal is
        # tests/launch/test_lifeline_gang.py's
        [sys.executable, "-m", "stoker.cli", "run"]
        + tiny_sets(train={"max_steps": 100000}, launch={"nproc_per_node": 1})
        + ["--set", "run_name=ctrlc"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = wait_until_training(proc.pid, tmp_path / "store" / "runs" / "ctrlc" / "metrics.jsonl")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # what a terminal sends on Ctrl-C
    _, err = proc.communicate(timeout=120)
    print(f"returned {time.monotonic() - t0:.1f} s after Ctrl-C")
    assert proc.returncode == 130, err[-2000:]
    ours = [line for line in err.splitlines() if line.startswith("stoker: ")]
    assert len(ours) == 1 and ours[0].startswith("stoker: interrupted; the ranks were stopped"), err[-2000:]
    assert "Traceback" not in err
    assert wait_for_none(lambda: [pid for pid in seen if pid in live_processes()]) == []
    attempts = [
        json.loads(line) for line in (tmp_path / "store" / "runs" / "ctrlc" / "attempts.jsonl").read_text().splitlines()
    ]
    assert len(attempts) == 1 and attempts[0]["outcome"].startswith("interrupted"), attempts
    with sqlite3.connect(home / "prefect.db") as db:
        states = db.execute("select name, state_type from flow_run").fetchall()
    assert ("ctrlc", "CRASHED") in states, states


def test_a_gpu_recipe_on_a_machine_without_gpus_is_one_line_before_prefect_starts(tmp_path, stoker_main):
    import time

    from stoker.launch.devices import visible_gpu_count

    if visible_gpu_count():
        pytest.skip("this machine has GPUs")
    t0 = time.monotonic()
    out = stoker_main("run", "--recipe", "gpt2-124m", "--set", f"storage.root=file://{tmp_path}/store")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    ours = [line for line in out.stderr.splitlines() if line.startswith("stoker: ")]
    assert len(ours) == 1 and "launch.backend: 'nccl' needs NVIDIA GPUs" in out.stderr
    assert "Traceback" not in out.stderr and "Starting temporary server" not in out.stdout + out.stderr
    assert not (tmp_path / "store").exists()  # nothing written
    print(f"refused in {time.monotonic() - t0:.1f} s")


def test_runs_checkpoints_verify_and_config_list_read_the_store_without_prefect(tmp_path, stoker_main):
    """A store with one run: two committed checkpoints, the newer one with a flipped byte
    (sizes match, so only verify's checksums find it) and one never committed."""
    from stoker.config import load_config
    from stoker.storage.checkpoints import commit_checkpoint, new_checkpoint_key
    from stoker.storage.layout import CONFIG_FILE, run_file_key
    from stoker.storage.store import Store, join

    store = Store(f"file://{tmp_path}/store")
    store.write_bytes(run_file_key("r1", CONFIG_FILE), load_config("tiny-cpu").model_dump_json().encode())
    keys = {}
    for step, commit in ((4, True), (8, True), (12, False)):
        keys[step] = key = new_checkpoint_key(store, "r1", step)
        store.write_bytes(join(key, ".metadata"), b"meta" * 10)
        store.write_bytes(join(key, "__0_0.distcp"), bytes(range(256)) * 4)
        if commit:
            commit_checkpoint(store, key, {"step": step, "world_size": 1})
    shard = join(keys[8], "__0_0.distcp")
    data = store.read_bytes(shard)
    store.write_bytes(shard, data[:10] + bytes([data[10] ^ 1]) + data[11:])

    out = stoker_main("runs", "--root", store.root)
    assert out.returncode == 0, out.stderr
    [row] = [line.split() for line in out.stdout.splitlines()[1:]]
    assert row[:4] == ["r1", "8", "500", "3"]  # the cheap choice: sizes match at step 8
    out = stoker_main("checkpoints", "r1", "--root", store.root)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("12") and "INVALID: no manifest" in lines[1]
    # the flipped byte keeps the sizes: the listing does not claim it valid, only committed
    assert lines[2].startswith("8") and "committed (not verified)" in lines[2] and lines[3].startswith("4")
    assert "valid" not in lines[2].replace("INVALID", "") and "stoker verify" in out.stdout
    good = stoker_main("verify", store.url(keys[4]))
    assert good.returncode == 0 and "intact (2 files, every sha256 matches)" in good.stdout
    bad = stoker_main("verify", store.url(keys[8]))
    assert bad.returncode == 1 and "__0_0.distcp fails its sha256 checksum" in bad.stderr
    listing = stoker_main("config", "--list")
    assert listing.returncode == 0
    assert "engine.parallelism  ['ddp' | 'fsdp' | 'fsdp+tp']  default: 'ddp'" in listing.stdout
    assert "train.max_steps  [int (>= 1)]" in listing.stdout
    typo = stoker_main("run", "--set", "train.max_step=5")
    assert typo.returncode == 2 and "did you mean train.max_steps?" in typo.stderr


def test_evaluate_of_a_deleted_checkpoint_is_one_line_and_exit_2(tmp_path, stoker_main):
    """A checkpoint retention deleted (or never committed): refused before any server starts,
    once, naming why; no retry of what cannot heal."""
    from stoker.storage.checkpoints import commit_checkpoint, new_checkpoint_key
    from stoker.storage.store import Store, join

    store = Store(f"file://{tmp_path}/store")
    key = new_checkpoint_key(store, "r1", 4)
    store.write_bytes(join(key, ".metadata"), b"meta")
    commit_checkpoint(store, key, {"step": 4, "world_size": 1})
    store.rm(key)
    out = stoker_main("evaluate", store.url(key))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        f"stoker: checkpoint {store.url(key)} does not exist (deleted, e.g. by retention "
        "(checkpoint.keep_latest_k), or never written); name one that `stoker checkpoints RUN` lists"
    ]
    assert "Starting temporary server" not in out.stdout + out.stderr


def test_a_field_that_contradicts_the_base_is_one_line_exit_2_and_nothing_written(
    tmp_path, tmp_path_factory, stoker_main
):
    """model.init_from's config.json says 2 layers; --set model.n_layer=3 is refused, naming
    both values, before Prefect starts; the store holds nothing of it."""
    from tests.bases import tiny_base

    base = tiny_base(tmp_path_factory, "llama")
    out = stoker_main(
        "run",
        "--recipe",
        "tiny-llama-cpu",
        "--set",
        f"storage.root=file://{tmp_path}/store",
        "--set",
        f"model.init_from={base}",
        "--set",
        "model.n_layer=3",
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.splitlines() == [
        "stoker: 1 problem(s) in the run config:",
        "  - model.n_layer: 3 contradicts the base's config.json (2); leave it out (or null) to take the "
        "base's value, or start from another base",
    ]
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.*"))
