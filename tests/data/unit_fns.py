"""Units for tests/data/test_units.py: importable by the worker processes (python -m
stoker.data.units runs in the repository root)."""

from __future__ import annotations

import os
import time

from stoker.failures import DataError


def square(store, *, k: int, out: str, die_once: bool = False, hang: int = 0) -> dict:
    """k * k into the store at `out`; counts its runs in `out`.runs. With die_once, the first
    run's worker process dies midway (a lost worker, as a node lost or killed would be); its
    first `hang` runs block for good (a read that never returns)."""
    runs = store.read_json(out + ".runs") if store.exists(out + ".runs") else 0
    store.write_json(out + ".runs", runs + 1)
    if die_once and runs == 0:
        os._exit(9)
    if runs < hang:
        time.sleep(3600)
    if store.exists(out):
        return {"docs": 0, "cached": True, "value": store.read_json(out)}
    store.write_json(out, k * k)
    return {"docs": 1, "cached": False, "value": k * k}


def bad_data(store, *, k: int) -> dict:
    raise DataError(f"data.source: document {k} is not text; fix the source.")


def store_down(store, *, out: str) -> dict:
    """A unit whose store cannot be reached: counts its runs, then fails as s3fs does."""
    runs = store.read_json(out) if store.exists(out) else 0
    store.write_json(out, runs + 1)
    raise OSError(f"[Errno 111] Connection refused: http://127.0.0.1:9/bucket/{out}\n(while reading a part)")
