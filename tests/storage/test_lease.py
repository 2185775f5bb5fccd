"""The run lease (stoker/storage/lease.py) on a local folder, a real S3 endpoint (moto over HTTP)
and memory:// (no conditional writes: verify after writing)."""

import json
import subprocess
import sys
import threading
import time
import uuid

import pytest

from stoker.failures import classify
from stoker.process import lifeline
from stoker.storage.lease import LeaseHeld, acquire_lease, lease_key, read_lease
from stoker.storage.store import Store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store(str(tmp_path / "root"))
    root, options = request.getfixturevalue("s3_root")
    return Store(root, options)


def test_conditional_create_refuses_an_existing_key(store):
    assert store.write_bytes_if_absent("k.json", b"one")
    assert not store.write_bytes_if_absent("k.json", b"two")
    data, version = store.read_versioned("k.json")
    assert data == b"one"
    assert not store.write_bytes_if_version("k.json", b"three", "not-" + version)
    assert store.write_bytes_if_version("k.json", b"four", version)
    assert store.read_bytes("k.json") == b"four"
    assert not store.write_bytes_if_version("k.json", b"five", version)  # it moved on


def test_second_launch_refuses_in_one_line_naming_the_owner(store):
    first = acquire_lease(store, "r", flow_run_id="flow-1", ttl=60)
    with pytest.raises(LeaseHeld) as err:
        acquire_lease(store, "r", flow_run_id="flow-2", ttl=60)
    text = str(err.value)
    assert "\n" not in text and "flow run flow-1" in text and f"pid {first.record.pid}" in text
    assert "--takeover" in text and "launch.takeover" in text
    assert classify(err.value) == "permanent"  # never retried
    first.release()
    assert read_lease(store, "r") == (None, None)
    acquire_lease(store, "r", flow_run_id="flow-2", ttl=60).release()


def test_own_flow_run_retakes_its_lease(store):
    acquire_lease(store, "r", flow_run_id="flow-1", ttl=60)  # a crashed attempt's, never released
    again = acquire_lease(store, "r", flow_run_id="flow-1", ttl=60)
    assert read_lease(store, "r")[0].token == again.record.token


def test_stale_lease_is_taken_without_takeover(store):
    old = acquire_lease(store, "r", flow_run_id="flow-1", ttl=60)
    with pytest.raises(LeaseHeld):
        acquire_lease(store, "r", flow_run_id="flow-2", ttl=60)
    old.ttl = 1.0
    assert old.renew()  # its last heartbeat, with a short ttl: the lease lasts 1 s more
    time.sleep(max(0.0, old.record.expires_at - time.time()) + 0.5)  # no heartbeat: expired
    new = acquire_lease(store, "r", flow_run_id="flow-2", ttl=60)
    assert read_lease(store, "r")[0].flow_run_id == "flow-2"
    assert not old.renew() and "taken by another launch" in old.lost
    old.release()  # not its lease any more: left alone
    assert read_lease(store, "r")[0].token == new.record.token


def test_forced_takeover_makes_the_holder_lose_it(store):
    holder = acquire_lease(store, "r", flow_run_id="flow-1", ttl=60)
    lost = threading.Event()
    holder.ttl = 1.5  # beats every 0.5 s
    holder.start_heartbeat(on_lost=lambda why: lost.set())
    taker = acquire_lease(store, "r", flow_run_id="flow-2", ttl=60, takeover=True)
    assert lost.wait(30), "the old holder's heartbeat did not notice"
    assert "flow run flow-2" in holder.lost
    holder.release()
    assert read_lease(store, "r")[0].token == taker.record.token


def test_heartbeat_keeps_a_short_lease_alive(store):
    holder = acquire_lease(store, "r", flow_run_id="flow-1", ttl=4)
    holder.start_heartbeat()  # every 1.3 s
    try:
        time.sleep(6)  # past the first expiry: renewed meanwhile
        with pytest.raises(LeaseHeld):
            acquire_lease(store, "r", flow_run_id="flow-2", ttl=60)
    finally:
        holder.release()


def _dead_process() -> tuple[int, str]:
    """The pid and lifeline token of a process that lived and is gone."""
    child = subprocess.Popen(["sleep", "30"])
    token = lifeline.token(child.pid)
    child.kill()
    child.wait()
    return child.pid, token


