"""Turns the ranks' events into log lines, a progress bar, the training result and, for
each committed checkpoint, an evaluation submitted while training goes on. Dispatch is by
the event's type."""

from __future__ import annotations

import statistics
from typing import Callable

from stoker.arithmetic.gains import changes_since_base, since_base_text
from stoker.contracts import events
from stoker.contracts.results import EvalResult, TrainingResult

THROUGHPUT_FIELDS = ("step", "step_seconds", "tokens_per_second", "mfu", "peak_memory_gb", "data_wait_share")


def throughput_text(e: events.Train) -> str:
    parts = []
    if e.tokens_per_second is not None:
        parts.append(f"{e.tokens_per_second:,.0f} tok/s")
    if e.mfu is not None:
        parts.append(f"MFU {100 * e.mfu:.1f}%")
    if e.peak_memory_gb is not None:
        parts.append(f"peak mem {e.peak_memory_gb:.1f} GB")
    if e.data_wait_share is not None:
        parts.append(f"data wait {100 * e.data_wait_share:.1f}%")
    return ("  " + ", ".join(parts)) if parts else ""


def mix_text(sources: dict) -> str:
    """Tokens and epochs per source of a mixture: 'web 1.2M tok (0.31 ep), docs ...'."""
    return ", ".join(f"{name} {_count(v['tokens'])} tokens ({v['epochs']:.3g} epochs)" for name, v in sources.items())


