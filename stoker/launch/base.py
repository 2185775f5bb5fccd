"""The launcher interface: start a gang of ranks, stream what they say, stop it, and say
why it ended. ``torchrun.TorchrunLauncher`` is the first implementation; a Ray launcher
slots in beside it. Launchers never import torch: ranks speak ``contracts.events`` records."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

from stoker.contracts.events import Event, Failure
from stoker.failures import PERMANENT, SHARDS_DAMAGED, TrainingFailed, classify_reported

OnLine = Callable[[str], None]
OnEvent = Callable[[Event], None]


@dataclass
class GangResult:
    """How one launch attempt ended, and the evidence for why."""

    returncodes: list[int | None]
    reason: str  # completed | failed | timeout | hang
    seconds: float
    events: list[Event] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)  # the last output lines, for messages
    last_step: int | None = None  # the last step rank 0 reported finished
    hang_timeout: float = 0.0
    gang_id: str = ""
    pids: list[int] = field(default_factory=list)  # the agents'
    failures: list[Failure] = field(default_factory=list)  # ranks that raised (their error files)
    lost_ranks: list[int] = field(default_factory=list)  # ranks that ended without raising
    launcher_errors: list[tuple[str, str]] = field(default_factory=list)  # (type, message) of agents


class Launcher(ABC):
    """One launch attempt. ``run`` is start + stream + stop, with stop on every exit path."""

    @abstractmethod
    def start(self) -> None:
        """Start every node's processes (or workers)."""

    @abstractmethod
    def stream(self, on_line: OnLine, on_event: OnEvent) -> GangResult:
        """Feed every rank's output lines and events to the callbacks until the gang ends, its
        time limit passes or it hangs; return how it ended."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the gang: SIGTERM (ranks checkpoint if it fits), a grace period, then kill.
        Idempotent; safe from any exit path."""

    def classify_end(self, result: GangResult) -> TrainingFailed | None:
        """None when the gang completed, else an error whose `transient` says if a retry helps."""
        return None if result.reason == "completed" else classify_end(result)

    def collect(self, result: GangResult) -> GangResult:
        """Add the evidence only a stopped gang gives (exit codes, error files)."""
        return result

    def close(self) -> None:  # noqa: B027  (a launcher that leaves nothing on the host keeps it)
        """Remove what the launch left on this host (its work folder). Idempotent; `run`
        calls it on every exit path: an exception, KeyboardInterrupt, Prefect's SIGTERM."""

    def run(self, on_line: OnLine, on_event: OnEvent) -> GangResult:
        try:
            self.start()
            try:
                result = self.stream(on_line, on_event)
            finally:
                self.stop()
            return self.collect(result)
        finally:
            self.close()


def classify_end(result: GangResult) -> TrainingFailed:
    """Why a gang failed, as an error that says whether retrying can help (failures.classify
    judges one exception; this judges a whole launch from its evidence).

    Any rank that reported a permanent failure (a bug, a bad config, a shape mismatch, out
    of memory) makes the whole failure permanent, since peers of a crashed rank only see
    lost connections. A time-out or a hang is transient. So is a gang where some rank ended
    without raising (killed by a signal), or reported only transient failures, or an agent
    lost its rendezvous. What is left (an agent that failed with nothing to show) is not
    retried."""
    # the reason alone: every line the ranks printed is in the log already, prefixed [rank N]
    permanent = [f for f in result.failures if not f.transient]
    if permanent:
        # the rank that failed first says why; a restarted one only repeats it (FailedBefore)
        first = sorted(permanent, key=lambda f: f.type == "FailedBefore")[0]
        # the rank that found the damage says which file; the others found its marker
        damaged = sorted(
            (f for f in permanent if f.type == "ShardsDamaged"), key=lambda f: "marked invalid by" in f.message
        )
        damaged = damaged[0] if damaged else None
        if damaged is not None:  # the flow rebuilds the set and relaunches once
            return TrainingFailed(
                f"rank {damaged.rank} found a shard set damaged: {damaged.message}",
                transient=False,
                reason=SHARDS_DAMAGED,
            )
        return TrainingFailed(
            f"rank {first.rank} raised {first.type}: {_first_line(first.message)} "
            f"(not retried: it would fail the same way){LOG_HINT}",
            transient=False,
            reason="error",
        )
    if result.reason == "timeout":
        return TrainingFailed(
            f"training exceeded its time limit after {result.seconds:.0f}s", transient=True, reason="timeout"
        )
    if result.reason == "startup":
        return TrainingFailed(
            f"training did not start: no report from rank 0 within launch.startup_timeout_seconds "
            f"({result.seconds:.0f}s: rendezvous, loading the shards and the checkpoint, the first "
            f"evaluation); the gang was killed. Retrying from the newest valid checkpoint.{LOG_HINT}",
            transient=True,
            reason="startup",
        )
    if result.reason == "hang":
        seen = "none yet" if result.last_step is None else f"step {result.last_step}"
        return TrainingFailed(
            f"training hung: no step finished for {result.hang_timeout:.0f}s (last step seen: "
            f"{seen}); the gang was killed (a stuck collective or a frozen rank). Retrying from "
            f"the newest valid checkpoint.{LOG_HINT}",
            transient=True,
            reason="hang",
        )
    agents_transient = any(classify_reported(k, m) != PERMANENT for k, m in result.launcher_errors)
    signalled = any(rc is not None and rc < 0 for rc in result.returncodes)
    if result.failures or result.lost_ranks or signalled or agents_transient:
        if result.lost_ranks:
            what = f"rank(s) {sorted(result.lost_ranks)} ended without raising (killed?)"
        elif result.launcher_errors and not result.failures:  # no rank got to say anything
            what = "the launch failed: " + "; ".join(f"{k}: {m}" for k, m in result.launcher_errors)
        else:
            what = "a rank or node was lost (signal, network or storage)"
        return TrainingFailed(
            f"{what}; retrying from the newest valid checkpoint.{LOG_HINT}",
            transient=True,
            reason="lost-rank",
        )
    errors = "; ".join(f"{k}: {_first_line(m)}" for k, m in result.launcher_errors)
    last = next((line.strip() for line in reversed(result.tail) if line.strip()), "")
    said = errors or (f"its last line: {last[:300]}" if last else "")
    return TrainingFailed(
        f"training exited with an error (not retried){': ' + said if said else ''}.{LOG_HINT}",
        transient=False,
        reason="error",
    )


LOG_HINT = " The ranks' whole output is in the log above (lines [rank N])."


def _first_line(message: str) -> str:
    return message.strip().split("\n", 1)[0][:500]
