"""The gang's time limit and hang watchdog, fed with the ranks' events."""

from __future__ import annotations

import time

from stoker.contracts.events import Event, Step


class Watchdog:
    """`timeout`: wall-clock limit of the launch. `hang_timeout` (> 0): armed at the first
    event other than a heartbeat (start-up is over: rendezvous, loading, the step-0
    evaluation), then fed by every Step heartbeat; when no step finishes for that long, the
    gang has hung. `startup_timeout` (> 0): the limit of start-up itself, until that first
    event (a rendezvous that never completes, a rank stuck loading)."""

    def __init__(self, timeout: float, hang_timeout: float = 0.0, startup_timeout: float = 0.0):
        self.timeout, self.hang_timeout, self.startup_timeout = timeout, hang_timeout, startup_timeout
        self.t0 = time.monotonic()
        self.last_beat: float | None = None  # when the last step finished (None: not armed)
        self.last_step: int | None = None

    def saw(self, event: Event) -> None:
        if isinstance(event, Step):
            self.last_beat, self.last_step = time.monotonic(), event.step
        elif self.last_beat is None:
            self.last_beat = time.monotonic()

    def verdict(self) -> str | None:
        """'timeout', 'startup', 'hang', or None while all is well."""
        now = time.monotonic()
        if now - self.t0 > self.timeout:
            return "timeout"
        if self.startup_timeout > 0 and self.last_beat is None and now - self.t0 > self.startup_timeout:
            return "startup"
        if self.hang_timeout > 0 and self.last_beat is not None and now - self.last_beat > self.hang_timeout:
            return "hang"
        return None

    def seconds_left(self) -> float:
        return max(0.0, self.timeout - (time.monotonic() - self.t0))
