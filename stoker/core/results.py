"""Typed results the tasks hand to each other and the flow returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pydantic import BaseModel, Field


@dataclass
class DatasetInfo:
    fingerprint: str
    key: str  # {root}/datasets/{fingerprint}
    num_docs: int
    num_bytes: int
    cache_hit: bool
    num_skipped_files: int = 0  # files left out as not UTF-8 (data.on_decode_error='skip')


@dataclass
class TokenizerInfo:
    sha256: str
    key: str  # the tokenizer.json under the store root
    vocab_size: int
    eot_id: int
    cache_hit: bool


@dataclass
class ShardInfo:
    cache_key: str
    key: str
    url: str
    num_train_tokens: int
    num_val_tokens: int
    vocab_size: int
    dtype: str
    cache_hit: bool

    def as_dict(self) -> dict:
        return asdict(self)


class ResumePoint(BaseModel):
    """The newest valid checkpoint of a run (or none) and what was skipped on the way."""

    checkpoint_key: str | None = None
    checkpoint_uri: str | None = None
    step: int = 0
    skipped: list[str] = Field(default_factory=list, description="'<uri>: <reason>' per invalid one")


class EvalResult(BaseModel):
    checkpoint_uri: str
    step: int
    val_loss: float
    val_ppl: float
    windows: int
    seconds: float
    bits_per_byte: float | None = Field(
        None, description="validation loss per UTF-8 byte of the same windows, in bits (eval.sets 'bpb')"
    )
    mc_accuracy: float | None = Field(
        None, description="multiple choice (eval.sets 'multiple_choice'): share picked by summed log-likelihood"
    )
    mc_accuracy_norm: float | None = Field(
        None, description="multiple choice: share picked by the lowest mean per-token loss (acc_norm)"
    )
    num_mc_items: int | None = Field(None, description="multiple-choice items scored")


class TrainingResult(BaseModel):
    final_step: int
    final_checkpoint_key: str | None
    final_checkpoint_uri: str | None
    resumed_from_step: int
    attempts: int
    seconds: float
    train_losses: list[tuple[int, float]] = Field(default_factory=list)
    val_losses: list[tuple[int, float]] = Field(default_factory=list)
    checkpoints: list[dict] = Field(default_factory=list)
    failed_checkpoints: list[int] = Field(default_factory=list)
    restarts: int = Field(0, description="in-place restarts of the ranks by torchrun (launch.max_restarts)")
    evaluations: list[EvalResult] = Field(default_factory=list)
    attempt_log: list[dict] = Field(default_factory=list, description="one record per launch attempt")
    goodput: float | None = None
    throughput: list[dict] = Field(
        default_factory=list, description="per log step: tokens/s, MFU, peak GPU memory, data wait"
    )
    skipped_steps: list[int] = Field(
        default_factory=list,
        description="steps whose update was dropped for a NaN/inf loss or gradient norm (train.nonfinite=skip)",
    )


class PipelineResult(BaseModel):
    """What train_pipeline returns to a notebook or script."""

    run_name: str
    run_uri: str
    final_step: int
    final_checkpoint_uri: str | None
    last_val_loss: float | None
    shard_cache_key: str
    shard_uri: str
    data_cache_hit: bool
    resumed_from_step: int
    metrics_uri: str
    val_losses: list[tuple[int, float]] = Field(default_factory=list)
    first_train_loss: float | None = None
    last_train_loss: float | None = None
    checkpoints: list[dict] = Field(
        default_factory=list, description="step, uri, size_mb, upload_seconds, val_loss per checkpoint"
    )
    attempts: list[dict] = Field(default_factory=list, description="launch attempts, with steps lost")
    num_attempts: int = 0
    steps_lost: int = 0
    goodput: float | None = Field(None, description="useful training time / total time of all attempts")
    tokens_per_second: float | None = Field(None, description="median over the log steps after the first")
    mfu: float | None = Field(None, description="median model FLOPs utilization (0-1) after the first log step")
    peak_memory_gb: float | None = Field(None, description="peak GPU memory of rank 0")
    ledger: dict | None = Field(
        None,
        description="the flow run's goodput and cost ledger (observe.ledger): seconds, share and "
        "cost per cause of its wall-clock, goodput = productive steps / wall-clock",
    )
