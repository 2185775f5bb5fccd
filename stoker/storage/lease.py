"""The run lease: one writer per run. ``{root}/runs/{run}/lease.json`` names the launch that
trains the run (owner, host, pid, flow run, since when) and until when its heartbeat holds it.

Taken with a conditional write where the store has one (a local disk: a hard link, then
replace-if-unchanged under a folder lock; S3: ``If-None-Match: *``, then ``If-Match`` on the
ETag), and always read back after writing (on other stores, after a settle wait: the only
guard there). A second launch of the run refuses with ``LeaseHeld`` (permanent, one line).

Who may take a held lease:
- its own owner again (the same flow run: a retry of the training task, a restarted flow run);
- anyone once it expired (no heartbeat for ``ttl`` seconds: its owner died or lost the store);
- anyone when its owner is a process of this host that is gone (no wait for the expiry);
- anyone who forces it (``--takeover`` / ``launch.takeover``): the old owner finds the lease
  gone at its next heartbeat and stops its training (``LeaseLost``, permanent).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields
from typing import Callable

from stoker.failures import StokerError
from stoker.process import lifeline
from stoker.storage.layout import LEASE_FILE, run_file_key
from stoker.storage.store import Store

SETTLE_SECONDS = 2.0  # verify-after-write wait, on stores without conditional writes


class LeaseHeld(StokerError):
    """Another launch holds the run's lease: this one must not train. Never retried."""


class LeaseLost(StokerError):
    """This launch's lease was taken by another launch: its training must stop. Never retried."""


@dataclass(frozen=True)
class LeaseRecord:
    """The content of lease.json."""

    run_name: str
    owner: str  # the flow run id, or a uuid outside a flow run: who may re-take it
    token: str  # one per take: tells this take from any other, the owner's earlier ones too
    host: str
    pid: int
    flow_run_id: str
    acquired_at: float
    heartbeat_at: float
    expires_at: float
    process: str = ""  # the owner process's process.lifeline token ("" in leases written before it)

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.acquired_at))
        left = self.expires_at - now
        expiry = f"expires in {left:.0f}s" if left > 0 else f"expired {-left:.0f}s ago"
        return (
            f"host {self.host}, pid {self.pid}, flow run {self.flow_run_id or '-'}, since {since}; "
            f"heartbeat {now - self.heartbeat_at:.0f}s ago, {expiry}"
        )


def lease_key(run_name: str) -> str:
    return run_file_key(run_name, LEASE_FILE)


# ---- the lease primitive: what the run lease and the result cache's locks share -------------
# A record (a JSON dataclass carrying a `token`, one per take) at a key: taken with `claim`,
# read with `read_record` (damage reads as expired), renewed by a `Renewal` thread, and free
# early when `holder_gone` (its process is known gone on this host).
def read_record(store: Store, key: str, record_type: type, damaged: Callable[[], object]) -> tuple:
    """(the record, its version) at `key`, or (None, None) when none is there. A damaged file
    reads as `damaged()` (an expired record, so it can be replaced); fields this version does
    not know (a newer stoker's) are ignored, not taken for damage."""
    found = store.read_versioned(key)
    if found is None:
        return None, None
    data, version = found
    try:
        return record_type(**known_fields(record_type, json.loads(data))), version
    except (ValueError, TypeError, AttributeError):
        return damaged(), version


def encode(record) -> bytes:
    """A record's bytes in the store (sorted JSON)."""
    return json.dumps(asdict(record), indent=2, sort_keys=True).encode()


def holder_gone(process: str, host: str, pid: int) -> bool:
    """The holder is a process of this host that no longer exists: told by its lifeline token
    (kernel, pid namespace, pid and start time: a reused pid or a process of another container
    with the same host name is not taken for the holder); a record without one, by its pid."""
    if process:
        return lifeline.token_gone(process)
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


class Renewal:
    """A daemon thread that calls `renew()` every `interval` seconds until stopped or until it
    returns False (the record is no longer this holder's). A store error is passed to `log` and
    tried again at the next round: the record lasts its ttl meanwhile."""

    def __init__(self, name: str, interval: float, renew: Callable[[], bool], log: Callable[[str], None] | None = None):
        self.stopped = threading.Event()

        def loop() -> None:
            while not self.stopped.wait(interval):
                try:
                    if not renew():
                        return
                except Exception as err:  # transient: the next round tries again
                    if log is not None:
                        log(f"{name}: renewal failed: {err!r}")

        self.thread = threading.Thread(target=loop, name=name, daemon=True)
        self.thread.start()

    def stop(self, join_seconds: float | None = None) -> None:
        self.stopped.set()
        if join_seconds is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=join_seconds)


# ---- the run lease ---------------------------------------------------------------------------
def read_lease(store: Store, run_name: str) -> tuple[LeaseRecord, str] | tuple[None, None]:
    """(the lease, its version) or (None, None) when nobody holds the run; a damaged file is an
    expired lease (read_record)."""
    return read_record(
        store,
        lease_key(run_name),
        LeaseRecord,
        lambda: LeaseRecord(run_name, "?", "?", "?", 0, "", 0.0, 0.0, 0.0),
    )


def _owner_is_gone(record: LeaseRecord) -> bool:
    return holder_gone(record.process, record.host, record.pid)


def why_takeable(record: LeaseRecord, owner: str, takeover: bool, now: float) -> str:
    """'' when `owner` must not take the lease `record`; else why it may."""
    if record.owner == owner:
        return "its own lease (an earlier attempt of this flow run)"
    if record.expires_at <= now:
        return "expired"
    if _owner_is_gone(record):
        return "its owner process is gone"
    if takeover:
        return "takeover forced"
    return ""


