"""The cache's locks (stoker/orchestration/cache_lock.py): leases in the store that Prefect's
SERIALIZABLE transactions take, so one key is computed once across processes. The Prefect
side (two evaluations of one checkpoint at once) is in tests/tasks/test_caching.py."""

import json
import subprocess
import sys
import time

import pytest

from stoker.orchestration.cache_lock import StoreLockManager, lock_key
from stoker.storage.store import Store
from tests.conftest import ROOT

KEY = "evaluate_checkpoint/abc123"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_held_lock_keeps_others_out_until_released_and_a_holder_may_take_it_again(tmp_path, where, request):
    root, options = ("file://" + str(tmp_path), {}) if where == "local" else request.getfixturevalue("s3_root")
    store = Store(root, options)  # a local disk, or S3's conditional writes
    locks = StoreLockManager(store, poll=0.05)
    assert not locks.is_locked(KEY)
    assert locks.acquire_lock(KEY, "first")
    assert locks.is_locked(KEY) and locks.is_lock_holder(KEY, "first") and not locks.is_lock_holder(KEY, "second")
    assert locks.acquire_lock(KEY, "first", acquire_timeout=0)  # its own: at once
    t0 = time.monotonic()
    assert not locks.acquire_lock(KEY, "second", acquire_timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    assert not locks.wait_for_lock(KEY, timeout=0.1)
    locks.release_lock(KEY, "second")  # not its lock: nothing happens
    assert locks.is_lock_holder(KEY, "first")
    locks.release_lock(KEY, "first")
    assert not locks.is_locked(KEY) and locks.wait_for_lock(KEY, timeout=0)
    assert locks.acquire_lock(KEY, "second", acquire_timeout=0)
    locks.release_lock(KEY, "second")
    assert not store.exists(lock_key(KEY))


def test_a_dead_holders_lock_expires_and_a_live_holder_keeps_renewing_its_own(tmp_path):
    store = Store("file://" + str(tmp_path))
    dead = {"holder": "gone", "token": "t", "host": "elsewhere", "pid": 1, "expires_at": time.time() - 1}
    store.write_bytes(lock_key(KEY), json.dumps(dead).encode())
    locks = StoreLockManager(store, ttl=3.0, poll=0.05)
    assert not locks.is_locked(KEY)
    assert locks.acquire_lock(KEY, "next", acquire_timeout=0)  # no wait for a holder that died
    time.sleep(4.5)  # past its first expiry: renewed every ttl / 3
    assert locks.is_lock_holder(KEY, "next")
    assert not locks.acquire_lock(KEY, "other", acquire_timeout=0)
    locks.release_lock(KEY, "next")
    # a hold_timeout ends the lock then, renewed or not
    assert locks.acquire_lock(KEY, "brief", hold_timeout=0.5)
    assert locks.acquire_lock(KEY, "after", acquire_timeout=10)
    assert locks.is_lock_holder(KEY, "after")
    locks.release_lock(KEY, "after")


HOLD = """
import sys, time
from stoker.storage.store import Store
from stoker.orchestration.cache_lock import StoreLockManager
locks = StoreLockManager(Store(sys.argv[1]), poll=0.05)
assert locks.acquire_lock(sys.argv[2], "other-process", acquire_timeout=0)
print("held", flush=True)
time.sleep(2.0)
locks.release_lock(sys.argv[2], "other-process")
"""


def test_the_lock_holds_across_processes(tmp_path):
    root = "file://" + str(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", HOLD, root, KEY], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        locks = StoreLockManager(Store(root), poll=0.05)
        assert locks.is_locked(KEY) and not locks.is_lock_holder(KEY, "here")
        t0 = time.monotonic()
        assert locks.acquire_lock(KEY, "here", acquire_timeout=60)  # waits for the other's release
        assert time.monotonic() - t0 >= 1.0
        locks.release_lock(KEY, "here")
    finally:
        assert other.wait(60) == 0


HOLD_UNTIL_KILLED = """
import sys, time
from stoker.storage.store import Store
from stoker.orchestration.cache_lock import StoreLockManager
locks = StoreLockManager(Store(sys.argv[1]), poll=0.05)  # the default ttl: 60 s
assert locks.acquire_lock(sys.argv[2], "killed-process", acquire_timeout=0)
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_of_a_process_killed_outright_is_free_at_once_on_its_host(tmp_path):
    """A flow process SIGKILLed while it held an evaluation's lock: the next task run on this
    host takes the lock at once (its recorded lifeline token names a process that is gone),
    not after the lock's 60 s expiry."""
    root = "file://" + str(tmp_path)
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD_UNTIL_KILLED, root, KEY], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "held"
        locks = StoreLockManager(Store(root), poll=0.05)
        assert locks.is_locked(KEY) and not locks.acquire_lock(KEY, "here", acquire_timeout=0)
        held = json.loads(Store(root).read_bytes(lock_key(KEY)))
        assert held["pid"] == other.pid and held["expires_at"] > time.time() + 30
    finally:
        other.kill()
        other.wait()
    assert not locks.is_locked(KEY) and locks.wait_for_lock(KEY, timeout=0)
    assert locks.acquire_lock(KEY, "here", acquire_timeout=0)
    assert locks.is_lock_holder(KEY, "here")
    locks.release_lock(KEY, "here")


def test_a_lock_whose_holder_this_host_cannot_see_holds_until_it_expires(tmp_path):
    """A holder of another machine or pid namespace: its pid says nothing here."""
    store = Store("file://" + str(tmp_path))
    elsewhere = {
        "holder": "there",
        "token": "t",
        "host": "elsewhere",
        "pid": 1,
        "expires_at": time.time() + 1.5,
        "process": "another-boot/pid:[4026531836]/1/5",
    }
    # (with a field this version does not know: ignored, not taken for a damaged lock)
    store.write_bytes(lock_key(KEY), json.dumps({**elsewhere, "added_later": 1}).encode())
    locks = StoreLockManager(store, poll=0.05)
    assert locks.is_locked(KEY) and not locks.acquire_lock(KEY, "here", acquire_timeout=0)
    assert locks.acquire_lock(KEY, "here", acquire_timeout=30)  # once it expired
    locks.release_lock(KEY, "here")