def test_lease_of_a_dead_process_on_this_host_is_taken(store):
    pid, token = _dead_process()
    record = read_lease(store, "r")[0]
    assert record is None
    acquire_lease(store, "r", flow_run_id="flow-1", ttl=3600)
    data = json.loads(store.read_bytes(lease_key("r")))
    assert data["process"] == lifeline.token()  # the owner process, as lifeline names it
    store.write_bytes(lease_key("r"), json.dumps({**data, "pid": pid, "process": token}).encode())
    acquire_lease(store, "r", flow_run_id="flow-2", ttl=60)  # no wait for the hour
    # a lease written before leases named their process: its pid alone tells
    data = json.loads(store.read_bytes(lease_key("r")))
    legacy = {k: v for k, v in data.items() if k != "process"}
    store.write_bytes(lease_key("r"), json.dumps({**legacy, "owner": "old", "pid": pid}).encode())
    acquire_lease(store, "r", flow_run_id="flow-3", ttl=60)


def test_lease_of_a_process_this_host_cannot_see_waits_for_its_expiry(store):
    """Same host name, but another kernel or pid namespace (a container): a pid that is free
    here says nothing of the owner, so the lease holds until it expires."""
    pid, _ = _dead_process()
    acquire_lease(store, "r", flow_run_id="flow-1", ttl=3600)
    data = json.loads(store.read_bytes(lease_key("r")))
    elsewhere = {**data, "pid": pid, "process": f"another-boot/pid:[4026531836]/{pid}/12345"}
    store.write_bytes(lease_key("r"), json.dumps(elsewhere).encode())
    with pytest.raises(LeaseHeld, match=f"pid {pid}"):
        acquire_lease(store, "r", flow_run_id="flow-2", ttl=60)


_RACER = """
import sys, time
from stoker.storage.store import Store
from stoker.storage.lease import LeaseHeld, acquire_lease
store = Store(sys.argv[1], {opts})
print("READY", flush=True)
start = float(sys.stdin.readline())
time.sleep(max(0.0, start - time.time()))
try:
    acquire_lease(store, "r", flow_run_id=sys.argv[2], ttl=60)
    print("WON")
except LeaseHeld:
    print("HELD")
"""


@pytest.mark.parametrize("expired", [False, True])
def test_racing_processes_exactly_one_wins(store, expired):
    """Four processes take the lease at the same instant (a free one, or an expired one's):
    the conditional write lets exactly one win."""
    if expired:
        acquire_lease(store, "r", flow_run_id="flow-old", ttl=0.01)
        time.sleep(0.1)
    opts = repr(store.storage_options)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER.format(opts=opts), store.root, f"racer-{i}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=__import__("tests.conftest").conftest.ROOT,
        )
        for i in range(4)
    ]
    try:
        # every racer imported and waiting (however long that took on a loaded machine);
        # then one start instant for all, a moment ahead
        assert [p.stdout.readline().strip() for p in procs] == ["READY"] * 4
        start = f"{time.time() + 0.5}\n"
        for p in procs:
            p.stdin.write(start)
            p.stdin.flush()
        outs = [p.communicate(timeout=180)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(outs) == ["HELD", "HELD", "HELD", "WON"], outs
    winner = read_lease(store, "r")[0].flow_run_id
    assert outs[int(winner.split("-")[1])] == "WON"


def test_threads_race_on_a_store_without_conditional_writes():
    """memory://: no conditional write; verify-after-write still lets exactly one win."""
    store = Store(f"memory://lease-{uuid.uuid4().hex[:8]}")
    assert not store.conditional_writes
    results, barrier = [], threading.Barrier(4)

    def race(i):
        barrier.wait()
        try:
            acquire_lease(store, "r", flow_run_id=f"t{i}", ttl=60, settle_seconds=0.5)
            results.append("WON")
        except LeaseHeld:
            results.append("HELD")

    threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == ["HELD", "HELD", "HELD", "WON"], results


def test_a_lease_written_by_a_newer_stoker_with_more_fields_still_holds(store):
    """A field this version does not know is ignored, not taken for a damaged (expired) lease
    that anyone may replace."""
    acquire_lease(store, "r", flow_run_id="flow-1", ttl=3600)
    data = json.loads(store.read_bytes(lease_key("r")))
    store.write_bytes(lease_key("r"), json.dumps({**data, "added_later": {"x": 1}}).encode())
    assert read_lease(store, "r")[0].owner == "flow-1"
    with pytest.raises(LeaseHeld, match="flow run flow-1"):
        acquire_lease(store, "r", flow_run_id="flow-2", ttl=60)
