"""The training loop every rank runs: DDP or FSDP2, AdamW, warmup+cosine, accumulation,
clipping, periodic evaluation and checkpoints, throughput metrics. Plain torch; no orchestrator.

The step never waits for the host: the loss and token counts stay on the device and are
read (one sync) only on log steps; collectives reduce device tensors on the world group
(NCCL or gloo), and control traffic (the stop vote, the checkpoint writer) goes through
gloo side groups made once at start.

Numerics (training.numerics): each step checks its loss and gradient norm on the device; the
verdict is read on log steps, before evaluations and before saves (train.nonfinite=fail), or
once per step (skip). A state holding NaN/inf is never saved, and a resume never goes on from
one (the loaded weights of a checkpoint are checked; a bad one is marked invalid and passed over).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stoker.core import events
from stoker.core.config import RunConfig
from stoker.core.failures import CheckpointInvalid
from stoker.storage.checkpoints import find_latest_valid, mark_invalid, rehydrate
from stoker.storage.layout import METRICS_FILE, run_file_key
from stoker.storage.store import Store
from stoker.storage.uploader import CheckpointUploader
from stoker.training.checkpoint import Checkpointer, agree_on_checkpoint, load_checkpoint, seed_rank_rngs
from stoker.training.data import Batches, TokenStream, eval_offsets, get_batch
from stoker.training.engine import (
    Engine,
    build_model,
    build_optimizer,
    configure_backends,
    grad_sync,
    peak_flops,
    side_group,
)
from stoker.training.faults import maybe_inject, settles_before
from stoker.training.numerics import FINITE, NumericsGuard, count_nonfinite_tensors, state_tensors

_STDOUT_LOCK = threading.Lock()


def emit(event: events.Event) -> None:
    """Print an event's wire line whole: one write under a lock, so lines printed from the
    training and upload threads never cut into each other."""
    with _STDOUT_LOCK:
        sys.stdout.write(event.encode() + "\n")
        sys.stdout.flush()


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
FAILED_UPLOAD_WAIT_SECONDS = 10.0


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


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        ranks: RankInfo,
        shard_dir: str,
        store: Store,
        shard_key: str = "",
        cache_dir: str = "/tmp/stoker-cache",
    ):
        self.cfg, self.ranks, self.store, self.shard_key = cfg, ranks, store, shard_key
        self.cache_dir = cache_dir
        self.run_name = cfg.resolved_run_name()
        configure_backends(cfg, ranks.device)
        self.engine = Engine.resolve(cfg, ranks.device)
        self.train_data = TokenStream(shard_dir, "train")
        self.val_data = TokenStream(shard_dir, "val")
        self.raw_model, self.model = build_model(cfg, self.train_data.vocab_size, self.engine, ranks.world_size)
        self.optimizer = build_optimizer(cfg, self.raw_model, self.engine)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_multiplier(s, cfg))
        # per-rank streams (dropout, anything drawing from numpy or random): every RNG is
        # a function of (seed, rank) and is saved and restored with each checkpoint
        seed_rank_rngs(cfg.train.seed, ranks.rank, 0, ranks.device)
        self.step, self.tokens_seen = 0, 0
        self.last_saved_step = -1
        self.metrics = MetricsLog(store, self.run_name, ranks.rank)
        self.numerics = NumericsGuard(cfg.train, ranks.device, ranks.is_dist, self._log_now)
        self.skipped_last = False  # whether the last step's update was dropped (nonfinite=skip)
        # made once, in the same order on every rank: the stop vote's and the checkpoint
        # writer's gloo groups (the writer runs on the upload thread)
        self.stop = StopRequest(side_group())
        ckpt_group = side_group()
        c = cfg.checkpoint
        self.uploader = CheckpointUploader(
            store,
            self.run_name,
            rank=ranks.rank,
            world_size=ranks.world_size,
            staging_root=os.path.join(cache_dir, "staging"),
            keep_latest_k=c.keep_latest_k,
            upload_timeout=c.upload_timeout_seconds,
            commit_timeout=c.commit_timeout_seconds,
            async_enabled=c.async_enabled,
            max_pending_uploads=c.max_pending_uploads,
            on_event=self.metrics.event,
            after_commit=self.metrics.flush,
            agree=agree_on_checkpoint(ckpt_group),
            cache_dir=cache_dir,
            pin_evaluations=cfg.eval.per_checkpoint_enabled,
            pin_seconds=c.evaluation_pin_seconds,
        )
        self.checkpointer = Checkpointer(
            self.uploader,
            self.raw_model,
            self.optimizer,
            self.scheduler,
            rank=ranks.rank,
            world_size=ranks.world_size,
            device=ranks.device,
            seed=cfg.train.seed,
            global_batch_size=cfg.train.global_batch_size,
            group=ckpt_group,
        )
        self.batches = Batches(
            self.train_data,
            block_size=cfg.model.block_size,
            micro_batch=cfg.train.micro_batch_size,
            seed=cfg.train.seed,
            rank=ranks.rank,
            accum=cfg.grad_accum_steps,
            world_size=ranks.world_size,
            device=ranks.device,
            prefetch=self.engine.prefetch,
        )
        self.flops_per_token = self.raw_model.flops_per_token()
        self.peak_flops = peak_flops(ranks.device)

    # ---- state ---------------------------------------------------------------------
    def resume(self, checkpoint_key: str) -> None:
        """Load this checkpoint after every host's full check of its bytes (rehydrate). When a
        host finds it damaged (it is then marked invalid in the store), every rank falls back
        together to the next valid checkpoint of this run and model; a checkpoint of another
        run or model is refused (ConfigError) before any byte is read."""
        expected = {"run_name": self.run_name, "model_hash": self.cfg.model_hash()}
        key, passed_over = checkpoint_key, []
        while True:
            problem = ""
            try:
                folder = rehydrate(self.store, key, self.cache_dir, expected=expected)
            except CheckpointInvalid as err:
                problem = str(err)
            if self._all_ranks_agree(not problem):
                state = self._load(folder)
                # written before stoker checked numerics at save time: the loaded weights are
                # checked here (a resume never goes on from NaN weights)
                if self._all_ranks_agree(not self._state_nonfinite()):
                    break
                problem = "holds NaN/inf weights or optimizer state"
                mark_invalid(self.store, key, problem)
            passed_over.append(self.store.url(key))
            choice = find_latest_valid(self.store, self.run_name, expected)  # skips the marked one
            if choice.checkpoint is None or choice.checkpoint.key == key:
                raise CheckpointInvalid(
                    problem
                    or f"checkpoint {self.store.url(key)} failed the "
                    "full check on another host, and no valid one is left"
                )
            key = choice.checkpoint.key
        self.step, self.tokens_seen = state.step, state.tokens_seen
        self.last_saved_step = self.step
        self.metrics.log(
            events.Resumed(
                step=self.step, checkpoint=self.store.url(key), rng_restored=state.rng_restored, passed_over=passed_over
            )
        )

    def _load(self, folder: str):
        r = self.ranks
        return load_checkpoint(
            folder,
            model=self.raw_model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            rank=r.rank,
            world_size=r.world_size,
            device=r.device,
            seed=self.cfg.train.seed,
        )

    def _state_nonfinite(self) -> bool:
        tensors = state_tensors(self.raw_model, self.optimizer)
        return bool(count_nonfinite_tensors(tensors, self.ranks.device))

    def _all_ranks_agree(self, ok: bool) -> bool:
        if not self.ranks.is_dist:
            return ok
        flag = torch.tensor([1 if ok else 0], device=self.ranks.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # group: world; one verdict for all ranks
        return bool(flag.item())

    def _log_now(self, event: events.Event) -> None:
        """A numerics verdict is stored at once: the run may end right after it."""
        self.metrics.log(event)
        self.metrics.flush()

    def save(self) -> None:
        """Copy this step's state to host buffers; the write, upload and commit go on in the
        background (checkpoint.async_enabled) or before this returns. A state holding NaN/inf
        (or a run that went non-finite since the last check) is never saved: NonFiniteError."""
        self.numerics.raise_if_bad(self.step)
        self.numerics.check_state(self.step, self.raw_model, self.optimizer)
        meta = {
            "numerics": FINITE,  # checked just above: storage trusts only this field
            "config_hash": self.cfg.identity_hash(),
            "model_hash": self.cfg.model_hash(),
            "shard_key": self.shard_key,
            "run_name": self.run_name,
            "tokens_seen": self.tokens_seen,
            "engine": self.engine.describe(),
        }
        self.checkpointer.save(self.step, self.tokens_seen, meta)
        self.last_saved_step = self.step

    # ---- steps ---------------------------------------------------------------------
    def train_step(self) -> torch.Tensor:
        """One optimizer step over grad_accum micro-batches; returns this rank's mean loss as
        a device tensor (reading it is a host sync: only log steps do)."""
        cfg, r, engine = self.cfg, self.ranks, self.engine
        accum = cfg.grad_accum_steps
        self.model.train()
        total = torch.zeros((), dtype=torch.float32, device=r.device)
        for micro in range(accum):
            x, y = self.batches.get(self.step, micro)
            # gradients are reduced only on the last micro-batch (group: world)
            with grad_sync(self.model, micro == accum - 1 or not r.is_dist):
                with engine.autocast():
                    _, loss = self.model(x, y)
                (loss / accum).backward()
            self.batches.prefetch(self.step, micro)  # while the device runs this micro-batch
            total += loss.detach().float()
        grad_norm = None
        if cfg.train.grad_clip > 0:  # the global norm, a device tensor (FSDP2: a DTensor)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.train.grad_clip)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # without clipping, a non-finite gradient shows in the next step's loss, and the
        # weights are checked before every save
        self.skipped_last = self.numerics.check_step(self.step + 1, total, grad_norm)
        if not self.skipped_last:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += cfg.train.global_batch_size * cfg.model.block_size
        return total / accum

    def _mean_over_ranks(self, loss: torch.Tensor) -> float:
        if self.ranks.is_dist:
            loss = loss.clone()
            dist.all_reduce(loss)  # group: world; the loss averaged over all ranks
            loss /= self.ranks.world_size
        return float(loss)

    def _stop_early(self) -> None:
        """Asked to stop: checkpoint first when it fits in the grace period, then leave."""
        # a stop checkpoint must be written, uploaded and committed inside the grace period;
        # estimate from the last one, with a margin
        expected = self.checkpointer.last_stall_seconds + self.uploader.last_finish_seconds
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
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=r.device)
        for i in range(0, len(mine), micro):
            x, y = get_batch(self.val_data, T, mine[i : i + micro])
            with self.engine.autocast():
                # the step's module: under FSDP2 only it gathers the sharded parameters
                _, loss = self.model(x.to(r.device), y.to(r.device))
            sums[0] += loss.double() * len(x)
            sums[1] += len(x)
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
            # after a failure rank 0 may never commit: do not wait for it then
            self.uploader.release_host_files(wait_seconds=0.0 if failed else 30.0)
            if not failed:
                self.stop.drain()
            self.batches.close()
            self.metrics.flush()
            sys.stdout.flush()

    def _throughput(self, mark: tuple[int, float, float]) -> dict:
        """Throughput since mark = (step, perf_counter, data wait seconds); call after a sync."""
        steps, seconds = self.step - mark[0], time.perf_counter() - mark[1]
        if steps <= 0 or seconds <= 0:
            return {"step_seconds": 0.0}
        cfg, r = self.cfg, self.ranks
        tps = steps * cfg.train.global_batch_size * cfg.model.block_size / seconds
        out = {
            "step_seconds": round(seconds / steps, 4),
            "tokens_per_second": round(tps, 1),
            "data_wait_share": round(min(1.0, (self.batches.wait_seconds - mark[2]) / seconds), 4),
        }
        if self.peak_flops:
            out["mfu"] = round(self.flops_per_token * tps / (self.peak_flops * r.world_size), 4)
        if r.device.type == "cuda":
            out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(r.device) / 1e9, 2)
        return out

    def _fit(self) -> dict:
        cfg = self.cfg
        t_start = time.time()
        if self.step == 0:
            val = self.evaluate()
            self.metrics.log(events.Eval(step=0, val_loss=val, val_ppl=math.exp(min(val, 50))))
        last_val = None
        mark = (self.step, time.perf_counter(), self.batches.wait_seconds)
        while self.step < cfg.train.max_steps:
            if self.stop.agreed():
                self._stop_early()
            if settles_before(self.step + 1):
                self.uploader.wait()
            maybe_inject(self.ranks.rank, self.step + 1, self.raw_model)
            loss = self.train_step()
            s = self.step
            self.metrics.log(events.Step(step=s))  # the launcher's hang watchdog
            log_step = s % cfg.train.log_interval == 0 or s == 1 or s == cfg.train.max_steps
            if log_step and not self.skipped_last:  # a skipped step's NaN is told by its NonFinite
                mean = self._mean_over_ranks(loss)  # the one host sync of a log step
                self.numerics.raise_if_bad(s)  # before a NaN loss is logged as if all were well
                self.metrics.log(
                    events.Train(
                        step=s,
                        loss=mean,
                        lr=self.scheduler.get_last_lr()[0],
                        tokens_seen=self.tokens_seen,
                        **self._throughput(mark),
                    )
                )
                mark = (s, time.perf_counter(), self.batches.wait_seconds)
            if s % cfg.eval.interval_steps == 0 or s == cfg.train.max_steps:
                self.numerics.raise_if_bad(s)  # evaluation syncs anyway: no NaN val loss reported
                t_eval = time.perf_counter()
                last_val = self.evaluate()
                self.metrics.log(events.Eval(step=s, val_loss=last_val, val_ppl=math.exp(min(last_val, 50))))
                # throughput is of training: the evaluation's time is left out of the interval
                mark = (mark[0], mark[1] + time.perf_counter() - t_eval, mark[2])
            if s % cfg.checkpoint.interval_steps == 0 or s == cfg.train.max_steps:
                self.save()
        self.uploader.wait()
        self.metrics.log(
            events.Done(
                step=self.step,
                seconds=round(time.time() - t_start, 3),
                val_loss=last_val,
                failed_checkpoints=self.uploader.failures,
            )
        )
        return {"step": self.step, "val_loss": last_val}
