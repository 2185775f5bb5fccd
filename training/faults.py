"""Fault injection for tests and drills, off unless STOKER_FAULT is set.

STOKER_FAULT="kill:rank=1:step=5"   the rank SIGKILLs itself when it reaches that step
STOKER_FAULT="hang:rank=1:step=5"   the rank stops stepping (sleeps) at that step
STOKER_FAULT="raise:rank=0:step=3"  the rank raises RuntimeError at that step
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


def _parse(spec: str) -> tuple[str, int, int]:
    kind, *fields = spec.split(":")
    values = dict(f.split("=", 1) for f in fields)
    return kind, int(values.get("rank", 0)), int(values.get("step", 0))


def settles_before(step: int) -> bool:
    """Whether a fault is set for this step on any rank: then every rank waits for its
    checkpoint in flight before the step (it costs one wait, on drills only)."""
    spec = os.environ.get("STOKER_FAULT")
    return bool(spec) and _parse(spec)[2] == step


def maybe_inject(rank: int, step: int) -> None:
    """Called by the loop before each step."""
    spec = os.environ.get("STOKER_FAULT")
    if not spec:
        return
    if spec.startswith("slow:"):
        time.sleep(float(dict(f.split("=", 1) for f in spec.split(":")[1:]).get("seconds", 0.1)))
        return
    kind, fault_rank, fault_step = _parse(spec)
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
        raise ValueError(f"STOKER_FAULT: unknown fault kind {kind!r} (kill, hang or raise)")
