"""What a rank says: typed events printed whole on stdout (``emit``, which the launcher streams),
rank 0's stored records for ``{run}/metrics.jsonl`` (``MetricsLog``), and the throughput of each
log interval: tokens/s, MFU, data wait, peak memory (``Throughput``). Plain torch; no orchestrator."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

import torch

from stoker.config import RunConfig
from stoker.contracts import events
from stoker.storage.layout import METRICS_FILE, run_file_key
from stoker.storage.store import Store
from stoker.training.distributed import RankInfo

_STDOUT_LOCK = threading.Lock()


def emit(event: events.Event) -> None:
    """Print an event's wire line whole: one write under a lock, so lines printed from the
    training and upload threads never cut into each other."""
    with _STDOUT_LOCK:
        sys.stdout.write(event.encode() + "\n")
        sys.stdout.flush()


class MetricsLog:
    """Typed events out of this rank: printed at once in their wire form (the launcher
    streams them into the orchestrator's log); rank 0 also keeps the stored kinds for
    {run}/metrics.jsonl, appended on flush (after each checkpoint commit, from the upload
    thread, and at the end)."""

    def __init__(self, store: Store, run_name: str, rank: int):
        self.store, self.key = store, run_file_key(run_name, METRICS_FILE)
        self.rank, self.enabled = rank, rank == 0
        self.pending: list[str] = []
        self.lock = threading.Lock()

    def log(self, event: events.Event) -> None:
        """A rank-0 record (others stay silent: every rank holds the same numbers)."""
        if self.enabled:
            self.event(event)

    def event(self, event: events.Event) -> None:
        """Something any rank has to say (an upload retry, a failed checkpoint). The training
        and upload threads both print: one write of the whole line under a lock, or a line of
        one could be cut by the other's (print writes the text and the newline apart)."""
        emit(event)
        if self.enabled and event.stored:
            with self.lock:
                self.pending.append(event.to_json() + "\n")

    def flush(self) -> None:
        """Best effort: on a storage error the lines stay pending for the next flush."""
        with self.lock:
            if not self.pending:
                return
            try:
                self.store.append_text(self.key, "".join(self.pending))
                self.pending = []
            except Exception as err:  # never let a metrics write stop training
                print(f"metrics flush failed, will retry: {err!r}", file=sys.stderr, flush=True)


class Throughput:
    """Training throughput over the steps since a mark (`restart`): tokens/s, MFU (model FLOPs
    per token x tokens/s over the peak of every rank's device), the share of the time spent
    waiting for data, the peak device memory. Time `leave_out` is given (evaluations) does not
    count. Read after a sync (a log step's). Each interval also keeps its own account for the
    goodput ledger (`account`): when it began, the evaluations left out, the checkpoint stalls."""

    def __init__(
        self,
        cfg: RunConfig,
        ranks: RankInfo,
        flops_per_token: float,
        peak_flops: float | None,
        data_wait_seconds: Callable[[], float],
    ):
        self.cfg, self.ranks = cfg, ranks
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.data_wait_seconds = data_wait_seconds
        self.mark = (0, time.perf_counter(), 0.0)  # (step, perf_counter, data wait seconds)
        self.since, self.eval_seconds, self.checkpoint_seconds = time.time(), 0.0, 0.0

    def restart(self, step: int) -> None:
        self.mark = (step, time.perf_counter(), self.data_wait_seconds())
        self.since, self.eval_seconds, self.checkpoint_seconds = time.time(), 0.0, 0.0

    def leave_out(self, seconds: float) -> None:
        """An evaluation's time: not training, so not part of step_seconds."""
        step, t, wait = self.mark
        self.mark = (step, t + seconds, wait)
        self.eval_seconds += seconds

    def checkpoint(self, seconds: float) -> None:
        """A checkpoint stall of the training thread (it stays part of step_seconds)."""
        self.checkpoint_seconds += seconds

    def account(self) -> dict:
        """The interval's own account (Train's and Done's ledger fields)."""
        return {
            "since": round(self.since, 4),
            "since_step": self.mark[0],
            "eval_seconds": round(self.eval_seconds, 4),
            "checkpoint_seconds": round(self.checkpoint_seconds, 4),
        }

    def since_mark(self, step: int) -> dict:
        mark = self.mark
        steps, seconds = step - mark[0], time.perf_counter() - mark[1]
        if steps <= 0 or seconds <= 0:
            return {"step_seconds": 0.0, **self.account()}
        cfg, r = self.cfg, self.ranks
        tps = steps * cfg.train.global_batch_size * cfg.model.block_size / seconds
        out = {
            "step_seconds": round(seconds / steps, 4),
            "tokens_per_second": round(tps, 1),
            "data_wait_share": round(min(1.0, (self.data_wait_seconds() - mark[2]) / seconds), 4),
            **self.account(),
        }
        if self.peak_flops:
            out["mfu"] = round(self.flops_per_token * tps / (self.peak_flops * r.world_size), 4)
        if r.device.type == "cuda":
            out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(r.device) / 1e9, 2)
        return out
