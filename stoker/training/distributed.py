"""The distributed side of a rank, worked out once: joining the process group torchrun prepared,
the rank facts (RankInfo), the collectives the loop takes on the world group, and the stop vote
(SIGTERM, or a Ray worker's relayed stop, agreed on by every rank at a step boundary over a gloo
side group). Plain torch; no orchestrator."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stoker.config import RunConfig


def stop_grace_seconds() -> float:
    """The ranks' stop budget (read when asked: a Ray worker sets its environment after import)."""
    return float(os.environ.get("STOKER_STOP_GRACE_SECONDS", "15"))


_STOP_ASKED = threading.Event()  # a stop asked for without a signal (a Ray worker's relay)


def request_stop() -> None:
    """Ask this rank to stop as SIGTERM does, from any thread (Ray workers get no signal:
    their driver relays the stop)."""
    _STOP_ASKED.set()
    for stop in list(_STOP_REQUESTS):
        stop.ask()


_STOP_REQUESTS: "list[StopRequest]" = []


def stop_already_asked() -> bool:
    """Whether this rank was already asked to stop (SIGTERM, a relayed stop)."""
    return _STOP_ASKED.is_set() or any(stop.flag for stop in _STOP_REQUESTS)


class Preempted(Exception):
    """The ranks were asked to stop (SIGTERM: a cancel, a preemption). Transient."""


class StopRequest:
    """SIGTERM sets a flag; the ranks agree at a step boundary to stop together.

    The vote costs no host sync: at each boundary a rank starts an asynchronous MAX
    all-reduce of its flag over a gloo side group and reads the vote started one boundary
    earlier (long done by then). Every rank reads the same vote at the same step, so all stop
    together, one step after the signal, well inside the grace period."""

    def __init__(self, group: "dist.ProcessGroup | None" = None):
        if group is not None and dist.get_world_size(group) == 1:
            group = None  # alone (torchrun --nproc-per-node=1): no vote to take each step
        self.flag, self.since, self.group = False, None, group
        self.pending: tuple | None = None  # (work, tensor) of the vote in flight
        if threading.current_thread() is threading.main_thread():  # a Ray worker's is not
            signal.signal(signal.SIGTERM, self._handler)
        _STOP_REQUESTS[:] = [self]
        if _STOP_ASKED.is_set():
            self.ask()

    def _handler(self, signum, frame) -> None:
        self.ask()

    def ask(self) -> None:
        if not self.flag:
            self.flag, self.since = True, time.monotonic()

    def agreed(self) -> bool:
        if self.group is None:
            return self.flag
        stop = False
        if self.pending is not None:
            work, vote = self.pending
            work.wait()
            stop = bool(vote.item())
        vote = torch.tensor([1 if self.flag else 0])
        self.pending = (dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group, async_op=True), vote)
        if stop and self.since is None:
            self.since = time.monotonic()
        return stop

    def drain(self) -> None:
        """Finish the vote in flight (every rank started it) before the group goes away."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None

    def seconds_left(self) -> float:
        return stop_grace_seconds() - (time.monotonic() - (self.since or time.monotonic()))


@dataclass(frozen=True)
class RankInfo:
    """Rank facts, worked out once."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_dist(self) -> bool:
        return self.world_size > 1 or (dist.is_available() and dist.is_initialized())


def _restart_store() -> "dist.Store | None":
    """The rendezvous store of this restart round. torchrun (agent store) keeps one store across
    in-place restarts, and the restarted ranks then read the dead ranks' gloo addresses from it
    (connectFullMesh: connection refused; seen with torch 2.13 when a surviving rank failed on
    its own). Keys prefixed by the restart count keep each round to itself."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timedelta(minutes=10),
    )
    return dist.PrefixStore(f"stoker/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def setup_distributed(cfg: RunConfig) -> RankInfo:
    """Join the process group torchrun prepared (or run alone without one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and cfg.launch.backend != "gloo"
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        from datetime import timedelta

        dist.init_process_group(
            backend=backend,
            store=_restart_store(),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=cfg.launch.collective_timeout_seconds),
        )
    if device.type == "cpu":  # the CPUs the launcher gave this rank (Ray: its reservation)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = int(os.environ.get("STOKER_CPU_THREADS", "0")) or (os.cpu_count() or 1) // local_world
        torch.set_num_threads(max(1, threads))
    return RankInfo(rank, local_rank, world, device)


def all_ranks_agree(ok: bool, ranks: RankInfo) -> bool:
    """True only when `ok` holds on every rank."""
    if not ranks.is_dist:
        return ok
    flag = torch.tensor([1 if ok else 0], device=ranks.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # group: world; one verdict for all ranks
    return bool(flag.item())


def mean_over_ranks(loss: torch.Tensor, ranks: RankInfo) -> float:
    """A device scalar averaged over every rank, read on the host (a sync)."""
    if ranks.is_dist:
        loss = loss.clone()
        dist.all_reduce(loss)  # group: world; the loss averaged over all ranks
        loss /= ranks.world_size
    return float(loss)
