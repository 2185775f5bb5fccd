"""One writer per run: while another launch (a live process) holds a run's lease, a second
launch of the run refuses in one line naming the holder, before any data or compute; with
--takeover it trains, and the holder loses the lease."""

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, tiny_dict

_HOLDER = """
import sys, time
from stoker.storage.store import Store
from stoker.storage.lease import acquire_lease
store = Store(sys.argv[1], {opts})
lease = acquire_lease(store, sys.argv[2], flow_run_id="other-flow-run", ttl=30)
lease.start_heartbeat(on_lost=lambda why: (print("LOST", why, flush=True)))
print("READY", flush=True)
deadline = time.time() + 600
while time.time() < deadline and not lease.lost:
    time.sleep(0.2)
time.sleep(1)
"""


def _hold(root: str, options: dict, run: str) -> subprocess.Popen:
    """Another launch of the run: a process holding its lease, heartbeat running."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER.format(opts=repr(options)), root, run],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "READY"
    return proc


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    return proc.communicate(timeout=60)[0]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_second_launch_refuses_before_any_work_and_writes_nothing(prefect_server, tmp_path, where, request):
    from stoker.config import load_config
    from stoker.flows.pipeline import train_pipeline
    from stoker.storage.checkpoints import list_checkpoints
    from stoker.storage.lease import LeaseHeld
    from stoker.storage.store import Store

    root, options = (f"file://{tmp_path}/store", {}) if where == "local" else request.getfixturevalue("s3_root")
    cfg = load_config(tiny_dict(root, run_name="leased", storage={"root": root, "storage_options": options}))
    holder = _hold(root, options, "leased")
    try:
        with pytest.raises(LeaseHeld) as err:
            train_pipeline(cfg)
    finally:
        _stop(holder)
    text = str(err.value)
    assert "\n" not in text and f"pid {holder.pid}" in text and "flow run other-flow-run" in text
    assert "--takeover" in text
    store = Store(root, options)
    assert list_checkpoints(store, "leased") == []
    assert store.listdir("shards") == [] and store.listdir("datasets") == []  # refused before data prep


def _cli(*args, env, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.e2e
def test_cli_refuses_in_one_line_and_takeover_trains(tmp_path, session_server_env):
    root = f"file://{tmp_path}/store"
    recipe = tmp_path / "tiny.json"
    # one rank: the lease is the launcher's, not the gang's
    recipe.write_text(json.dumps(tiny_dict(root, run_name="leased", launch={"nproc_per_node": 1})))
    holder = _hold(root, {}, "leased")
    try:
        out = _cli("run", "--recipe", str(recipe), env=session_server_env)
        assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
        ours = [line for line in out.stderr.splitlines() if line.startswith("stoker: ")]
        assert len(ours) == 1 and "already being trained" in ours[0] and f"pid {holder.pid}" in ours[0], out.stderr[
            -2000:
        ]
        assert "Traceback" not in out.stderr
        out = _cli("run", "--recipe", str(recipe), "--takeover", env=session_server_env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        # no task timeout that Prefect can only warn about (tests/tasks/test_timeouts.py)
        assert "cannot interrupt blocking operations" not in out.stdout + out.stderr
        deadline = time.monotonic() + 60
        while holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        said = _stop(holder)
    assert "LOST" in said  # the old holder's heartbeat found the lease taken
    from stoker.storage.checkpoints import find_latest_valid
    from stoker.storage.lease import read_lease
    from stoker.storage.store import Store

    store = Store(root)
    assert find_latest_valid(store, "leased").checkpoint.step == 8
    assert read_lease(store, "leased") == (None, None)  # released at the end
