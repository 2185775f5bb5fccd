"""Interrupting a flow call in Python, as a notebook's "interrupt kernel" does (SIGINT to the
kernel's process only): the gang stops through the launcher's stop path, the attempt is
recorded as interrupted, the flow run ends Crashed in Prefect's database (the embedded
server, a child of the kernel, is still up to hear it), and nothing of the run is left."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, live_processes, seeded_prefect_home, tiny_dict, wait_for_none, wait_until_training

pytestmark = pytest.mark.e2e

# a kernel handles SIGINT itself (ipykernel installs a handler); said explicitly here, because
# a process started in the background by a non-interactive shell (a CI runner's `cmd &`)
# inherits SIGINT ignored, and Python then leaves it ignored
KERNEL = """
import json
import os
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
from stoker.config import load_config
from stoker.flows.pipeline import train_pipeline
try:
    train_pipeline(load_config(json.loads(os.environ["KERNEL_CONFIG"])))
except KeyboardInterrupt:
    print("KeyboardInterrupt reached the caller", flush=True)
"""


def test_an_interrupted_flow_call_crashes_the_flow_run_records_the_attempt_and_leaves_nothing(tmp_path):
    home = tmp_path / "prefect-home"
    seeded_prefect_home(home)  # the embedded server's database, migrated already
    env = {
        **os.environ,
        "STOKER_ROOT": str(tmp_path / "store"),
        "GLOO_SOCKET_IFNAME": "lo",
        "PREFECT_HOME": str(home),
        "PYTHONPATH": ROOT,
        "KERNEL_CONFIG": json.dumps(
            # one rank: the interrupted call is the subject; a gang stopped on Ctrl-C is
            # tests/launch/test_lifeline_gang.py's
            tiny_dict(
                f"file://{tmp_path}/store",
                run_name="kernel",
                train={"max_steps": 100000},
                launch={"nproc_per_node": 1},
            )
        ),
    }
    env.pop("PREFECT_API_URL", None)
    log = open(tmp_path / "kernel.log", "w")  # a file: the server it starts keeps its output open
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = {}
    try:
        seen = wait_until_training(kernel.pid, tmp_path / "store" / "runs" / "kernel" / "metrics.jsonl")
        t0 = time.monotonic()
        os.kill(kernel.pid, signal.SIGINT)  # the kernel only, as Jupyter's interrupt
        kernel.wait(timeout=120)
        out = (tmp_path / "kernel.log").read_text()
        print(f"the call returned {time.monotonic() - t0:.1f} s after the interrupt")
        assert "KeyboardInterrupt reached the caller" in out, out[-3000:]
        run = {pid for pid, p in seen.items() if "training." in p.cmdline or "torch.distributed" in p.cmdline}
        assert run  # agents, ranks, evaluations
        assert wait_for_none(lambda: [pid for pid in run if pid in live_processes()]) == []
        attempts = [
            json.loads(line)
            for line in (tmp_path / "store" / "runs" / "kernel" / "attempts.jsonl").read_text().splitlines()
        ]
        assert len(attempts) == 1 and attempts[0]["outcome"] == "interrupted (KeyboardInterrupt)", attempts
        with sqlite3.connect(home / "prefect.db") as db:
            states = db.execute("select name, state_type from flow_run").fetchall()
        assert ("kernel", "CRASHED") in states, states
    finally:  # the kernel's embedded server lives as long as a kernel would; this one is done
        try:
            os.killpg(kernel.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        live = live_processes()
        for pid, proc in seen.items():  # a failed test leaves no gang running
            if pid in live and live[pid].start == proc.start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        log.close()
