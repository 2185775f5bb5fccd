"""Turns the ranks' metric lines into log lines, a progress bar, the training result and,
for each committed checkpoint, an evaluation submitted while training goes on."""

from __future__ import annotations

import statistics
from typing import Callable

from core.results import EvalResult, TrainingResult


class TrainingMonitor:
    """Consumes metric records (dicts) from the launcher, one at a time."""

    def __init__(self, result: TrainingResult, max_steps: int, store_root: str, logger,
                 on_progress: Callable[[float], None], on_commit: Callable[[str, int], object] | None):
        self.result, self.max_steps, self.root, self.logger = result, max_steps, store_root, logger
        self.on_progress, self.on_commit = on_progress, on_commit
        self.last_pct = -1
        self.step_seconds: list[float] = []
        self.evaluations: list[tuple[int, object]] = []  # (step, future)

    def __call__(self, m: dict) -> None:
        handler = getattr(self, "_on_" + str(m.get("event")), None)
        if handler is not None:
            handler(m, m.get("step", 0))

    def _on_train(self, m: dict, step: int) -> None:
        self.result.train_losses.append((step, m["loss"]))
        self.step_seconds.append(m["step_seconds"])
        self.logger.info("step %d/%d  loss %.4f  lr %.2e  %.0f ms/step", step, self.max_steps,
                         m["loss"], m["lr"], 1000 * m["step_seconds"])
        pct = int(100 * step / self.max_steps)
        if pct != self.last_pct:
            self.on_progress(float(pct))
            self.last_pct = pct

    def _on_eval(self, m: dict, step: int) -> None:
        self.result.val_losses.append((step, m["val_loss"]))
        self.logger.info("step %d  validation loss %.4f  (perplexity %.1f)", step, m["val_loss"], m["val_ppl"])

    def _on_checkpoint(self, m: dict, step: int) -> None:
        key = m["uri"][len(self.root):].lstrip("/")
        r = self.result
        r.final_step, r.final_checkpoint_key, r.final_checkpoint_uri = step, key, m["uri"]
        r.checkpoints.append({"step": step, "uri": m["uri"], "bytes": m.get("bytes"),
                              "stage_seconds": m.get("stage_seconds"),
                              "upload_seconds": m.get("upload_seconds")})
        self.logger.info("checkpoint committed: %s (%.1f MB, staged in %.2fs, uploaded in %.2fs)",
                         m["uri"], (m.get("bytes") or 0) / 1e6, m.get("stage_seconds", 0),
                         m.get("upload_seconds", 0))
        if self.on_commit is not None and step < self.max_steps:  # the flow evaluates the last one
            self.evaluations.append((step, self.on_commit(key, step)))

    def _on_checkpoint_staged(self, m: dict, step: int) -> None:
        self.logger.info("checkpoint of step %d staged in %.2fs; uploading in the background", step, m["seconds"])

    def _on_upload_retry(self, m: dict, step: int) -> None:
        self.logger.warning("rank %s: upload of checkpoint %d failed (attempt %s), retrying: %s",
                            m.get("rank"), step, m.get("attempt"), m.get("error"))

    def _on_checkpoint_failed(self, m: dict, step: int) -> None:
        self.result.failed_checkpoints.append(step)
        self.logger.error("rank %s: checkpoint of step %d was given up and not committed: %s",
                          m.get("rank"), step, m.get("error"))

    def _on_failure(self, m: dict, step: int) -> None:
        self.logger.error("rank %s failed: %s: %s", m.get("rank"), m.get("type"), m.get("message"))

    def _on_resumed(self, m: dict, step: int) -> None:
        self.logger.info("ranks resumed at step %d from %s", step, m["checkpoint"])

    def _on_stopped(self, m: dict, step: int) -> None:
        self.logger.warning("ranks stopped at step %d (checkpoint written: %s)", step, m.get("saved"))

    def median_step_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    def collect_evaluations(self, timeout: float = 600) -> None:
        """Wait for the evaluations submitted during training; a failed one is logged."""
        for step, future in self.evaluations:
            try:
                ev: EvalResult = future.result(timeout=timeout)
                self.result.evaluations.append(ev)
            except Exception as err:  # an evaluation failing must not fail the training task
                self.logger.warning("evaluation of step %d failed: %s", step, err)
        self.evaluations = []
