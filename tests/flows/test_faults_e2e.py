"""Failures through the real flow: a killed rank is retried from the newest valid checkpoint
and ends bit for bit where an unbroken run ends; a rank that raises is not retried."""

import contextlib
import io
import json
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.config import load_config
from stoker.failures import TrainingFailed
from stoker.storage.checkpoints import list_checkpoints
from stoker.storage.store import Store
from tests.conftest import prepare_shards, tiny_dict

pytestmark = pytest.mark.e2e


def _final_tensors(store, run):
    path = store.local_path(list_checkpoints(store, run)[0].key)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def _cfg(root, name, price=None, **train):
    return load_config(
        tiny_dict(
            root,
            run_name=name,
            train={"max_steps": 8, **train},
            launch={"max_attempts": 3, "max_restarts": 0},  # the relaunch path
            eval={"per_checkpoint_enabled": False},
            cost={"per_accelerator_hour": price},
        )
    )


def test_killed_rank_is_retried_and_ends_bitwise_like_an_unbroken_run(
    prefect_server, tmp_path, monkeypatch, quick_relaunch
):
    from stoker.flows.pipeline import train_pipeline
    from stoker.storage.runs import pin_run_folder
    from tests.forked_ranks import run_forked

    root = "file://" + str(tmp_path / "store")
    # the unbroken reference: the same training without the flow (its two ranks forked from
    # warm zygotes, tests.forked_ranks: no agent, no evaluation); the flow is the killed run's
    unbroken = _cfg(root, "unbroken")
    prepared, shards = prepare_shards(unbroken)
    run_forked(pin_run_folder(prepared, unbroken, shards), shards.key, nproc=2)
    monkeypatch.setenv("STOKER_FAULT", "kill:rank=1:step=6")  # SIGKILL before step 6
    monkeypatch.setenv("STOKER_FAULT_ONCE", str(tmp_path / "fault-fired"))
    began = time.time()
    broken = train_pipeline(_cfg(root, "killed", price=3.6))
    ended = time.time()
    assert (tmp_path / "fault-fired").exists()
    assert broken.final_step == 8
    assert broken.num_attempts == 2
    first, second = broken.attempts
    assert first["outcome"] == "lost-rank" and first["reached_step"] == 5
    assert second["resumed_from_step"] == 4 and second["outcome"] == "completed"
    assert broken.steps_lost == 1 and 0 < broken.goodput < 1

    store = Store(root)  # a fresh listing: the runs wrote since the one above
    assert list_checkpoints(store, "unbroken")[0].step == 8  # the unbroken run's final step
    a, b = _final_tensors(store, "unbroken"), _final_tensors(store, "killed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) or (a[k].isnan().all() and b[k].isnan().all()), k
    losses = {}
    for run in ("unbroken", "killed"):
        rows = [json.loads(x) for x in store.read_bytes(f"runs/{run}/metrics.jsonl").splitlines()]
        losses[run] = {r["step"]: r["loss"] for r in rows if r["event"] == "train"}
    assert losses["killed"] == losses["unbroken"]  # same per-step losses, exactly
    _check_ledger(broken.ledger, (began, ended), root)


def _cli_out(*args) -> str:
    """What `stoker ARGS` prints (in this process: runs reads the store, no Prefect). Not
    capsys: Prefect's console handler would keep its stream after the test."""
    from stoker.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def _check_ledger(ledger, stopwatch, root):
    """The killed run's ledger: it spans the flow run from when the Prefect server says it was
    due to the ledger's own report (after every launch ended, before the run ended), its causes
    close the sum with little left unattributed, the killed launch shows as restart and lost
    work; it is priced (3.6 per accelerator-hour x 2 ranks); `stoker runs` shows its goodput
    and cost.

    Checked against the server's record and the launches' own times, not as a share of a
    stopwatch: the stopwatch around the call also holds the Prefect client's work before the
    flow run exists, and the record holds the report's last artifacts and the run's end after
    the ledger was taken, both longer on a loaded machine (CI, main at 3d53d43: 21.97 s
    attributed of 22.28 s recorded and of 23.46 s on the stopwatch, under the 95% the test
    asked of the stopwatch)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(ledger["flow_run_id"])
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id={"any_": [ledger["flow_run_id"]]}))
    due, end = flow_run.expected_start_time.timestamp(), flow_run.end_time.timestamp()
    began, ended = stopwatch
    launches = [json.loads(x) for x in Store(root).read_bytes("runs/killed/attempts.jsonl").splitlines()]
    last_launch_ended = max(float(a["ended_at"]) for a in launches)
    timings = {"stopwatch": stopwatch, "due": due, "end": end, "last launch ended": last_launch_ended, "ledger": ledger}
    assert began <= due < end <= ended, timings  # the server's record of the run, inside the call
    assert ledger["from"] == pytest.approx(due, abs=1e-3), timings  # from when the run was due
    assert last_launch_ended < ledger["to"] <= end, timings  # to its report, after every launch
    s = ledger["seconds"]
    assert sum(s.values()) == pytest.approx(ledger["wall_seconds"], abs=1e-3)
    assert ledger["wall_seconds"] == pytest.approx(ledger["to"] - ledger["from"], abs=1e-3), timings
    assert abs(s["unattributed"]) < 0.01 * ledger["wall_seconds"], ledger
    assert min(s["productive"], s["startup"], s["evaluation"], s["checkpoint"], s["restart"]) > 0, ledger
    assert ledger["lost_steps"] == 1 and 0 < ledger["lost_seconds"] < s["restart"], ledger
    assert 0 < ledger["goodput"] < 1 and ledger["num_attempts"] == 2
    assert ledger["cost_total"] == pytest.approx((ledger["wall_seconds"] - s["queueing"]) * 2 * 3.6 / 3600, rel=1e-3)
    assert Store(root).exists("runs/killed/ledger.json")
    table = next(a for a in artifacts if (a.key or "").startswith("killed-ledger-"))
    assert table.type == "table" and "restart and lost work" in str(table.data)
    report = next(a for a in artifacts if (a.key or "").startswith("killed-report-"))
    assert "## Where the time went" in report.data and "cost.per_accelerator_hour=3.6" in report.data
    table = _cli_out("runs", "--root", root).splitlines()
    header, row = table[0].split(), next(line for line in table if line.startswith("killed "))
    assert "goodput" in header and "cost" in header
    assert str(round(ledger["goodput"], 3)) in row and str(round(ledger["cost_total"], 2)) in row
    detail = _cli_out("runs", "--root", root, "--ledger", "killed")
    assert "restart and lost work" in detail and "productive steps" in detail and "1 step(s) lost" in detail


def test_a_rank_that_raises_is_not_retried(prefect_server, tmp_path, monkeypatch):
    from stoker.flows.pipeline import train_pipeline

    root = "file://" + str(tmp_path / "store")
    monkeypatch.setenv("STOKER_FAULT", "raise:rank=0:step=2")
    with pytest.raises(TrainingFailed, match="RuntimeError.*injected fault") as err:
        train_pipeline(_cfg(root, "buggy"))
    assert not err.value.transient
    rows = [json.loads(x) for x in Store(root).read_bytes("runs/buggy/attempts.jsonl").splitlines()]
    assert len(rows) == 1 and rows[0]["outcome"] == "error"
