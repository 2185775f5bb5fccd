"""Prefect API calls made while the ranks train, made best-effort and off the stream loop.

The launcher's stream loop reads every rank's line and feeds the watchdog; it must never
wait for the Prefect server. A progress bar or a checkpoint table is only worth its newest
value, so each is kept under a key: the newest call per key waits in a small bounded map and
one worker thread makes it. While the server is away (an outage of minutes, a restart) a
failed call is kept and tried again every `retry_seconds`; a newer value for its key replaces
it, so what the UI missed is caught up with one call per key when the server returns. Logs
need nothing of this: Prefect's APILogHandler already queues them for a worker of its own.

Each call runs in a copy of the caller's context (made when it is queued), so an artifact is
still linked to the task run and flow run that made it.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import OrderedDict
from typing import Callable

from stoker.core.failures import describe

MAX_PENDING = 32  # keys; more than this and the oldest is dropped (never reached by stoker's few)
RETRY_SECONDS = 5.0
FLUSH_SECONDS = 30.0  # what close() waits, at most, for the last values to go out


class BestEffortPublisher:
    """Newest call per key, made on a thread of its own; never raises into the caller."""

    def __init__(self, logger, retry_seconds: float = RETRY_SECONDS, max_pending: int = MAX_PENDING):
        self.logger, self.retry_seconds, self.max_pending = logger, retry_seconds, max_pending
        self._pending: OrderedDict[str, tuple[Callable[[], object], contextvars.Context]] = OrderedDict()
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self.failures = 0  # calls that failed (and were kept to try again)
        self._outage_since: float | None = None
        self._thread = threading.Thread(target=self._work, name="stoker-prefect-publisher", daemon=True)
        self._thread.start()

    def latest(self, key: str, call: Callable[[], object]) -> None:
        """Make `call` soon, unless a newer call for `key` comes first. Returns at once."""
        ctx = contextvars.copy_context()
        with self._cond:
            self._pending.pop(key, None)
            self._pending[key] = (call, ctx)
            while len(self._pending) > self.max_pending:  # bounded: the oldest key gives way
                self._pending.popitem(last=False)
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                key, (call, ctx) = self._pending.popitem(last=False)
                self._busy = True
            ok = self._try(key, call, ctx)
            with self._cond:
                self._busy = False
                if not ok:
                    self._pending.setdefault(key, (call, ctx))  # unless a newer value came
                    self._pending.move_to_end(key, last=False)
                    self._cond.notify_all()
                    if not self._closing:
                        self._cond.wait(self.retry_seconds)
                    elif self._pending:
                        return  # closing with the server away: close() says what was left
                else:
                    self._cond.notify_all()

    def _try(self, key: str, call: Callable[[], object], ctx: contextvars.Context) -> bool:
        try:
            ctx.run(call)
        except Exception as err:  # the server is away or refused: the run goes on regardless
            self.failures += 1
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                self.logger.warning(
                    "Prefect API call for %s failed (%s); training goes on, and the "
                    "UI is brought up to date when the server answers again",
                    key,
                    describe(err),
                )
            return False
        if self._outage_since is not None:
            self.logger.info(
                "Prefect API answers again after %.0fs; the UI is brought up to date",
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None
        return True

    def close(self, timeout: float = FLUSH_SECONDS) -> list[str]:
        """Send what is pending (up to `timeout`), stop the thread; the keys left unsent."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._busy) and time.monotonic() < deadline:
                self._cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        with self._cond:
            left = list(self._pending)
        if left:
            self.logger.warning("Prefect API still unreachable: not sent to the UI: %s", ", ".join(left))
        return left
