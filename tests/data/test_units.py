"""stoker.data.units with real worker processes: results in order whatever finishes first, a
unit whose worker dies midway runs again alone (the others are not redone, their outputs stay
cached), a DataError fails the stage at once as one line, progress told per unit."""

from __future__ import annotations

import pytest

from stoker.data.units import Unit, run_units
from stoker.failures import DataError
from stoker.storage.store import Store


def _units(n: int, die: int | None = None) -> list[Unit]:
    return [
        Unit("tests.data.unit_fns:square", {"k": k, "out": f"out/{k}.json", "die_once": k == die}, f"squares {k}")
        for k in range(n)
    ]


def test_units_run_in_worker_processes_and_a_killed_one_runs_again_alone(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    seen = []
    got = run_units("squares", _units(6, die=3), store, workers=2, on_progress=lambda p: seen.append((p.done, p.docs)))
    assert [r["value"] for r in got] == [k * k for k in range(6)]
    runs = [store.read_json(f"out/{k}.json.runs") for k in range(6)]
    assert runs == [1, 1, 1, 2, 1, 1]  # only the lost unit ran twice
    assert seen[-1] == (6, 6) and [d for d, _ in seen] == list(range(1, 7))
    again = run_units("squares", _units(6), store, workers=2)  # a rerun: every output cached
    assert all(r["cached"] for r in again) and [r["value"] for r in again] == [r["value"] for r in got]


def test_a_units_data_error_is_the_same_one_line_in_a_worker_and_here(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    bad = [Unit("tests.data.unit_fns:bad_data", {"k": 4}, "reads document 4")]
    for in_process in (False, True):
        with pytest.raises(DataError, match=r"^data.source: document 4 is not text; fix the source.$"):
            run_units("bad", bad + _units(2), store, workers=2, in_process=in_process)


def test_a_hung_unit_is_killed_at_its_deadline_and_runs_again_then_fails_in_one_line(tmp_path, monkeypatch):
    from stoker.data import units

    monkeypatch.setattr(units, "UNIT_TIMEOUT_S", 1.5)
    store = Store(f"file://{tmp_path}/store")
    once = [Unit("tests.data.unit_fns:square", {"k": 5, "out": "out/5.json", "hang": 1}, "squares 5")] + _units(3)
    got = run_units("squares", once, store, workers=2)
    assert [r["value"] for r in got] == [25, 0, 1, 4] and store.read_json("out/5.json.runs") == 2
    always = [Unit("tests.data.unit_fns:square", {"k": 7, "out": "out/7.json", "hang": 9}, "squares 7")]
    with pytest.raises(
        ChildProcessError, match=r"^squares 7 failed 3 times; the last: it ran past its deadline of 2 s"
    ):
        run_units("squares", always, store, workers=1)
    assert store.read_json("out/7.json.runs") == 3


def test_a_store_unreachable_mid_stage_is_retried_then_one_line(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    down = [Unit("tests.data.unit_fns:store_down", {"out": "runs.json"}, "computes the features of 'web' part 3")]
    for in_process in (False, True):
        store.rm("runs.json")
        with pytest.raises(OSError) as err:
            run_units("features", down, store, workers=1, in_process=in_process)
        assert store.read_json("runs.json") == 3  # retried twice, then given up
        assert "\n" not in str(err.value) and "computes the features of 'web' part 3" in str(err.value), err.value
        assert "Connection refused" in str(err.value)
