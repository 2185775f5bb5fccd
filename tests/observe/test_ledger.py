"""The goodput and cost ledger over constructed records: each cause, restarts with lost work,
a run with and without a price, the stored ledger.json and its sums."""

import json

import pytest

from stoker.config import ConfigError, load_config
from stoker.launch.attempts import summarize
from stoker.observe.ledger import (
    CAUSES,
    FlowTimes,
    compute_ledger,
    deployment_ledgers,
    ledger_rows,
    parse_records,
    run_ledgers,
    store_ledger,
    sum_ledgers,
)
from stoker.storage.store import Store


def train(step, since, until, since_step=None, eval_s=0.0, ckpt_s=0.0, wait=0.0):
    return {
        "event": "train",
        "step": step,
        "time": until,
        "since": since,
        "since_step": step - 1 if since_step is None else since_step,
        "eval_seconds": eval_s,
        "checkpoint_seconds": ckpt_s,
        "data_wait_share": wait,
        "loss": 1.0,
    }


def done(step, since, until, eval_s=0.0, ckpt_s=0.0):
    return {
        "event": "done",
        "step": step,
        "time": until,
        "since": since,
        "since_step": step,
        "eval_seconds": eval_s,
        "checkpoint_seconds": ckpt_s,
    }


def attempt(n, started, ended, resumed=0, reached=0, committed=0, outcome="completed", gang_ended=None, flow="f1"):
    return {
        "flow_run_id": flow,
        "attempt": n,
        "started_at": started,
        "ended_at": ended,
        "gang_ended_at": ended if gang_ended is None else gang_ended,
        "resumed_from_step": resumed,
        "reached_step": reached,
        "committed_step": committed,
        "outcome": outcome,
        "median_step_seconds": 1.0,
    }


def assert_adds_up(ledger):
    assert sum(ledger["seconds"].values()) == pytest.approx(ledger["wall_seconds"], abs=1e-3)
    assert sum(ledger["share"].values()) == pytest.approx(1.0, abs=1e-4)


def test_every_cause_is_attributed_from_the_records_and_the_flow_runs_times():
    records = [
        {"event": "eval", "step": 0, "time": 124.0, "seconds": 2.0, "val_loss": 5.0},  # before the loop
        train(1, 125, 127, wait=0.25),  # 2 s: 0.5 waiting for data, 1.5 computing
        train(2, 127, 131, eval_s=1.0, ckpt_s=1.0, wait=0.5),  # 4 s: eval 1, ckpt 1, wait 0.5 x 3
        done(2, 131, 133, eval_s=0.5, ckpt_s=1.0),  # the last eval and commit; 0.5 s of the loop's end
        {"event": "checkpoint", "step": 2, "time": 132.0},  # not read
    ]
    times = FlowTimes(expected_start=100, start=110, closing_start=140, end=141, evaluation_seconds=4.0)
    ledger = compute_ledger(records, [attempt(1, 120, 135, reached=2, committed=2, gang_ended=134)], times)
    assert ledger["wall_seconds"] == 41.0 and not ledger["launches_only"]
    assert ledger["seconds"] == {
        "queueing": 10.0,  # due at 100, started at 110
        "startup": 13.0,  # flow's tasks 110 -> 120, the process 120 -> 125 less the step-0 evaluation
        "productive": 2.0,
        "data_wait": 2.0,
        "checkpoint": 2.0,
        "evaluation": 8.5,  # step 0 (2), in the loop (1 + 0.5), per-checkpoint wait (1), final (4)
        "restart": 0.0,
        "shutdown": 3.5,  # the loop's end 0.5, the processes' 1, before the report 1, the report 1
        "unattributed": 0.0,
    }
    assert ledger["goodput"] == pytest.approx(2 / 41, abs=1e-6)
    assert ledger["lost_steps"] == 0 and ledger["cost"] is None and ledger["cost_total"] is None
    assert_adds_up(ledger)


