"""Prefect is never on the training path: a real `prefect server start` that goes away during
training and comes back, a PREFECT_API_URL that nothing answers, and the flow run of a Python
process that was killed. The e2e tests share one server (the session's restartable one).
(`stoker serve` after `stoker deploy` on the same server: test_deployments' serve test.)"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.conftest import ROOT, descendants, free_port, start_process, stop_process, tiny_dict, wait_for


@pytest.fixture
def server(restartable_prefect_server):
    """The session's restartable server (tests.conftest), shared with test_events_e2e: one
    xdist group, so `make test` starts it once; the outage test stops and starts it again (and
    when it failed in between, this starts it again for the group's next tests)."""
    yield restartable_prefect_server
    if not restartable_prefect_server.healthy():
        restartable_prefect_server.start()


# The server is read over its REST API with httpx, not with Prefect's client: an in-process
# client (and run_deployment's events) bound to this module's server, which is gone by the
# session's end, left prefect_test_harness's teardown waiting forever to drain its workers.
def api(url, method, path, body=None):
    """One call of the server's REST API; the answer's JSON. A 503 (the server's SQLite busy
    on a loaded machine) is tried again, as Prefect's own client does."""
    for attempt in range(6):
        answer = httpx.request(method, url.rstrip("/") + path, json=body, timeout=30)
        if answer.status_code not in (502, 503) or attempt == 5:
            break
        time.sleep(1 + attempt)
    answer.raise_for_status()
    return answer.json()


def flow_run_of(url, run_name):
    runs = api(url, "POST", "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [f"run:{run_name}"]}}})
    assert len(runs) == 1, runs
    return runs[0]


def state_of(run) -> tuple[str, str]:
    """(the state's type, its message) of a flow run's JSON."""
    return run["state"]["type"], run["state"].get("message") or ""


def train_steps_logged(store, run_name) -> int:
    path = os.path.join(store, "runs", run_name, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    steps = [json.loads(line).get("step", 0) for line in open(path) if line.strip()]
    return max(steps, default=0)


def slow_run_config(tmp_path, run_name, max_steps, nproc_per_node=2, interval_steps=20):
    """A tiny run made long by sleeping before each step (training.faults 'slow'), a checkpoint
    every `interval_steps` (its metrics.jsonl in the store grows at each commit)."""
    store = str(tmp_path / "store")
    cfg = tiny_dict(
        "file://" + store,
        run_name=run_name,
        train={"max_steps": max_steps, "log_interval": 2},
        checkpoint={"interval_steps": interval_steps},
        eval={"interval_steps": 1000, "per_checkpoint_enabled": False},
        launch={"hang_timeout_seconds": 60, "timeout_seconds": 900, "nproc_per_node": nproc_per_node},
    )
    path = tmp_path / f"{run_name}.json"
    path.write_text(json.dumps(cfg))
    return store, str(path)


# ---- the server away during training ------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.xdist_group("prefect-away-server")
def test_training_outlives_a_prefect_server_outage_and_the_ui_catches_up(server, tmp_path):
    """The server is stopped for longer than the client's retry window (2 retries: about 6 s)
    while the ranks train, then started again: the ranks train on, the flow's log and the
    watchdog go on, the run ends Completed and its artifacts show the end of training."""

    run_name = "outage-" + uuid.uuid4().hex[:6]
    store, cfg = slow_run_config(tmp_path, run_name, max_steps=160)
    log = tmp_path / "run.log"
    env = {
        **server.env,
        "PREFECT_CLIENT_MAX_RETRIES": "2",
        "STOKER_FAULT": "slow:seconds=0.25",
        "STOKER_ROOT": store,
        "STOKER_CACHE": str(tmp_path / "cache"),
    }
    with open(log, "w") as out:
        run = start_process([sys.executable, "-m", "stoker.cli", "run", "--recipe", cfg], env, out)
    try:
        wait_for("training to start", lambda: train_steps_logged(store, run_name) >= 10, 300, [log])
        server.stop()
        at_stop, lines_at_stop = train_steps_logged(store, run_name), log.read_text().count(" loss ")
        time.sleep(25)  # well past the client's retries: every Prefect call of the run fails
        assert run.poll() is None, log.read_text()[-3000:]  # the run is not ended by the outage
        during = log.read_text().count(" loss ") - lines_at_stop
        assert train_steps_logged(store, run_name) > at_stop  # the ranks trained on
        assert during >= 3, log.read_text()[-3000:]  # the flow's log went on (its stream loop too)
        server.start()
        assert run.wait(timeout=600) == 0, log.read_text()[-5000:]
    finally:
        stop_process(run)
    text = log.read_text()
    assert "Prefect API call for" in text and "answers again" in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    flow_run = flow_run_of(server.url, run_name)
    assert state_of(flow_run)[0] == "COMPLETED", state_of(flow_run)
    artifacts = api(server.url, "POST", "/artifacts/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
    progress = [a for a in artifacts if (a["key"] or "").startswith(f"{run_name}-progress-")]
    assert progress and progress[0]["data"] == 100.0, progress  # caught up after the outage
    # the live table (the report's final one is written after the outage in any case)
    tables = [a for a in artifacts if (a["key"] or "").startswith(f"{run_name}-checkpoints-live-")]
    steps = {row["step"] for a in tables for row in json.loads(a["data"])}
    assert {40, 80, 120, 160} <= steps, steps  # every checkpoint, those committed while away too


# ---- one line for a server that is not there ------------------------------------------------
def test_an_unreachable_prefect_api_url_is_one_line_before_any_compute(monkeypatch, capsys, tmp_path):
    from stoker.cli import main

    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    monkeypatch.setenv("PREFECT_API_URL", url)
    monkeypatch.setenv("STOKER_ROOT", str(tmp_path / "store"))
    monkeypatch.delenv("STOKER_CLI_CHILD", raising=False)
    for argv in (["run", "--set", "train.max_steps=2", "--set", "train.warmup_steps=0"], ["deploy"]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"stoker: PREFECT_API_URL={url}: nothing answers there"), err
        assert "prefect server start" in err and "unset PREFECT_API_URL" in err
    assert not (tmp_path / "store").exists()  # nothing was computed or written


# ---- a killed Python process (a notebook kernel restart) --------------------------------
NOTEBOOK = """
import json, sys
from stoker.flows.pipeline import train_pipeline
from stoker.config import load_config
train_pipeline(load_config(sys.argv[1]))
"""


NEXT_FLOW = """
import sys
from stoker.flows.evaluation_flow import evaluate_checkpoint_flow
print("failed:", evaluate_checkpoint_flow(sys.argv[1], return_state=True).is_failed())
"""


@pytest.mark.e2e
@pytest.mark.xdist_group("prefect-away-server")
def test_the_flow_run_of_a_killed_python_process_ends_crashed(server, tmp_path):
    run_name = "kernel-" + uuid.uuid4().hex[:6]
    # one rank: the flow run of the killed process is the subject (its launcher and rank die too);
    # a checkpoint every 4 steps: training is seen started (metrics.jsonl stored) at step 4, not 20
    store, cfg = slow_run_config(tmp_path, run_name, max_steps=400, nproc_per_node=1, interval_steps=4)
    log = tmp_path / "kernel.log"
    env = {
        **server.env,
        "STOKER_FAULT": "slow:seconds=0.25",
        "STOKER_ROOT": store,
        "STOKER_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": ROOT,
    }
    with open(log, "w") as out:
        kernel = start_process([sys.executable, "-c", NOTEBOOK, cfg], env, out)
    seen = {}
    try:

        def training():
            seen.update(descendants(kernel.pid))
            return train_steps_logged(store, run_name) >= 2

        wait_for("training to start", training, 300, [log])
        seen.update(descendants(kernel.pid))
        os.kill(kernel.pid, signal.SIGKILL)  # the kernel dies: nothing of it reports anything
        kernel.wait()
    finally:
        for pid in list(seen) + [kernel.pid]:  # its ranks too (a restart would leave them)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop_process(kernel)
    killed = flow_run_of(server.url, run_name)
    assert state_of(killed)[0] == "RUNNING"  # what Prefect alone leaves
    # the next stoker flow on this host, here one that fails at once, finds it (in a process of
    # its own, like the next notebook: this one's Prefect workers stay off the module's server)
    nxt = subprocess.run(
        [sys.executable, "-c", NEXT_FLOW, f"file://{tmp_path}/none/runs/x/checkpoints/step-00000001"],
        cwd=ROOT,
        env={**server.env, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert nxt.returncode == 0 and "failed: True" in nxt.stdout, nxt.stdout[-3000:] + nxt.stderr[-3000:]
    after = api(server.url, "GET", f"/flow_runs/{killed['id']}")
    assert state_of(after)[0] == "CRASHED", state_of(after)
    assert "ended without reporting" in state_of(after)[1]
