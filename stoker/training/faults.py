"""Fault injection for tests and drills, off unless STOKER_FAULT is set.

STOKER_FAULT="kill:rank=1:step=5"   the rank SIGKILLs itself when it reaches that step
STOKER_FAULT="hang:rank=1:step=5"   the rank stops stepping (sleeps) at that step
STOKER_FAULT="raise:rank=0:step=3"  the rank raises RuntimeError at that step
STOKER_FAULT="nan:rank=0:step=3:count=2"  the rank's training loss is NaN at steps 3 and 4
                                    (count defaults to 1): the real numerics guard must see it
STOKER_FAULT="slow:seconds=0.2"     every rank sleeps that long before each step (a long run
                                    made of tiny steps, for outage drills); never "fires"
A fault fires once: it creates STOKER_FAULT_ONCE (a file path) and never fires while that
file exists, so the retried run goes through. Before the fault's step every rank lets its
checkpoint in flight finish (written, uploaded, committed; see ``settles_before``), so a
drill's resume point does not depend on how fast the background upload was.
"""

from __future__ import annotations

import os
import signal
import time

_NAN_STATE: dict = {"hook": None, "fired": False}  # the NaN fault's forward hook and progress


def _parse(spec: str, with_count: bool = False):
    kind, *fields = spec.split(":")
    values = dict(f.split("=", 1) for f in fields)
    parsed = (kind, int(values.get("rank", 0)), int(values.get("step", 0)))
    return parsed + (int(values.get("count", 1)),) if with_count else parsed


def _poison_loss(module, inputs, output):
    """A forward hook: the training loss (the model returns (logits, loss)) becomes NaN."""
    if module.training and isinstance(output, tuple) and output[1] is not None:
        return (output[0], output[1] * float("nan"))
    return output


def _nan_fault(model, rank: int, step: int, fault_rank: int, fault_step: int, count: int) -> None:
    """Poison this step's training forwards while `step` is in [fault_step, fault_step+count)."""
    if _NAN_STATE["hook"] is not None:
        _NAN_STATE["hook"].remove()
        _NAN_STATE["hook"] = None
    if model is None or rank != fault_rank or not fault_step <= step < fault_step + count:
        return
    if step == fault_step:
        once = os.environ.get("STOKER_FAULT_ONCE")
        if once and os.path.exists(once):
            return
        if once:
            open(once, "w").write(os.environ["STOKER_FAULT"])
        _NAN_STATE["fired"] = True
    if _NAN_STATE["fired"]:
        print(f"injected fault: nan loss at step {step} on rank {rank}", flush=True)
        _NAN_STATE["hook"] = model.register_forward_hook(_poison_loss)


def settles_before(step: int) -> bool:
    """Whether a fault is set for this step on any rank: then every rank waits for its
    checkpoint in flight before the step (it costs one wait, on drills only)."""
    spec = os.environ.get("STOKER_FAULT")
    return bool(spec) and _parse(spec)[2] == step


def maybe_inject(rank: int, step: int, model=None) -> None:
    """Called by the loop before each step (with the model the NaN fault hooks into)."""
    spec = os.environ.get("STOKER_FAULT")
    if not spec:
        return
    if spec.startswith("slow:"):
        time.sleep(float(dict(f.split("=", 1) for f in spec.split(":")[1:]).get("seconds", 0.1)))
        return
    kind, fault_rank, fault_step, count = _parse(spec, with_count=True)
    if kind == "nan":
        return _nan_fault(model, rank, step, fault_rank, fault_step, count)
    if rank != fault_rank or step != fault_step:
        return
    once = os.environ.get("STOKER_FAULT_ONCE")
    if once:
        if os.path.exists(once):
            return
        open(once, "w").write(spec)
    print(f"injected fault: {kind} at step {step} on rank {rank}", flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "raise":
        raise RuntimeError(f"injected fault at step {step} on rank {rank}")
    else:
        raise ValueError(f"STOKER_FAULT: unknown fault kind {kind!r} (kill, hang, raise, nan or slow)")