def test_a_failed_launch_is_restart_and_its_steps_past_the_resumed_checkpoint_are_lost_work():
    first = [train(s, 4 + s, 5 + s) for s in range(1, 5)]  # steps 1-4 at 1 s each, 5 -> 9
    first += [train(5, 9, 10, ckpt_s=0.2), train(6, 10, 11, ckpt_s=0.5)]  # the save of step 4, then 5
    second = [{"event": "resumed", "step": 4, "time": 23.0, "checkpoint": "c"}]
    second += [train(s, 23 + s - 5, 24 + s - 5) for s in range(5, 9)]  # steps 5-8: 23 -> 27
    second += [done(8, 27, 28, ckpt_s=1.0)]
    attempts = [
        attempt(1, 0, 15, reached=6, committed=4, outcome="lost-rank"),  # killed at 11, reaped at 15
        attempt(2, 20, 29, resumed=4, reached=8, committed=8),
    ]
    ledger = compute_ledger(parse_records(json.dumps(r) for r in first + second), attempts)
    assert ledger["launches_only"] and ledger["wall_seconds"] == 29.0
    s = ledger["seconds"]
    assert s["startup"] == 5.0  # the first launch, 0 -> 5
    # steps 1-4 and 5-8 once each; step 5 (0.8 s, its checkpoint kept: the one resumed from)
    # and step 6 (1 s, with the save of step 5, never committed) done in vain
    assert s["productive"] == pytest.approx(8.0)
    assert s["checkpoint"] == pytest.approx(1.2)
    assert ledger["lost_seconds"] == pytest.approx(1.8) and ledger["lost_steps"] == 2
    # lost work 1.8 + killed -> reaped 4 + between launches 5 + the next start 3
    assert s["restart"] == pytest.approx(13.8)
    assert s["shutdown"] == pytest.approx(1.0) and s["unattributed"] == pytest.approx(0.0, abs=1e-9)
    assert_adds_up(ledger)
    # the launches' own summary counts the same steps lost
    assert summarize([dict(a) for a in attempts], 8)["steps_lost"] == ledger["lost_steps"]


def test_a_flow_run_that_ends_failed_loses_what_it_did_past_its_last_commit():
    records = [train(s, 2 + s, 3 + s) for s in range(1, 7)]  # steps 1-6, 3 -> 9
    ledger = compute_ledger(
        records, [attempt(1, 0, 12, reached=6, committed=4, outcome="interrupted (KeyboardInterrupt)")]
    )
    assert ledger["lost_steps"] == 2 and ledger["seconds"]["productive"] == pytest.approx(4.0)
    assert ledger["seconds"]["restart"] == pytest.approx(2.0 + 3.0)  # steps 5-6, then 9 -> 12
    assert_adds_up(ledger)


def test_an_in_place_restart_inside_one_launch_is_restart():
    records = [train(1, 1, 2), train(2, 2, 3)]  # killed after step 2, no checkpoint
    records += [{"event": "resumed", "step": 0, "time": 6.0, "checkpoint": "none"}]
    records += [{"event": "eval", "step": 0, "time": 7.0, "seconds": 1.0}, train(1, 7, 8), train(2, 8, 9)]
    records += [done(2, 9, 9.5)]
    ledger = compute_ledger(records, [attempt(1, 0, 10, reached=2, committed=2)])
    s = ledger["seconds"]
    assert s["productive"] == pytest.approx(2.0) and ledger["lost_steps"] == 2
    assert s["restart"] == pytest.approx(2.0 + 3.0)  # the two lost steps, then 3 -> 7 less the eval
    assert s["evaluation"] == pytest.approx(1.0) and s["startup"] == pytest.approx(1.0)
    assert_adds_up(ledger)


def test_cost_is_seconds_times_accelerators_times_price_and_queueing_is_not_priced():
    records = [train(1, 1, 3), done(1, 3, 4, ckpt_s=1.0)]
    times = FlowTimes(expected_start=-3600, start=0, end=5)
    priced = compute_ledger(records, [attempt(1, 0, 5)], times, accelerators=4, price_per_accelerator_hour=2.0)
    rate = 4 * 2.0 / 3600
    assert priced["cost"]["productive"] == pytest.approx(2 * rate)
    assert priced["cost"]["checkpoint"] == pytest.approx(1 * rate)
    assert priced["seconds"]["queueing"] == 3600 and priced["cost"]["queueing"] == 0.0
    assert priced["cost_total"] == pytest.approx(5 * rate)  # the 5 s after the start
    assert {r["cause"]: r["cost"] for r in ledger_rows(priced)}["total (wall-clock)"] == pytest.approx(5 * rate, 1e-3)
    for price in (None, 0.0):  # no price: no cost anywhere
        free = compute_ledger(records, [attempt(1, 0, 5)], times, accelerators=4, price_per_accelerator_hour=price)
        assert free["cost"] is None and free["cost_total"] is None
        assert all(r["cost"] is None for r in ledger_rows(free))
        assert free["seconds"] == priced["seconds"]


