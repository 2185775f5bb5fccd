"""What ranks tell the launcher: typed records and their one wire format. No torch.

A rank prints ``PREFIX + json`` lines on stdout; the launcher reads them from the stream
(``decode``) and dispatches on the record's type, never on strings built at run time. The
same JSON objects (with ``event`` naming the kind and ``time`` the wall clock) are what rank 0
keeps in ``{run}/metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

PREFIX = "STOKER_METRIC "
# where a rank files its Failure record in torchelastic's error.json (message.extraInfo)
ERROR_INFO_KEY = "stoker"
# the file (path in this variable) where a rank that failed permanently leaves its Failure,
# so ranks restarted in place by torchrun end at once instead of failing again
PERMANENT_MARKER_ENV = "STOKER_PERMANENT_FAILURE_FILE"
# beside its torchelastic error file, each rank's own numbers ({"rank", "group_rank",
# "local_rank"}): c10d numbers the nodes in its own order, not in the order they were launched
RANK_FILE = "rank.json"


@dataclass(frozen=True, kw_only=True)
class Event:
    kind: ClassVar[str] = ""
    stored: ClassVar[bool] = True  # kept in metrics.jsonl (heartbeats are not)
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"event": self.kind, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def encode(self) -> str:
        """The wire form: one line, PREFIX + JSON."""
        return PREFIX + self.to_json()


@dataclass(frozen=True, kw_only=True)
class Step(Event):
    """A heartbeat per finished optimizer step (rank 0): feeds the hang watchdog."""

    kind: ClassVar[str] = "step"
    stored: ClassVar[bool] = False
    step: int


@dataclass(frozen=True, kw_only=True)
class Train(Event):
    """A log step: the loss averaged over ranks, and throughput over the interval since the
    last log step (wall time, evaluation excluded)."""

    kind: ClassVar[str] = "train"
    step: int
    loss: float
    lr: float
    step_seconds: float
    tokens_seen: int
    tokens_per_second: float | None = None  # all ranks together
    mfu: float | None = None  # model FLOPs utilization, 0-1; None on devices without a peak
    peak_memory_gb: float | None = None  # max allocated on rank 0's GPU so far
    data_wait_share: float | None = None  # share of the interval rank 0 waited for batches
    # the interval's own account, for the goodput ledger (observe.ledger): it began at wall
    # time `since` after step `since_step`; of its wall time, `eval_seconds` went to in-loop
    # evaluations (left out of step_seconds) and `checkpoint_seconds` to checkpoint stalls of
    # the training thread (part of step_seconds)
    since: float | None = None
    since_step: int | None = None
    eval_seconds: float | None = None
    checkpoint_seconds: float | None = None
    # a mixture (data.sources): per source, {"tokens": trained on so far, "epochs": taken}
    sources: dict | None = None
    # a mixture of experts (families.moe): `loss` is the training loss (language model plus
    # router_aux_loss_coef x load balancing); these are its language-model part and the
    # load-balancing loss, averaged over ranks; and the router's load over the interval, per
    # sparse layer: {"layers": [layer], "busiest": [share], "idlest": [share]} of the top-k
    # assignments (1 / num_experts each when balanced)
    lm_loss: float | None = None
    aux_loss: float | None = None
    expert_load: dict | None = None


@dataclass(frozen=True, kw_only=True)
class Eval(Event):
    kind: ClassVar[str] = "eval"
    step: int
    val_loss: float
    val_ppl: float
    seconds: float | None = None  # how long this evaluation took (the ledger's evaluation time)
    # a mixture: per source, its validation loss (val_loss is their mean)
    sources: dict | None = None
    # a run from a base with 'bpb' in eval.sets: the same windows' bits per byte (the mean over
    # sources), and per source for a mixture: what the change since the base is told in
    bits_per_byte: float | None = None
    sources_bpb: dict | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointStaged(Event):
    """This step's state is written to local staging (by the upload thread, from host
    copies); upload and commit go on in the background."""

    kind: ClassVar[str] = "checkpoint_staged"
    step: int
    key: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(Event):
    kind: ClassVar[str] = "checkpoint"
    step: int
    key: str  # under the store root
    uri: str
    bytes: int
    stage_seconds: float
    upload_seconds: float
    commit_seconds: float


@dataclass(frozen=True, kw_only=True)
class UploadRetry(Event):
    kind: ClassVar[str] = "upload_retry"
    step: int
    rank: int
    attempt: int
    error: str


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event):
    """A checkpoint given up: never committed."""

    kind: ClassVar[str] = "checkpoint_failed"
    step: int
    rank: int
    error: str


@dataclass(frozen=True, kw_only=True)
class CheckpointDropped(Event):
    """A checkpoint written to local staging but dropped before its upload finished (newer
    ones were waiting: checkpoint.max_pending_uploads); never committed. Every rank drops the
    same one (rank 0 decides) and each says so."""

    kind: ClassVar[str] = "checkpoint_dropped"
    step: int
    rank: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Resumed(Event):
    kind: ClassVar[str] = "resumed"
    step: int
    checkpoint: str
    rng_restored: bool = True  # False: written at another world size, RNG streams re-seeded
    passed_over: list[str] = field(default_factory=list)  # damaged ones found by a host's full check


@dataclass(frozen=True, kw_only=True)
class BaseLoaded(Event):
    """The run had no valid checkpoint and started from its base model's weights (model only:
    a fresh optimizer and schedule). `bytes_read`: what each rank read of the base's tensors
    (its own slices), by rank."""

    kind: ClassVar[str] = "base_loaded"
    base: str
    sha256: str
    bytes_read: list[int]
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Failure(Event):
    """A rank raised; `transient` is failures.classify's verdict on the exception."""

    kind: ClassVar[str] = "failure"
    rank: int
    type: str
    message: str
    transient: bool


