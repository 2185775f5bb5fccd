"""The training loop every rank runs: DDP or FSDP2, AdamW, warmup+cosine, accumulation,
clipping, periodic evaluation and checkpoints, throughput metrics. Plain torch; no orchestrator.
The process group, the rank facts, the collectives and the stop vote are training.distributed's;
the events, metrics.jsonl and throughput are training.metrics'.

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
import sys
import time

import torch
import torch.distributed as dist

from stoker.arithmetic import schedule
from stoker.arithmetic.token_bytes import BitsPerByteUnsupported, token_byte_counts
from stoker.config import RunConfig
from stoker.config.data import DEFAULT_SOURCE_NAME
from stoker.contracts import events
from stoker.failures import CheckpointInvalid
from stoker.families import spec_of
from stoker.families.moe import RouterLoad
from stoker.storage.branches import branch_point, mixture_history
from stoker.storage.checkpoints import find_latest_valid, mark_invalid, rehydrate
from stoker.storage.layout import TOKENIZER_FILE
from stoker.storage.store import Store
from stoker.storage.uploader import CheckpointUploader
from stoker.training.checkpoint import Checkpointer, agree_on_checkpoint, load_checkpoint, seed_rank_rngs
from stoker.training.data import Batches, TokenStream, TrainWindows, eval_offsets, get_batch
from stoker.training.distributed import Preempted, RankInfo, StopRequest, all_ranks_agree, mean_over_ranks
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
from stoker.training.metrics import MetricsLog, Throughput
from stoker.training.micro_batch import settle as settle_micro_batch
from stoker.training.numerics import FINITE, NumericsGuard, count_nonfinite_tensors, state_tensors
from stoker.training.parallel import clip_grad_norm_sharded, data_parallel
from stoker.training.scoring import HeldOut, add_window_scores, token_nll

FAILED_UPLOAD_WAIT_SECONDS = 10.0


def lr_multiplier(step: int, cfg: RunConfig) -> float:
    """train.lr_schedule's multiplier of train.lr at this step (arithmetic.schedule)."""
    return schedule.lr_multiplier(step, cfg.train)


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        ranks: RankInfo,
        shard_dirs: dict[str, str] | str,
        store: Store,
        shard_key: str = "",
        cache_dir: str = "/tmp/stoker-cache",
        from_base: bool = False,
    ):
        """shard_dirs: each source's local shard folder (one folder: data.source). from_base:
        the run starts from its base model (start_from_base follows), so the model is built
        without random initial values."""
        self.cfg, self.ranks, self.store, self.shard_key = cfg, ranks, store, shard_key
        self.cache_dir = cache_dir
        self.run_name = cfg.resolved_run_name()
        configure_backends(cfg, ranks.device)
        self.engine = Engine.resolve(cfg, ranks.device)
        # the data split: over the "dp" coordinate of the mesh (under tensor parallel the ranks
        # of one group read the same batches); with no tensor parallel, (rank, world_size)
        self.dp_rank, self.dp_size = data_parallel(ranks.rank, ranks.world_size, self.engine.tp)
        if isinstance(shard_dirs, str):
            shard_dirs = {DEFAULT_SOURCE_NAME: shard_dirs}
        self.windows = TrainWindows.of_run(
            cfg, {n: TokenStream(d, "train") for n, d in shard_dirs.items()}, mixture_history(store, self.run_name)
        )
        self.val_data = {n: TokenStream(shard_dirs[n], "val") for n in self.windows.names}
        self.mixture = cfg.data.is_mixture()
        self.end_step, self.warn_at = self._epoch_limits()
        self.raw_model, self.model = build_model(
            cfg, self.windows.streams[0].vocab_size, self.engine, ranks.world_size, init=not from_base
        )
        self.raw_model.document_end_id = self.windows.streams[0].eot_id  # the separator of model.attention 'document'
        self.byte_counts = self._in_loop_byte_counts(next(iter(shard_dirs.values())))
        self.optimizer = build_optimizer(cfg, self.raw_model, self.engine)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_multiplier(s, cfg))
        # per-rank streams (dropout, anything drawing from numpy or random): every RNG is
        # a function of (seed, rank) and is saved and restored with each checkpoint
        seed_rank_rngs(cfg.train.seed, ranks.rank, 0, ranks.device)
        self.step, self.tokens_seen = 0, 0
        self.step_lr = 0.0  # the learning rate the last step used (train_step)
        self.last_saved_step = -1
        self.metrics = MetricsLog(store, self.run_name, ranks.rank)
        # train.micro_batch_size 'auto' settled, the model built (a probe step on a GPU)
        cfg = self.cfg = settle_micro_batch(
            cfg, self.model, self.engine, self.windows.streams[0].vocab_size, ranks.rank == 0, self.metrics.event
        )
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
            # a run that may be trained longer keeps its newest checkpoint before its decay
            train=cfg.train,
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
            self.windows,
            micro_batch=cfg.train.micro_batch_size,
            rank=self.dp_rank,
            accum=cfg.grad_accum_steps,
            device=ranks.device,
            prefetch=self.engine.prefetch,
        )
        self.flops_per_token = self.raw_model.flops_per_token()  # a mixture's: of its active parameters
        self.peak_flops = peak_flops(ranks.device)
        # a mixture of experts: its loss's language-model and load-balancing parts, the router's load
        self.router = RouterLoad(cfg.model.sparse_layers(), cfg.model.num_experts) if spec_of(cfg.model).moe else None
        self.moe_losses = torch.zeros(2, dtype=torch.float32, device=ranks.device)
        self.last_log_step = 0
        self.throughput = Throughput(
            cfg, ranks, self.flops_per_token, self.peak_flops, lambda: self.batches.wait_seconds
        )

    def _epoch_limits(self) -> tuple[int, dict[int, list[tuple[str, float]]]]:
        """The step the run ends at (train.max_steps, or sooner where a source's max_epochs
        says 'stop') and the steps at which a 'warn' source goes past its limit."""
        max_steps, end, warn = self.cfg.train.max_steps, self.cfg.train.max_steps, {}
        self.stops_for: tuple[str, float] | None = None
        for i, source in enumerate(self.cfg.data.sources):
            if source.max_epochs is None:
                continue
            last = self.windows.mixture.last_step_within(i, source.max_epochs, max_steps)
            if last >= max_steps:
                continue
            if source.at_max_epochs == "stop" and last < end:
                end, self.stops_for = last, (source.name, source.max_epochs)
            elif source.at_max_epochs == "warn":
                warn.setdefault(last + 1, []).append((source.name, source.max_epochs))
        return end, warn

    # ---- state ---------------------------------------------------------------------
    def resume(self, checkpoint_key: str) -> None:
        """Load this checkpoint after every host's full check of its bytes (rehydrate). When a
        host finds it damaged (it is then marked invalid in the store), every rank falls back
        together to the next valid checkpoint of this run and model; a checkpoint of another
        run or model is refused (ConfigError) before any byte is read."""
        expected = {"run_name": self.run_name, "model_hash": self.cfg.model_hash()}
        point = branch_point(self.cfg)
        if point is not None and checkpoint_key == point[0]:  # a branch's start: its parent's checkpoint
            expected["run_name"] = point[1]
        key, passed_over = checkpoint_key, []
        while True:
            problem = ""
            try:
                folder = rehydrate(self.store, key, self.cache_dir, expected=expected)
            except CheckpointInvalid as err:
                problem = str(err)
            if all_ranks_agree(not problem, self.ranks):
                state = self._load(folder)
                # written before stoker checked numerics at save time: the loaded weights are
                # checked here (a resume never goes on from NaN weights)
                if all_ranks_agree(not self._state_nonfinite(), self.ranks):
                    break
                problem = "holds NaN/inf weights or optimizer state"
                mark_invalid(self.store, key, problem)
            passed_over.append(self.store.url(key))
            choice = find_latest_valid(self.store, self.run_name, expected, self.cfg.train)  # skips the marked one
            if choice.checkpoint is None or choice.checkpoint.key == key:
                raise CheckpointInvalid(
                    problem
                    or f"checkpoint {self.store.url(key)} failed the "
                    "full check on another host, and no valid one is left"
                )
            key = choice.checkpoint.key
        self.step, self.tokens_seen = state.step, state.tokens_seen
        self.last_saved_step = self.step
        self._apply_schedule()
        self.metrics.log(
            events.Resumed(
                step=self.step, checkpoint=self.store.url(key), rng_restored=state.rng_restored, passed_over=passed_over
            )
        )

    def _apply_schedule(self) -> None:
        """The learning rate of this config's schedule at the loaded step, whatever the
        checkpoint's schedule was (a run trained longer, a branch with another lr or decay): the
        same value, bit for bit, that the scheduler's step gives a run that never stopped."""
        lr = self.cfg.train.lr
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * lr_multiplier(self.step, self.cfg)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def start_from_base(self) -> None:
        """The run's first start (no valid checkpoint): the base's weights (model.init_from),
        each rank reading only its own slices; the optimizer and schedule start fresh."""
        from stoker.storage.bases import materialize_base
        from stoker.training.base import load_base

        model = self.cfg.model
        began = time.monotonic()
        folder = materialize_base(
            model.init_from, model.base_sha256, self.store, self.cache_dir, self.cfg.storage.storage_options
        )
        mine = load_base(self.raw_model, model, folder)
        read = [mine]
        if dist.is_initialized():  # group: world; once, at start: what each rank read, for rank 0's log
            read = [None] * self.ranks.world_size
            dist.all_gather_object(read, mine)
        self.metrics.log(
            events.BaseLoaded(
                base=model.init_from,
                sha256=model.base_sha256,
                bytes_read=read,
                seconds=round(time.monotonic() - began, 3),
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
            "model_family": self.cfg.model.family,
            "base_sha256": self.cfg.model.base_sha256,  # the base the run started from (None: random)
            "shard_key": self.shard_key,
            "run_name": self.run_name,
            "schedule": schedule.signature(self.cfg.train),  # where a run trained longer may go on from
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
        parts = torch.zeros(2, dtype=torch.float32, device=r.device)  # a mixture's (lm, load balancing)
        for micro in range(accum):
            x, y = self.batches.get(self.step, micro)
            # gradients are reduced only on the last micro-batch (group: world)
            with grad_sync(self.model, micro == accum - 1 or not r.is_dist):
                with engine.autocast():
                    _, loss = self.model(x, y)
                (loss / accum).backward()
            self.batches.prefetch(self.step, micro)  # while the device runs this micro-batch
            total += loss.detach().float()
            if self.router is not None and self.raw_model.last_losses is not None:
                parts += torch.stack(self.raw_model.last_losses).float()
        grad_norm = None
        if cfg.train.grad_clip > 0:  # the global norm, a device tensor (FSDP2: a DTensor)
            if engine.ep > 1:  # gradients on two meshes, which torch's clip does not take together
                grad_norm = clip_grad_norm_sharded(list(self.raw_model.parameters()), cfg.train.grad_clip)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.train.grad_clip)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # without clipping, a non-finite gradient shows in the next step's loss, and the
        # weights are checked before every save
        self.skipped_last = self.numerics.check_step(self.step + 1, total, grad_norm)
        # the rate this step uses (logged as its own): scheduler.step() below sets the next step's
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        if not self.skipped_last:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += cfg.train.global_batch_size * cfg.model.block_size
        self.moe_losses = parts / accum
        return total / accum

    def _router_at_log_step(self, step: int) -> dict:
        """A mixture's Train fields at a log step: its loss's two parts and the router's load
        over the interval (summed over ranks: one more all-reduce of a log step), and the
        experts idle for IDLE_WARN_STEPS steps (events.IdleExperts). Empty for a dense model."""
        if self.router is None:
            return {}
        load = self.raw_model.take_router_load()
        parts = self.moe_losses.clone()
        if self.ranks.is_dist:
            dist.all_reduce(load)  # group: world; assignments summed over ranks
            dist.all_reduce(parts)  # group: world
            parts /= self.ranks.world_size
        for layer, experts, steps in self.router.step(load, step - self.last_log_step):
            self.metrics.log(events.IdleExperts(step=step, layer=layer, experts=experts, steps=steps))
        self.last_log_step = step
        lm, aux = (float(v) for v in parts)
        return {"lm_loss": lm, "aux_loss": aux, "expert_load": self.router.shares(load)}

    def _stop_early(self) -> None:
        """Asked to stop: checkpoint first when it fits in the grace period, then leave."""
        # a stop checkpoint must be written, uploaded and committed inside the grace period;
        # estimate from the last one, with a margin
        expected = self.checkpointer.last_stall_seconds + self.uploader.last_finish_seconds
        fits = expected * 1.5 + 1 < self.stop.seconds_left()
        if self.step != self.last_saved_step and fits:
            self.save()
        # saved: written here and every upload done in the grace (on rank 0: committed); an
        # upload still running when the grace runs out is cut short and never committed
        finished = self.uploader.wait(timeout=max(0.0, self.stop.seconds_left()))
        self.metrics.log(events.Stopped(step=self.step, saved=finished and self.last_saved_step == self.step))
        self.metrics.flush()
        raise Preempted(f"stopped by SIGTERM at step {self.step}")

    @torch.no_grad()
    def evaluate(self) -> tuple[float, dict[str, float] | None, dict[str, float] | None]:
        """Mean validation loss over fixed windows of each source's validation split, split
        across ranks: (the mean over sources, each source's loss, or None for one source, and
        each source's bits per byte of the same windows, or None where not measured)."""
        scored = {name: self._evaluate(val) for name, val in self.val_data.items()}
        losses = {name: loss for name, (loss, _) in scored.items()}
        bpbs = {name: bpb for name, (_, bpb) in scored.items() if bpb is not None}
        mean = sum(losses.values()) / len(losses)
        return mean, (losses if self.mixture else None), (bpbs if len(bpbs) == len(losses) else None)

    def _evaluate(self, val: TokenStream) -> tuple[float, float | None]:
        cfg, r = self.cfg, self.ranks
        micro, T = cfg.train.micro_batch_size, cfg.model.block_size
        offsets = eval_offsets(val.num_tokens, T, cfg.eval.num_batches * micro * self.dp_size)
        mine = offsets[self.dp_rank :: self.dp_size]  # a tensor-parallel group: the same windows
        self.model.eval()
        byte_counts = self.byte_counts
        sums = torch.zeros(4, dtype=torch.float64, device=r.device)  # loss x windows, windows, counted nll, bytes
        for i in range(0, len(mine), micro):
            x, y = get_batch(val, T, mine[i : i + micro])
            x, y = x.to(r.device), y.to(r.device)
            with self.engine.autocast():
                # the step's module: under FSDP2 only it gathers the sharded parameters
                _, loss = self.model(x, y)
            sums[0] += loss.double() * len(x)
            sums[1] += len(x)
            if byte_counts is not None:  # the bits per byte of the same windows, as the evaluation counts them
                held = HeldOut()
                add_window_scores(held, token_nll(self.model, x, y, self.engine.autocast), y, byte_counts, x)
                sums[2] += held.counted_nll
                sums[3] += held.num_bytes
        if r.is_dist:  # under tensor parallel each group's sums come tp times: the ratios stay
            dist.all_reduce(sums)  # group: world; sum losses, window counts, nats and bytes over ranks
        bpb = float(sums[2] / (math.log(2) * sums[3])) if byte_counts is not None and sums[3] > 0 else None
        return float(sums[0] / sums[1]), bpb

    def _in_loop_byte_counts(self, shard_dir: str):
        """The byte counts of the shards' tokenizer, for the in-loop bits per byte of a run from
        a base with 'bpb' in eval.sets (its change since the base); None otherwise, or where
        the tokenizer's tokens cannot be counted in bytes exactly."""
        cfg = self.cfg
        if "bpb" not in cfg.eval.sets or not getattr(cfg.model, "init_from", None):
            return None
        from tokenizers import Tokenizer

        try:
            counts = token_byte_counts(
                Tokenizer.from_file(os.path.join(shard_dir, TOKENIZER_FILE)), self.windows.streams[0].vocab_size
            )
        except (BitsPerByteUnsupported, OSError):
            return None
        return torch.from_numpy(counts).to(self.ranks.device)

    def _log_eval(self, step: int, val: float, sources: dict | None, seconds: float, bpbs: dict | None = None) -> None:
        self.metrics.log(
            events.Eval(
                step=step,
                val_loss=val,
                val_ppl=math.exp(min(val, 50)),
                seconds=round(seconds, 4),
                sources={n: round(v, 6) for n, v in sources.items()} if sources else None,
                bits_per_byte=round(sum(bpbs.values()) / len(bpbs), 6) if bpbs else None,
                sources_bpb={n: round(v, 6) for n, v in bpbs.items()} if bpbs and self.mixture else None,
            )
        )

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

    def _fit(self) -> dict:
        cfg = self.cfg
        t_start = time.time()
        end = self.end_step
        if self.step == 0:
            t_eval = time.perf_counter()
            val, sources, bpbs = self.evaluate()
            self._log_eval(0, val, sources, time.perf_counter() - t_eval, bpbs)
        last_val = None
        decay_start = schedule.decay_start(cfg.train)
        self.throughput.restart(self.step)
        if self.step < end < cfg.train.max_steps:
            name, limit = self.stops_for
            epochs = self.windows.seen(end)[name]["epochs"]
            self.metrics.log(events.EpochLimit(step=end, source=name, epochs=epochs, max_epochs=limit, action="stop"))
        while self.step < end:
            if self.stop.agreed():
                self._stop_early()
            if settles_before(self.step + 1):
                self.uploader.wait()
            maybe_inject(self.ranks.rank, self.step + 1, self.raw_model)
            loss = self.train_step()
            s = self.step
            self.metrics.log(events.Step(step=s))  # the launcher's hang watchdog
            for name, limit in self.warn_at.get(s, []):
                epochs = self.windows.seen(s)[name]["epochs"]
                self.metrics.log(events.EpochLimit(step=s, source=name, epochs=epochs, max_epochs=limit, action="warn"))
            log_step = s % cfg.train.log_interval == 0 or s == 1 or s == end
            if log_step and not self.skipped_last:  # a skipped step's NaN is told by its NonFinite
                mean = mean_over_ranks(loss, self.ranks)  # the one host sync of a log step
                self.numerics.raise_if_bad(s)  # before a NaN loss is logged as if all were well
                moe = self._router_at_log_step(s)
                self.metrics.log(
                    events.Train(
                        step=s,
                        loss=mean,
                        lr=float(self.step_lr),
                        tokens_seen=self.tokens_seen,
                        sources=self.windows.seen(s) if self.mixture else None,
                        **moe,
                        **self.throughput.since_mark(s),
                    )
                )
                self.throughput.restart(s)
            if s % cfg.eval.interval_steps == 0 or s == end:
                self.numerics.raise_if_bad(s)  # evaluation syncs anyway: no NaN val loss reported
                t_eval = time.perf_counter()
                last_val, sources, bpbs = self.evaluate()
                seconds = time.perf_counter() - t_eval
                self._log_eval(s, last_val, sources, seconds, bpbs)
                # throughput is of training: the evaluation's time is left out of the interval
                self.throughput.leave_out(seconds)
            # every interval, at the end, and where a 'wsd' decay begins (a run trained longer goes on from it)
            if s % cfg.checkpoint.interval_steps == 0 or s == end or s == decay_start:
                t_save = time.perf_counter()
                self.save()
                self.throughput.checkpoint(time.perf_counter() - t_save)  # the ledger's checkpoint stall
        t_wait = time.perf_counter()
        self.uploader.wait()
        self.throughput.checkpoint(time.perf_counter() - t_wait)  # the last commit holds the run's end
        self.metrics.log(
            events.Done(
                step=self.step,
                seconds=round(time.time() - t_start, 3),
                val_loss=last_val,
                failed_checkpoints=self.uploader.failures,
                **self.throughput.account(),
            )
        )
        return {"step": self.step, "val_loss": last_val}
