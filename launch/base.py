"""The launcher interface: start a gang of ranks, stream what they say, stop it, and say
why it ended. ``torchrun.TorchrunLauncher`` is the first implementation; a Ray launcher
slots in beside it. Launchers never import torch: ranks speak ``core.events`` records."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

from core.events import Event, Failure
from core.failures import TrainingFailed

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

    @abstractmethod
    def classify(self, result: GangResult) -> TrainingFailed | None:
        """None when the gang completed, else an error whose `transient` says if a retry helps."""

    def collect(self, result: GangResult) -> GangResult:
        """Add the evidence only a stopped gang gives (exit codes, error files)."""
        return result

    def run(self, on_line: OnLine, on_event: OnEvent) -> GangResult:
        self.start()
        try:
            result = self.stream(on_line, on_event)
        finally:
            self.stop()
        return self.collect(result)
