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