@dataclass(frozen=True, kw_only=True)
class NonFinite(Event):
    """A step whose loss or gradient norm was NaN/inf (or a state about to be saved that held
    one): `action` is "skipped" (train.nonfinite=skip, within its limit) or "failed" (the run
    ends with NonFiniteError; nothing after `first_step` is committed)."""

    kind: ClassVar[str] = "nonfinite"
    step: int  # the step at which the ranks found out
    first_step: int  # the first step that went non-finite
    what: str  # "loss", "gradient norm", "weights or optimizer state"
    action: str  # "skipped" | "failed"
    num_skipped: int = 0


@dataclass(frozen=True, kw_only=True)
class MicroBatchChosen(Event):
    """train.micro_batch_size 'auto' settled at start-up (rank 0, for every rank): the
    plan's largest fit, lowered where a probe step on the device ran out of memory; the
    global batch is the same, through `accum` micro-batches a step."""

    kind: ClassVar[str] = "micro_batch"
    micro_batch_size: int
    planned: int
    probed: bool  # a probe step on the device (CUDA) confirmed it
    accum: int
    device: str
    device_memory_gib: float


@dataclass(frozen=True, kw_only=True)
class IdleExperts(Event):
    """Experts of a sparse layer that the router sent no token for `steps` steps in a row (at
    least families.moe's IDLE_WARN_STEPS): said once per layer and launch."""

    kind: ClassVar[str] = "idle_experts"
    step: int
    layer: int
    experts: list
    steps: int


@dataclass(frozen=True, kw_only=True)
class EpochLimit(Event):
    """A source of the mixture reaches its data.sources max_epochs: the run ends at this step
    ('stop'), or goes on past it ('warn', said once per launch)."""

    kind: ClassVar[str] = "epoch_limit"
    step: int
    source: str
    epochs: float  # taken by the end of this step (stop) or of the step after (warn)
    max_epochs: float
    action: str  # "stop" | "warn"


@dataclass(frozen=True, kw_only=True)
class Stopped(Event):
    """The ranks agreed to stop early (SIGTERM: a cancel or a preemption). `saved`: a stop
    checkpoint of `step` was written and every upload finished inside the grace period (rank 0:
    committed); when False, an upload still running may yet commit as the rank leaves."""

    kind: ClassVar[str] = "stopped"
    step: int
    saved: bool