def test_a_launchs_wait_for_an_accelerator_slot_is_queueing_not_start_up_or_restart_and_unpriced():
    """launch_training records how long each launch waited for its slot of
    launch.concurrency_limit (slot_wait_seconds, just before started_at)."""
    first = [train(s, 24 + s, 25 + s) for s in range(1, 3)]  # steps 1-2, 25 -> 27
    second = [{"event": "resumed", "step": 2, "time": 55.0, "checkpoint": "c"}, train(3, 55, 56), done(3, 56, 57)]
    attempts = [
        {**attempt(1, 20, 30, reached=2, committed=2, outcome="lost-rank"), "slot_wait_seconds": 8.0},
        {**attempt(2, 50, 58, resumed=2, reached=3, committed=3), "slot_wait_seconds": 15.0},
    ]
    times = FlowTimes(expected_start=0, start=2, closing_start=58, end=60)
    ledger = compute_ledger(first + second, attempts, times, accelerators=2, price_per_accelerator_hour=36.0)
    s = ledger["seconds"]
    # due 0 -> started 2; the first launch waited 12 -> 20, the second 35 -> 50
    assert s["queueing"] == pytest.approx(2 + 8 + 15)
    assert s["startup"] == pytest.approx(10 + 5)  # 2 -> 12 (the flow's tasks), 20 -> 25 (the process)
    assert s["restart"] == pytest.approx(3 + 5 + 5)  # 27 -> 30, 30 -> 35, 50 -> 55
    assert ledger["cost"]["queueing"] == 0.0
    assert ledger["cost_total"] == pytest.approx((60 - 25) * 2 * 36.0 / 3600)
    assert_adds_up(ledger)
    # a wait longer than the room before the launch counts only that room
    clipped = compute_ledger([], [{**attempt(1, 5, 6), "slot_wait_seconds": 99.0}], FlowTimes(start=0, end=6))
    assert clipped["seconds"]["queueing"] == 5 and clipped["seconds"]["startup"] == 1  # the launch, no step
    # without the flow run's times (no report), the ledger begins where the first launch asked
    launches_only = compute_ledger(first + second, attempts)
    assert launches_only["from"] == 12 and launches_only["seconds"]["queueing"] == pytest.approx(8 + 15)
    assert launches_only["seconds"]["startup"] == pytest.approx(5)
    assert_adds_up(launches_only)


def test_nothing_to_train_is_start_up_evaluation_and_wind_down():
    times = FlowTimes(expected_start=0, start=0, closing_start=10, end=11, evaluation_seconds=6)
    ledger = compute_ledger([], [], times)
    assert ledger["seconds"]["startup"] == 4 and ledger["seconds"]["evaluation"] == 6
    assert ledger["seconds"]["shutdown"] == 1 and ledger["goodput"] == 0.0
    assert_adds_up(ledger)


def test_ledger_json_keeps_one_entry_per_flow_run_and_sums_per_run_and_deployment(tmp_path):
    store = Store("file://" + str(tmp_path))
    records = [train(1, 1, 3), done(1, 3, 4)]
    times = FlowTimes(start=0, end=5)
    one = compute_ledger(records, [attempt(1, 0, 5)], times, flow_run_id="f1", deployment="nightly")
    store_ledger(store, "a", one)
    store_ledger(store, "a", one)  # a report run again replaces its flow run's entry
    store.write_bytes("runs/a/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
    # a later flow run that failed (no report): computed from the records, priced from config.json
    store.write_bytes("runs/a/config.json", load_config({"cost": {"per_accelerator_hour": 3.6}}).to_json().encode())
    later = [attempt(1, 100, 110, outcome="lost-rank", flow="f2")]
    store.write_bytes(
        "runs/a/attempts.jsonl", "".join(json.dumps(a) + "\n" for a in [attempt(1, 0, 5)] + later).encode()
    )
    ledgers = run_ledgers(store, "a")
    assert [(x["flow_run_id"], x["launches_only"]) for x in ledgers] == [("f1", False), ("f2", True)]
    assert ledgers[1]["seconds"]["restart"] == 10 and ledgers[1]["cost_total"] == pytest.approx(10 * 2 * 3.6 / 3600)
    total = sum_ledgers(ledgers)
    assert total["wall_seconds"] == 15 and total["num_flow_runs"] == 2 and total["num_priced"] == 1
    assert total["goodput"] == pytest.approx(2 / 15, abs=1e-6)
    store_ledger(store, "b", compute_ledger(records, [attempt(1, 0, 5)], times, flow_run_id="f3", deployment="nightly"))
    nightly = deployment_ledgers(store)["nightly"]
    assert nightly["runs"] == ["a", "b"] and nightly["num_flow_runs"] == 2 and nightly["wall_seconds"] == 10
    assert set(nightly["seconds"]) == set(CAUSES)


def test_a_negative_price_is_one_clear_error_naming_the_field():
    with pytest.raises(ConfigError) as err:
        load_config({"cost": {"per_accelerator_hour": -1}})
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith("cost.per_accelerator_hour")
    assert "hourly price" in str(err.value)
    assert load_config({"cost": {"per_accelerator_hour": 2.5}}).identity_hash() == load_config({}).identity_hash()
