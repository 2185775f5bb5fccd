"""The training loop every rank runs: DDP, AdamW, warmup+cosine, accumulation, clipping,
periodic evaluation and checkpoints. Plain torch; no orchestrator."""

from __future__ import annotations

import math
import os
import random
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from core import events
from storage.checkpoints import rehydrate
from storage.layout import METRICS_FILE, run_file_key
from storage.store import Store
from storage.uploader import CheckpointUploader
from training.checkpoint import (
    load_checkpoint,
    model_optim_tensors,
    rng_state_tensors,
    save_state,
    scalar_state,
    to_host,
)
from core.config import RunConfig
from training.data import TokenStream, eval_offsets, get_batch, train_batch
from training.faults import maybe_inject
from training.model import GPT, param_groups

STOP_GRACE_SECONDS = float(os.environ.get("STOKER_STOP_GRACE_SECONDS", "15"))
FAILED_UPLOAD_WAIT_SECONDS = 10.0


class Preempted(Exception):
    """The ranks were asked to stop (SIGTERM: a cancel, a preemption). Transient."""


class StopRequest:
    """SIGTERM sets a flag; the ranks agree at a step boundary to stop together."""

    def __init__(self):
        self.flag, self.since = False, None
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        self.flag, self.since = True, time.monotonic()

    def agreed(self, is_dist: bool) -> bool:
        if not is_dist:
            return self.flag
        t = torch.tensor([1 if self.flag else 0])
        # group: world; a stop must happen at the same step on every rank, or the others hang
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t.item() and self.since is None:
            self.since = time.monotonic()
        return bool(t.item())

    def seconds_left(self) -> float:
        return STOP_GRACE_SECONDS - (time.monotonic() - (self.since or time.monotonic()))


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
        dist.init_process_group(backend=backend)
    if device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return RankInfo(rank, local_rank, world, device)


def lr_multiplier(step: int, cfg: RunConfig) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr/lr at max_steps."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / (t.warmup_steps + 1)
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    floor = t.min_lr / t.lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


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
        """Something any rank has to say (an upload retry, a failed checkpoint)."""
        print(event.encode(), flush=True)
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