def held_message(record: LeaseRecord, run_name: str) -> str:
    return (
        f"run {run_name!r} is already being trained by another launch ({record.describe()}); "
        "wait for it to end, use another run_name, or take the run over with --takeover "
        "(CLI) / launch.takeover=true (config), which stops the other launch at its next "
        "heartbeat (an expired lease is taken without it)"
    )


class RunLease:
    """A lease this process holds; renew it (``heartbeat``), release it at the end."""

    def __init__(self, store: Store, record: LeaseRecord, version: str, ttl: float):
        self.store, self.record, self.version, self.ttl = store, record, version, ttl
        self.lost = ""  # why, once another launch took the lease
        self._renewal: Renewal | None = None

    @property
    def key(self) -> str:
        return lease_key(self.record.run_name)

    def renew(self) -> bool:
        """Push the expiry out; False (and `lost` set) when another launch took the lease."""
        if self.lost:
            return False
        now = time.time()
        record = LeaseRecord(**{**asdict(self.record), "heartbeat_at": now, "expires_at": now + self.ttl})
        if self.store.write_bytes_if_version(self.key, encode(record), self.version):
            found = self.store.read_versioned(self.key)
            if found is not None and _token(found[0]) == record.token:
                self.record, self.version = record, found[1]
                return True
        current, _ = read_lease(self.store, self.record.run_name)
        if current is not None and current.token == self.record.token:  # ours, version moved on
            return False
        self.lost = (
            "the run's lease was taken by another launch (" + (current.describe() if current else "removed") + ")"
        )
        return False

    def check(self) -> None:
        """Raise LeaseLost when another launch took the lease."""
        if self.lost:
            raise LeaseLost(f"run {self.record.run_name!r}: {self.lost}; this launch stopped")

    def start_heartbeat(
        self, on_lost: Callable[[str], None] | None = None, log: Callable[[str], None] | None = None
    ) -> None:
        """Renew every ttl/3 seconds in a daemon thread (Renewal); call on_lost(reason) once if
        lost. A store error is logged and retried at the next beat: the lease lasts ttl seconds."""

        def beat() -> bool:
            if self.renew() or not self.lost:
                return True  # renewed, or the version moved on under this take: beat again
            if on_lost is not None:
                on_lost(self.lost)
            return False

        self._renewal = Renewal(f"lease heartbeat of run {self.record.run_name!r}", max(0.5, self.ttl / 3), beat, log)

    def stop_heartbeat(self) -> None:
        if self._renewal is not None:
            self._renewal.stop()

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still this take's."""
        if self._renewal is not None:
            self._renewal.stop(join_seconds=30)
        current, _ = read_lease(self.store, self.record.run_name)
        if current is not None and current.token == self.record.token:
            self.store.rm(self.key, recursive=False)


def known_fields(record_type: type, raw: dict) -> dict:
    """The entries of `raw` that are fields of the dataclass `record_type`: a record written by
    a newer version, with fields added, still reads (its missing ones take their defaults)."""
    names = {f.name for f in fields(record_type)}
    return {k: v for k, v in raw.items() if k in names}


def _token(data: bytes) -> str:
    try:
        return str(json.loads(data).get("token", ""))
    except (ValueError, AttributeError):
        return ""


def claim(
    store: Store, key: str, data: bytes, token: str, version: str | None, settle_seconds: float = SETTLE_SECONDS
) -> str | None:
    """Write `data` (a JSON record carrying `token`) at `key` only if nothing is there
    (`version` None) or it is unchanged since `version`, then read it back (on a store without
    conditional writes, after `settle_seconds`: a racing plain write lands within them). The
    version now there when the read-back carries `token` (this writer holds `key`), else None.
    The run lease and the evaluation locks (orchestration.cache_lock) are taken with it."""
    if version is None:
        written = store.write_bytes_if_absent(key, data)
    else:
        written = store.write_bytes_if_version(key, data, version)
    if not written:
        return None
    if not store.conditional_writes:
        time.sleep(settle_seconds)
    found = store.read_versioned(key)
    return found[1] if found is not None and _token(found[0]) == token else None


def acquire_lease(
    store: Store,
    run_name: str,
    *,
    owner: str = "",
    flow_run_id: str = "",
    ttl: float = 90.0,
    takeover: bool = False,
    settle_seconds: float = SETTLE_SECONDS,
) -> RunLease:
    """Take the run's lease, or raise LeaseHeld naming its holder. `owner`: who may re-take it
    (the flow run id; a fresh uuid when empty). Among racing launches exactly one wins: the
    conditional write refuses the others, who then find the winner's lease and refuse."""
    owner = owner or flow_run_id or uuid.uuid4().hex
    key = lease_key(run_name)
    for _ in range(5):
        now = time.time()
        record = LeaseRecord(
            run_name,
            owner,
            uuid.uuid4().hex,
            socket.gethostname(),
            os.getpid(),
            flow_run_id,
            now,
            now,
            now + ttl,
            lifeline.token(),
        )
        current, version = read_lease(store, run_name)
        if current is not None and not why_takeable(current, owner, takeover, now):
            raise LeaseHeld(held_message(current, run_name))
        held = claim(store, key, encode(record), record.token, version, settle_seconds)
        if held is not None:
            return RunLease(store, record, held, ttl)
        # another launch wrote first: look again at what it wrote
    current, _ = read_lease(store, run_name)
    if current is None:
        raise TimeoutError(f"the lease of run {run_name!r} kept changing; try again")
    raise LeaseHeld(held_message(current, run_name))