@dataclass(frozen=True, kw_only=True)
class Done(Event):
    kind: ClassVar[str] = "done"
    step: int
    seconds: float
    val_loss: float | None
    failed_checkpoints: list[str] = field(default_factory=list)
    # the account of the last interval (as Train's): the last evaluation and checkpoint, and
    # the wait for the last upload's commit
    since: float | None = None
    since_step: int | None = None
    eval_seconds: float | None = None
    checkpoint_seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class Evaluated(Event):
    """What an evaluation process (training.evaluation_main) found for one checkpoint."""

    kind: ClassVar[str] = "evaluated"
    checkpoint: str
    step: int
    val_loss: float
    val_ppl: float
    windows: int
    # eval.sets beyond the loss (None: not measured)
    bits_per_byte: float | None = None  # of the same validation windows
    mc_accuracy: float | None = None  # multiple choice: the highest summed log-likelihood (acc)
    mc_accuracy_norm: float | None = None  # the lowest mean per-token loss (acc_norm)
    num_mc_items: int | None = None
    # the same on the clean subset: the items data.decontaminate did not find in the training data
    mc_accuracy_clean: float | None = None
    mc_accuracy_norm_clean: float | None = None
    num_mc_items_clean: int | None = None
    # a mixture: per source, {"val_loss", "bits_per_byte", "windows"} of its own validation split
    sources: dict | None = None


@dataclass(frozen=True, kw_only=True)
class Exported(Event):
    """What an export process (training.export) wrote for one checkpoint."""

    kind: ClassVar[str] = "exported"
    checkpoint: str
    step: int
    folder: str
    files: list[str]
    vocab_size: int  # the tokenizer's ids: the padded rows of the embedding are left out
    num_params: int


@dataclass(frozen=True, kw_only=True)
class HarnessEvaluated(Event):
    """What an lm-evaluation-harness process (training.harness_main) measured on an exported model."""

    kind: ClassVar[str] = "harness"
    checkpoint: str | None  # None: an exported folder that does not name its checkpoint
    step: int | None
    tasks: list[str]
    metrics: dict[str, dict[str, float]]  # {task: {"acc": .., "acc_stderr": .., ...}}
    num_items: dict[str, int]  # {task: items scored}
    out: str | None = None  # the JSON file written (--out)
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Souped(Event):
    """What a soup process (training.soup_main) committed: the soup run's first checkpoint."""

    kind: ClassVar[str] = "souped"
    checkpoint: str  # its URI
    key: str  # under the store root
    step: int
    soup_id: str
    num_tensors: int
    num_averaged: int  # model tensors and AdamW moments; the rest is the lead's
    largest_tensor_bytes: int
    bytes_written: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Joined(Event):
    """A torchrun rank's own numbers, once at its start. c10d numbers the nodes in its own
    order, so the launcher learns from this which global rank prints each of its lines."""

    kind: ClassVar[str] = "joined"
    stored: ClassVar[bool] = False
    rank: int
    group_rank: int
    local_rank: int


TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        Step,
        Joined,
        MicroBatchChosen,
        Train,
        Eval,
        CheckpointStaged,
        CheckpointCommitted,
        UploadRetry,
        CheckpointFailed,
        CheckpointDropped,
        Resumed,
        BaseLoaded,
        Failure,
        NonFinite,
        IdleExperts,
        EpochLimit,
        Stopped,
        Done,
        Evaluated,
        Exported,
        HarnessEvaluated,
        Souped,
    )
}


def from_dict(record: dict) -> Event | None:
    """The typed record of a decoded JSON object; None for an unknown kind or bad fields."""
    cls = TYPES.get(record.get("event", ""))
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in record.items() if k in names})
    except TypeError:  # a required field missing
        return None


def decode(line: str) -> Event | None:
    """The event carried by one output line (anything before PREFIX is ignored), or None."""
    head, sep, payload = line.partition(PREFIX)
    if not sep:
        return None
    try:
        record = json.loads(payload)
    except ValueError:
        return None
    return from_dict(record) if isinstance(record, dict) else None


def report_outcome(work: Callable[[], Event]) -> int:
    """The main of a one-process child (``stoker.training.export``, ``stoker.training.harness_main``):
    `work()`'s event printed as its last line, exit 0; a failure as one Failure line (a
    ConfigError's problems joined), exit 1, with a traceback on stderr only for what is not a
    StokerError (a bug, or a library's own error)."""
    import traceback

    from stoker.failures import ConfigError, StokerError, is_transient

    try:
        result = work()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException included
        if not isinstance(exc, StokerError):
            traceback.print_exc()
        message = "; ".join(exc.problems) if isinstance(exc, ConfigError) else " ".join(str(exc).split())[:2000]
        print(
            Failure(rank=0, type=type(exc).__name__, message=message, transient=is_transient(exc)).encode(), flush=True
        )
        return 1
    print(result.encode(), flush=True)
    return 0