def _count(n: float) -> str:
    """1234 -> '1.23k', 4.5e9 -> '4.5G'."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def eta_text(steps_left: int, step_seconds: list[float]) -> str:
    """'  ETA 12m30s' from the median of the recent step times (empty when unknown)."""
    recent = sorted(step_seconds[-20:])
    if steps_left <= 0 or not recent:
        return ""
    seconds = int(steps_left * recent[len(recent) // 2])
    hours, rest = divmod(seconds, 3600)
    return f"  ETA {hours}h{rest // 60:02d}m" if hours else f"  ETA {rest // 60}m{rest % 60:02d}s"


class TrainingMonitor:
    """Consumes the launcher's events, one at a time."""

    def __init__(
        self,
        result: TrainingResult,
        max_steps: int,
        logger,
        on_progress: Callable[[float], None],
        on_commit: Callable[[str, int], object] | None,
        sink: Callable[[events.Event], None] | None = None,
    ):
        """`sink` also gets every record, and each checkpoint evaluation as an Evaluated record
        (observe.sinks: TensorBoard, MLflow)."""
        self.result, self.max_steps, self.logger = result, max_steps, logger
        self.on_progress, self.on_commit, self.sink = on_progress, on_commit, sink
        self.last_pct = -1
        # a run from a base: its step-0 evaluation record (the base's own), {} until it is seen;
        # None: no change since the base is told
        self.base_eval: dict | None = None
        self.step_seconds: list[float] = []
        self.evaluations: list[tuple[int, object]] = []  # (step, future)
        self.handlers: dict[type, Callable] = {
            events.Train: self._on_train,
            events.Eval: self._on_eval,
            events.CheckpointCommitted: self._on_checkpoint,
            events.CheckpointStaged: self._on_staged,
            events.UploadRetry: self._on_upload_retry,
            events.CheckpointFailed: self._on_checkpoint_failed,
            events.CheckpointDropped: self._on_checkpoint_dropped,
            events.Failure: self._on_failure,
            events.Resumed: self._on_resumed,
            events.Stopped: self._on_stopped,
            events.NonFinite: self._on_nonfinite,
            events.EpochLimit: self._on_epoch_limit,
            events.MicroBatchChosen: self._on_micro_batch,
            events.IdleExperts: self._on_idle_experts,
        }

    def __call__(self, event: events.Event) -> None:
        handler = self.handlers.get(type(event))
        if handler is not None:
            handler(event)
        if self.sink is not None:
            self.sink(event)

    def _on_train(self, e: events.Train) -> None:
        self.result.train_losses.append((e.step, e.loss))
        self.step_seconds.append(e.step_seconds)
        self.logger.info(
            "step %d/%d  loss %.4f  lr %.2e  %.0f ms/step%s%s",
            e.step,
            self.max_steps,
            e.loss,
            e.lr,
            1000 * e.step_seconds,
            throughput_text(e),
            eta_text(self.max_steps - e.step, self.step_seconds),
        )
        if e.tokens_per_second is not None:
            self.result.throughput.append({k: getattr(e, k) for k in THROUGHPUT_FIELDS})
        if e.sources:
            self.result.mix.append({"step": e.step, "sources": e.sources})
            self.logger.info("step %d  data seen: %s", e.step, mix_text(e.sources))
        pct = int(100 * e.step / self.max_steps)
        if pct != self.last_pct:
            self.on_progress(float(pct))
            self.last_pct = pct

    def _on_eval(self, e: events.Eval) -> None:
        self.result.val_losses.append((e.step, e.val_loss))
        bpb = f", {e.bits_per_byte:.4f} bits per byte" if e.bits_per_byte is not None else ""
        self.logger.info("step %d  validation loss %.4f  (perplexity %.1f%s)", e.step, e.val_loss, e.val_ppl, bpb)
        if e.sources:
            self.result.source_val_losses.append({"step": e.step, "losses": e.sources})
            self.logger.info(
                "step %d  validation loss per source: %s",
                e.step,
                ", ".join(f"{name} {loss:.4f}" for name, loss in e.sources.items()),
            )
        if self.base_eval is not None:  # a run from a base: its gain and forgetting so far
            if e.step == 0:
                self.base_eval = e.to_dict()
            elif self.base_eval:
                text = since_base_text(changes_since_base([self.base_eval, e.to_dict()]))
                if text:
                    self.logger.info("step %d  %s", e.step, text)

    def _on_micro_batch(self, e: events.MicroBatchChosen) -> None:
        self.result.micro_batch_size = e.micro_batch_size
        how = "confirmed by a probe step" if e.probed else "by the plan (no probe on CPUs)"
        lowered = f", lowered from the plan's {e.planned}" if e.planned != e.micro_batch_size else ""
        self.logger.info(
            "train.micro_batch_size 'auto': %d sequences a rank (x %d accumulated a step) on %s of %.1f GiB, %s%s",
            e.micro_batch_size,
            e.accum,
            e.device,
            e.device_memory_gib,
            how,
            lowered,
        )

    def _on_idle_experts(self, e: events.IdleExperts) -> None:
        self.logger.warning(
            "layer %d: the router sent no token to expert(s) %s for %d steps (to step %d); a collapsed router "
            "wastes them: raise model.router_aux_loss_coef, or lower train.lr",
            e.layer,
            ", ".join(str(x) for x in e.experts),
            e.steps,
            e.step,
        )

    def _on_epoch_limit(self, e: events.EpochLimit) -> None:
        self.result.epoch_limits.append({"step": e.step, "source": e.source, "epochs": e.epochs, "action": e.action})
        if e.action == "stop":
            self.logger.warning(
                "source %r reaches its max_epochs=%g at step %d (%.3f epochs): the run ends there, "
                "short of train.max_steps=%d",
                e.source,
                e.max_epochs,
                e.step,
                e.epochs,
                self.max_steps,
            )
        else:
            self.logger.warning(
                "source %r goes past its max_epochs=%g at step %d (%.3f epochs); training goes on "
                "(at_max_epochs: warn), repeating its windows in a new order",
                e.source,
                e.max_epochs,
                e.step,
                e.epochs,
            )

    def _on_checkpoint(self, e: events.CheckpointCommitted) -> None:
        key = e.key
        r = self.result
        r.final_step, r.final_checkpoint_key, r.final_checkpoint_uri = e.step, key, e.uri
        r.checkpoints.append(
            {
                "step": e.step,
                "uri": e.uri,
                "bytes": e.bytes,
                "stage_seconds": e.stage_seconds,
                "upload_seconds": e.upload_seconds,
            }
        )
        self.logger.info(
            "checkpoint committed: %s (%.1f MB, staged in %.2fs, uploaded in %.2fs)",
            e.uri,
            e.bytes / 1e6,
            e.stage_seconds,
            e.upload_seconds,
        )
        if self.on_commit is not None and e.step < self.max_steps:  # the flow evaluates the last one
            self.evaluations.append((e.step, self.on_commit(key, e.step)))

    def _on_staged(self, e: events.CheckpointStaged) -> None:
        self.logger.info("checkpoint of step %d staged in %.2fs; uploading in the background", e.step, e.seconds)

    def _on_upload_retry(self, e: events.UploadRetry) -> None:
        self.logger.warning(
            "rank %s: upload of checkpoint %d failed (attempt %s), retrying: %s", e.rank, e.step, e.attempt, e.error
        )

    def _on_checkpoint_failed(self, e: events.CheckpointFailed) -> None:
        self._failed(e.step)
        self.logger.error("rank %s: checkpoint of step %d was given up and not committed: %s", e.rank, e.step, e.error)

    def _on_checkpoint_dropped(self, e: events.CheckpointDropped) -> None:
        self._failed(e.step)
        self.logger.warning(
            "rank %s: checkpoint of step %d was dropped before its upload and not committed: %s",
            e.rank,
            e.step,
            e.reason,
        )

    def _failed(self, step: int) -> None:
        """A checkpoint never committed; every rank that gave it up says so, listed once."""
        if step not in self.result.failed_checkpoints:
            self.result.failed_checkpoints.append(step)

    def _on_failure(self, e: events.Failure) -> None:
        self.logger.error("rank %s failed: %s: %s", e.rank, e.type, e.message)

    def _on_resumed(self, e: events.Resumed) -> None:
        for url in e.passed_over:
            self.logger.warning("checkpoint %s failed the ranks' full check and is marked invalid", url)
        if self.result.train_losses:  # training had begun in this launch: torchrun restarted the ranks
            self.result.restarts += 1
            self.logger.warning(
                "a rank failed; the ranks were restarted in place and resumed at step %d from %s", e.step, e.checkpoint
            )
        else:
            self.logger.info("ranks resumed at step %d from %s", e.step, e.checkpoint)

    def _on_nonfinite(self, e: events.NonFinite) -> None:
        if e.action == "skipped":
            self.result.skipped_steps.append(e.step)
            self.logger.warning(
                "step %d: non-finite %s; its update was skipped (%d skipped so far, train.nonfinite=skip)",
                e.step,
                e.what,
                e.num_skipped,
            )
        else:
            self.logger.error(
                "non-finite %s at step %d (found at step %d): the run stops, and no "
                "checkpoint after step %d is committed",
                e.what,
                e.first_step,
                e.step,
                e.first_step - 1,
            )

    def _on_stopped(self, e: events.Stopped) -> None:
        self.logger.warning(
            "ranks stopped at step %d (stop checkpoint uploaded in the grace period: %s)", e.step, e.saved
        )

    def median_step_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    def collect_evaluations(self, timeout: float = 600) -> None:
        """Wait for the evaluations submitted during training; a failed one is logged."""
        for step, future in self.evaluations:
            try:
                ev: EvalResult = future.result(timeout=timeout)
                self.result.evaluations.append(ev)
                if self.sink is not None:
                    self.sink(ev.to_event())
            except Exception as err:  # an evaluation failing must not fail the training task
                self.logger.warning("evaluation of step %d failed: %s", step, err)
        self.evaluations = []