class Trainer:
    def __init__(self, cfg: RunConfig, ranks: RankInfo, shard_dir: str, store: Store,
                 shard_key: str = "", cache_dir: str = "/tmp/stoker-cache"):
        self.cfg, self.ranks, self.store, self.shard_key = cfg, ranks, store, shard_key
        self.cache_dir = cache_dir
        self.run_name = cfg.resolved_run_name()
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.train_data = TokenStream(shard_dir, "train")
        self.val_data = TokenStream(shard_dir, "val")
        torch.manual_seed(cfg.train.seed)  # same init on every rank
        self.raw_model = GPT(cfg.model, self.train_data.vocab_size).to(ranks.device)
        self.model = DDP(self.raw_model) if ranks.is_dist else self.raw_model
        t = cfg.train
        self.optimizer = torch.optim.AdamW(param_groups(self.raw_model, t.weight_decay), lr=t.lr,
                                           betas=(t.beta1, t.beta2), foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_multiplier(s, cfg))
        # per-rank streams (dropout, anything drawing from numpy or random): every RNG is
        # a function of (seed, rank) and is saved and restored with each checkpoint
        torch.manual_seed(t.seed + 1 + ranks.rank)
        np.random.seed((t.seed + 1 + ranks.rank) % 2**32)
        random.seed(t.seed + 1 + ranks.rank)
        self.step, self.tokens_seen = 0, 0
        self.last_saved_step, self.last_save_seconds = -1, 0.0
        self.pinned: dict[str, torch.Tensor] = {}  # host staging buffers for CUDA state
        self.metrics = MetricsLog(store, self.run_name, ranks.rank)
        self.stop = StopRequest()
        c = cfg.checkpoint
        self.uploader = CheckpointUploader(
            store, self.run_name, rank=ranks.rank, world_size=ranks.world_size,
            staging_root=os.path.join(cache_dir, "staging"), keep_latest_k=c.keep_latest_k,
            upload_timeout=c.upload_timeout_seconds, commit_timeout=c.commit_timeout_seconds,
            async_enabled=c.async_enabled, on_event=self.metrics.event,
            after_commit=self.metrics.flush)

    # ---- state ---------------------------------------------------------------------
    def resume(self, checkpoint_key: str) -> None:
        folder = rehydrate(self.store, checkpoint_key, self.cache_dir)
        state = load_checkpoint(folder, model=self.raw_model, optimizer=self.optimizer,
                                scheduler=self.scheduler, rank=self.ranks.rank)
        self.step, self.tokens_seen = state.step, state.tokens_seen
        self.last_saved_step = self.step
        self.metrics.log(events.Resumed(step=self.step, checkpoint=self.store.url(checkpoint_key)))

    def save(self) -> None:
        """Stage this step's state; upload and commit go on in the background."""
        t0 = time.perf_counter()
        meta = {"config_hash": self.cfg.identity_hash(), "model_hash": self.cfg.model_hash(),
                "shard_key": self.shard_key, "run_name": self.run_name,
                "tokens_seen": self.tokens_seen}
        state = to_host({**model_optim_tensors(self.raw_model, self.optimizer),
                         **rng_state_tensors(self.ranks.rank)}, self.pinned)
        scalars = scalar_state(self.optimizer, self.scheduler, self.step, self.tokens_seen,
                               self.cfg.train.seed)
        key = save_state(self.uploader, state, scalars, self.step, meta)
        self.last_saved_step, self.last_save_seconds = self.step, time.perf_counter() - t0
        self.metrics.log(events.CheckpointStaged(step=self.step, key=key,
                                                 seconds=round(self.last_save_seconds, 3)))

    # ---- steps ---------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step over grad_accum micro-batches; returns the mean loss."""
        cfg, r = self.cfg, self.ranks
        accum = cfg.grad_accum_steps
        self.model.train()
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(accum):
            x, y = train_batch(self.train_data, cfg.model.block_size, cfg.train.micro_batch_size,
                               cfg.train.seed, self.step, r.rank, micro)
            x, y = x.to(r.device), y.to(r.device)
            # DDP all-reduces gradients only on the last micro-batch (group: world)
            sync = nullcontext() if (micro == accum - 1 or not r.is_dist) else self.model.no_sync()
            with sync:
                _, loss = self.model(x, y)
                (loss / accum).backward()
            total += loss.detach().double().cpu()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += cfg.train.global_batch_size * cfg.model.block_size
        mean = total / accum
        if r.is_dist:
            dist.all_reduce(mean)  # group: world; report the loss averaged over all ranks
            mean /= r.world_size
        return float(mean)

    def _stop_early(self) -> None:
        """Asked to stop: checkpoint first when it fits in the grace period, then leave."""
        # a stop checkpoint must be staged, uploaded and committed inside the grace period;
        # estimate from the last one, with a margin
        expected = self.last_save_seconds + self.uploader.last_finish_seconds
        fits = expected * 1.5 + 1 < self.stop.seconds_left()
        if self.step != self.last_saved_step and fits:
            self.save()
        self.uploader.wait(timeout=max(0.0, self.stop.seconds_left()))
        self.metrics.log(events.Stopped(step=self.step, saved=self.last_saved_step == self.step))
        self.metrics.flush()
        raise Preempted(f"stopped by SIGTERM at step {self.step}")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over fixed windows, split across ranks."""
        cfg, r = self.cfg, self.ranks
        micro, T = cfg.train.micro_batch_size, cfg.model.block_size
        offsets = eval_offsets(self.val_data.num_tokens, T, cfg.eval.num_batches * micro * r.world_size)
        mine = offsets[r.rank :: r.world_size]
        self.raw_model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        for i in range(0, len(mine), micro):
            x, y = get_batch(self.val_data, T, mine[i : i + micro])
            _, loss = self.raw_model(x.to(r.device), y.to(r.device))
            sums += torch.tensor([float(loss) * len(x), len(x)], dtype=torch.float64)
        if r.is_dist:
            dist.all_reduce(sums)  # group: world; sum loss and window counts over ranks
        return float(sums[0] / sums[1])

    def fit(self) -> dict:
        failed = True
        try:
            result = self._fit()
            failed = False
            return result
        finally:
            # the last upload and commit finish before the process ends; after a failure a
            # peer may be gone for good (its receipt will never come), so wait only a little
            self.uploader.wait(timeout=FAILED_UPLOAD_WAIT_SECONDS if failed else None)
            self.metrics.flush()
            sys.stdout.flush()

    def _fit(self) -> dict:
        cfg = self.cfg
        t_start = time.time()
        if self.step == 0:
            val = self.evaluate()
            self.metrics.log(events.Eval(step=0, val_loss=val, val_ppl=math.exp(min(val, 50))))
        last_val = None
        while self.step < cfg.train.max_steps:
            if self.stop.agreed(self.ranks.is_dist):
                self._stop_early()
            maybe_inject(self.ranks.rank, self.step + 1)
            t0 = time.perf_counter()
            loss = self.train_step()
            dt = time.perf_counter() - t0
            s = self.step
            self.metrics.log(events.Step(step=s))  # the launcher's hang watchdog
            if s % cfg.train.log_interval == 0 or s == 1 or s == cfg.train.max_steps:
                self.metrics.log(events.Train(step=s, loss=loss, lr=self.scheduler.get_last_lr()[0],
                                              step_seconds=round(dt, 4), tokens_seen=self.tokens_seen))
            if s % cfg.eval.interval_steps == 0 or s == cfg.train.max_steps:
                last_val = self.evaluate()
                self.metrics.log(events.Eval(step=s, val_loss=last_val,
                                             val_ppl=math.exp(min(last_val, 50))))
            if s % cfg.checkpoint.interval_steps == 0 or s == cfg.train.max_steps:
                self.save()
        self.uploader.wait()
        self.metrics.log(events.Done(step=self.step, seconds=round(time.time() - t_start, 3),
                                     val_loss=last_val, failed_checkpoints=self.uploader.failures))
        return {"step": self.step, "val_loss": last_val}
