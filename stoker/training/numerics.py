"""The numerics guard: a run never goes on silently with NaN/inf.

Every step checks its loss and gradient norm on the device. Under ``train.nonfinite=fail``
(the default) nothing is read on the host per step: the first non-finite step of each kind is
kept in a device tensor, read on log steps (where the loss is synced anyway) and before every
checkpoint save, and the run then ends with ``NonFiniteError`` (permanent: not retried) naming
that step. Under ``skip`` the user opted into one host read per step: the ranks agree whether
the step is bad and, if so, drop its update (the step number, the data order and the
learning-rate schedule go on, so the data order stays a pure function of seed and step), up to
``train.nonfinite_skip_limit`` skipped steps in a launch.

Before a save, the weights and optimizer state themselves are checked (a checkpoint holding
NaN/inf is never committed), and the commit manifest records ``numerics: finite``.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

from stoker.config import TrainConfig
from stoker.contracts import events
from stoker.failures import NonFiniteError

FINITE = "finite"  # the commit manifest's `numerics` value for a checked state
_NEVER = 2**62  # "no bad step yet"; MIN over ranks keeps the earliest real one
_WHAT = ("loss", "gradient norm")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP2 DTensor's shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterable[torch.Tensor]:
    """The floating-point tensors a checkpoint of this rank holds: parameters, buffers and
    optimizer state (RNG states are left out: an unset slot is NaN by design)."""
    yield from model.parameters()
    yield from model.buffers()
    if optimizer is not None:
        for entries in optimizer.state.values():
            yield from (v for v in entries.values() if isinstance(v, torch.Tensor))


def count_nonfinite_tensors(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How many of these tensors hold a NaN/inf, as a device tensor (no host sync)."""
    flags = [
        (~torch.isfinite(_local(t))).any().to(device) for t in tensors if t.is_floating_point() and _local(t).numel()
    ]
    if not flags:
        return torch.zeros((), dtype=torch.int64, device=device)
    return torch.stack(flags).sum()


class NumericsGuard:
    """Per-step checks of one rank; see the module docstring. `emit` logs a NonFinite event."""

    def __init__(self, cfg: TrainConfig, device: torch.device, is_dist: bool, emit: Callable[[events.Event], None]):
        self.skip_enabled, self.skip_limit = cfg.nonfinite == "skip", cfg.nonfinite_skip_limit
        self.device, self.is_dist, self.emit = device, is_dist, emit
        # the first step whose loss / gradient norm was non-finite, on the device: (2,)
        self.first_bad = torch.full((2,), _NEVER, dtype=torch.int64, device=device)
        self.num_skipped = 0

    def check_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Called between backward and the optimizer step of `step` (1-based). Returns whether
        the update must be dropped: only ever True under skip (the one per-step host read)."""
        bad = torch.stack(
            [
                ~torch.isfinite(loss.detach().float()),
                ~torch.isfinite(grad_norm.detach().float())
                if grad_norm is not None
                else torch.zeros((), dtype=torch.bool, device=loss.device),
            ]
        )
        if not self.skip_enabled:
            # kept on the device: masked_fill_ takes the step as a scalar argument, no copy
            self.first_bad.masked_fill_(bad & (self.first_bad > step), step)
            return False
        flags = bad.to(torch.int32)
        if self.is_dist:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # group: world; all ranks skip together
        loss_bad, grad_bad = flags.tolist()  # the host read skip opts into
        if not (loss_bad or grad_bad):
            return False
        what = _WHAT[0] if loss_bad else _WHAT[1]
        if self.num_skipped >= self.skip_limit:
            self._fail(
                step,
                step,
                what,
                f"after skipping {self.num_skipped} non-finite step(s), "
                f"the limit (train.nonfinite_skip_limit={self.skip_limit})",
            )
        self.num_skipped += 1
        self.emit(
            events.NonFinite(step=step, first_step=step, what=what, action="skipped", num_skipped=self.num_skipped)
        )
        return True

    def raise_if_bad(self, step: int) -> None:
        """On log steps and before saves: end the run if any step so far went non-finite on any
        rank. One small collective and one host read, at a point that syncs anyway."""
        first = self.first_bad.clone()
        if self.is_dist:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)  # group: world; the earliest bad step
        loss_step, grad_step = first.tolist()
        if min(loss_step, grad_step) >= _NEVER:
            return
        what = _WHAT[0] if loss_step <= grad_step else _WHAT[1]
        self._fail(step, min(loss_step, grad_step), what, "train.nonfinite=fail")

    def check_state(self, step: int, model: torch.nn.Module, optimizer) -> None:
        """Before a save: the weights and optimizer state of every rank must be finite."""
        bad = count_nonfinite_tensors(state_tensors(model, optimizer), self.device)
        if self.is_dist:
            dist.all_reduce(bad)  # group: world; a shard of any rank counts
        if int(bad):
            self._fail(step, step, "weights or optimizer state", "the checkpoint is not saved")

    def _fail(self, step: int, first_step: int, what: str, why: str) -> None:
        self.emit(
            events.NonFinite(step=step, first_step=first_step, what=what, action="failed", num_skipped=self.num_skipped)
        )
        raise NonFiniteError(
            f"non-finite {what} at step {first_step} ({why}); no checkpoint after step "
            f"{first_step - 1} is committed. Lower train.lr (or raise warmup_steps, set "
            "train.grad_clip) and resume from the last committed checkpoint, or set "
            "train.nonfinite=skip to drop such steps"
        )
