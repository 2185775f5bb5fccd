"""A Prefect lock manager whose locks are leases in the object store, so a cached task with
``isolation_level="SERIALIZABLE"`` computes one key once across every process and host that
shares the store: the second caller waits for the first one's lock, then finds its record
(its task run shows Cached).

Prefect's transaction takes the lock on the task's cache key before it looks for the record
(``Transaction.begin``) and releases it after writing the record (or on failure). Its own lock
managers are a process's memory or a local folder; this one keeps
``{root}/prefect-results/.locks/{task}/{key}`` in the task run's own store (its StorageConfig
parameter, as ``orchestration.caching.StoreResults``), a lease on the same primitive as the run
lease (``storage.lease``: ``claim``, a create-only write or a replace-if-unchanged of an expired
one, read back after writing; ``read_record``, damage reads as expired; ``holder_gone``;
``Renewal``, every ``ttl / 3`` seconds from a thread of its own). What is its own: Prefect's
LockManager protocol, the holder and hold_timeout of a transaction, waiting for a lock. A lock
whose holder process is gone is free at once where that can be told (on its host: the
``process.lifeline`` token it records, as the run lease does), so a rerun on the host of a killed
flow process does not wait; elsewhere it expires ``ttl`` seconds after its last renewal.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from prefect.locking.protocol import LockManager

from stoker.orchestration.run_logger import run_logger
from stoker.process import lifeline
from stoker.storage.lease import Renewal, claim, encode, holder_gone, read_record
from stoker.storage.store import Store, join

LOCKS_DIR = "prefect-results/.locks"  # beside orchestration.caching's records
TTL_SECONDS = 60.0  # a lock whose holder stopped renewing it is free after this
POLL_SECONDS = 1.0  # how often a waiter looks again

# the renewals of the locks this process holds: (store url, key, holder) -> its Renewal
_HELD: dict[tuple[str, str, str], Renewal] = {}
_HELD_LOCK = threading.Lock()


@dataclass(frozen=True)
class LockRecord:
    holder: str  # Prefect's transaction holder
    token: str  # one per take
    host: str
    pid: int
    expires_at: float  # renewed by the holder
    until: float | None = None  # hold_timeout: the lock ends then, renewed or not
    process: str = ""  # the holding process's process.lifeline token ("" in locks written before it)

    def live(self, now: float) -> bool:
        """Held: not expired, not past its hold_timeout, and its holder process not known gone
        (storage.lease.holder_gone, as for the run lease)."""
        in_time = self.expires_at > now and (self.until is None or self.until > now)
        return in_time and not holder_gone(self.process, self.host, self.pid)


def lock_key(key: str) -> str:
    return join(LOCKS_DIR, key)


def _read(store: Store, where: str) -> tuple[LockRecord | None, str | None]:
    """(the lock, its version); a damaged record reads as an expired lock (storage.lease.read_record)."""
    return read_record(store, where, LockRecord, lambda: LockRecord("?", "?", "?", 0, 0.0))


class StoreLockManager(LockManager):
    """Prefect's LockManager protocol over leases in the task run's store. Holds no state of
    its own (the held locks' renewals are this module's), so a cache policy copied by Prefect
    copies nothing that matters."""

    def __init__(self, store: Store | Callable[[], Store], ttl: float = TTL_SECONDS, poll: float = POLL_SECONDS):
        """`store`: the store, or what gives it at each call (orchestration.caching: the task run's)."""
        self.store, self.ttl, self.poll = store, ttl, poll

    def _store(self) -> Store:
        return self.store if isinstance(self.store, Store) else self.store()

    # ---- the protocol ---------------------------------------------------------------------
    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        return self._acquire(self._store(), key, holder, acquire_timeout, hold_timeout)

    async def aacquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        store = self._store()  # in the task run's context, before the thread
        return await asyncio.to_thread(self._acquire, store, key, holder, acquire_timeout, hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        """Stop renewing, and remove the lock if it is still this holder's (else: nothing)."""
        store = self._store()
        with _HELD_LOCK:
            renewal = _HELD.pop((store.url(), key, holder), None)
        if renewal is not None:
            renewal.stop()
        current, _ = _read(store, lock_key(key))
        if current is not None and current.holder == holder:
            store.rm(lock_key(key), recursive=False)

    def is_locked(self, key: str) -> bool:
        current, _ = _read(self._store(), lock_key(key))
        return current is not None and current.live(time.time())

    def is_lock_holder(self, key: str, holder: str) -> bool:
        current, _ = _read(self._store(), lock_key(key))
        return current is not None and current.holder == holder and current.live(time.time())

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return self._wait(self._store(), key, timeout)

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        store = self._store()
        return await asyncio.to_thread(self._wait, store, key, timeout)

    # ---- the work -------------------------------------------------------------------------
    def _acquire(
        self, store: Store, key: str, holder: str, acquire_timeout: float | None, hold_timeout: float | None
    ) -> bool:
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        told = False
        while True:
            current = self._take(store, key, holder, hold_timeout)
            if current is None:
                self._renew_in_background(store, key, holder)
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if not told:
                told = True
                _logger().info(
                    "%s is being computed by another task run (host %s, pid %s): waiting for it, then reading "
                    "its result",
                    key,
                    current.host,
                    current.pid,
                )
            left = self.poll if deadline is None else max(0.0, min(self.poll, deadline - time.monotonic()))
            time.sleep(left)

    def _take(self, store: Store, key: str, holder: str, hold_timeout: float | None) -> LockRecord | None:
        """Take the lock once: None when this holder has it now, else the lock in the way."""
        where = lock_key(key)
        now = time.time()
        until = now + hold_timeout if hold_timeout is not None else None
        mine = LockRecord(
            holder, uuid.uuid4().hex, socket.gethostname(), os.getpid(), now + self.ttl, until, lifeline.token()
        )
        current, version = _read(store, where)
        if current is not None and current.live(now):
            return None if current.holder == holder else current  # already this holder's, or in the way
        # free, expired (its holder stopped renewing), or its holder process is gone
        if claim(store, where, encode(mine), mine.token, version) is not None:
            if (
                current is not None
                and current.expires_at > now
                and holder_gone(current.process, current.host, current.pid)
            ):
                _logger().info(
                    "%s: the lock of a task run whose process is gone (host %s, pid %s) was taken over",
                    key,
                    current.host,
                    current.pid,
                )
            return None
        back, _ = _read(store, where)
        return back if back is not None else current or mine

    def _renew_in_background(self, store: Store, key: str, holder: str) -> None:
        where = lock_key(key)

        def renew() -> bool:
            current, version = _read(store, where)
            if current is None or current.holder != holder:
                return False  # released, or taken after it expired: nothing left to renew
            renewed = LockRecord(**{**asdict(current), "expires_at": time.time() + self.ttl})
            store.write_bytes_if_version(where, encode(renewed), version)
            return True

        renewal = Renewal("stoker-cache-lock", self.ttl / 3, renew)  # a store error: tried again next round
        with _HELD_LOCK:
            old = _HELD.pop((store.url(), key, holder), None)
            _HELD[(store.url(), key, holder)] = renewal
        if old is not None:
            old.stop()

    def _wait(self, store: Store, key: str, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            current, _ = _read(store, lock_key(key))
            if current is None or not current.live(time.time()):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.poll)


def _logger():
    return run_logger("stoker.result_cache")
