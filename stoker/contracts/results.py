"""Typed results the tasks hand to each other and the flow returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pydantic import BaseModel, Field

from stoker.config.data import DEFAULT_SOURCE_NAME


@dataclass
class DatasetInfo:
    fingerprint: str
    key: str  # {root}/datasets/{fingerprint}
    num_docs: int
    num_bytes: int
    cache_hit: bool
    num_skipped_files: int = 0  # files left out as not UTF-8 (data.on_decode_error='skip')
    capped_at: int = 0  # data.max_bytes, when the source held more and was cut there
    num_parts: int = 1  # the stored parts it is read from (stoker.storage.datasets)


@dataclass
class TokenizerInfo:
    sha256: str
    key: str  # the tokenizer.json under the store root
    vocab_size: int
    eot_id: int
    cache_hit: bool


@dataclass
class FilterInfo:
    """What data.filters removed from one source."""

    name: str  # the source of data.sources ("main": data.source)
    key: str  # filters/{key}/ in the store: result.json, removed.jsonl (a sample)
    filters: list[str]
    num_docs_in: int
    num_bytes_in: int
    num_docs_out: int
    num_bytes_out: int
    removed: dict[str, int] = field(default_factory=dict)  # filter -> documents it removed
    num_edited: int = 0  # documents kept with lines dropped (c4)
    cache_hit: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class DedupInfo:
    """What data.dedup and data.decontaminate removed from one source (data.dedup)."""

    name: str  # the source of data.sources ("main": data.source)
    key: str  # dedup/{key}/ in the store: result.json, removed.jsonl (a sample, with what it matched)
    dedup: str  # none | exact | near
    decontaminate: bool
    num_docs_in: int
    num_bytes_in: int
    num_exact: int  # removed as exact copies of a document kept before (this source or an earlier one)
    num_near: int  # removed as near copies (MinHash estimate >= data.near_dup_threshold)
    num_contaminated: int  # removed whole for an evaluation item's n-grams (cut into too many pieces)
    num_docs_out: int  # a document cut in pieces counts as its pieces
    num_bytes_out: int
    items: dict[str, int] = field(default_factory=dict)  # evaluation item -> documents holding it (removed or cut)
    cache_hit: bool = False
    num_cut: int = 0  # kept in pieces: each item's n-gram and 200 characters on each side cut out
    items_checked: dict[str, int] = field(default_factory=dict)  # evaluation set -> its items checked

    @property
    def num_removed(self) -> int:
        return self.num_exact + self.num_near + self.num_contaminated

    def as_dict(self) -> dict:
        return asdict(self)


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
    name: str = DEFAULT_SOURCE_NAME  # the source of data.sources it holds ("main": data.source)
    # bytes of its text the tokenizer's vocabulary cannot spell (dropped), and the first one
    unencodable_bytes: int = 0
    unencodable_example: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class DataShards:
    """A run's data: one shard set per source, all made with the run's one tokenizer.

    ``key`` is what the ranks and evaluations are given (``--shards``): the shard set's key for
    one source, else ``name=key`` per source, comma-separated (names hold no ',' or '=')."""

    sets: list[ShardInfo]
    mixture: bool = False  # data.sources (even of one source), not data.source
    dedup: list[DedupInfo] = field(default_factory=list)  # per source: what data.dedup/decontaminate removed
    downloads: list[DatasetInfo] = field(default_factory=list)  # per source: the dataset downloaded
    filtered: list[FilterInfo] = field(default_factory=list)  # per source with data.filters: what they removed

    STAGE_COLUMNS = ("source", "stage", "docs_in", "MB_in", "docs_out", "MB_out", "tokens_out", "parts", "cached")

    def stage_rows(self) -> list[dict]:
        """Per source and stage (download, dedup, tokenize), the documents and bytes in and out
        (every row has every column: None where a stage has no such number)."""
        rows = []
        dedup = {d.name: d for d in self.dedup}
        downloads = dict(zip((s.name for s in self.sets), self.downloads))

        def row(**kw) -> dict:
            return {c: kw.get(c) for c in self.STAGE_COLUMNS}

        filtered = {f.name: f for f in self.filtered}
        for s in self.sets:
            d, r, f = downloads.get(s.name), dedup.get(s.name), filtered.get(s.name)
            if d is not None:
                rows.append(
                    row(
                        source=s.name,
                        stage="download",
                        docs_out=d.num_docs,
                        MB_out=round(d.num_bytes / 1e6, 3),
                        parts=d.num_parts,
                        cached=d.cache_hit,
                    )
                )
            if f is not None:
                rows.append(
                    row(
                        source=s.name,
                        stage="filter " + "+".join(f.filters),
                        docs_in=f.num_docs_in,
                        MB_in=round(f.num_bytes_in / 1e6, 3),
                        docs_out=f.num_docs_out,
                        MB_out=round(f.num_bytes_out / 1e6, 3),
                        cached=f.cache_hit,
                    )
                )
            if r is not None:
                rows.append(
                    row(
                        source=s.name,
                        stage=f"dedup {r.dedup}" + (" + decontaminate" if r.decontaminate else ""),
                        docs_in=r.num_docs_in,
                        MB_in=round(r.num_bytes_in / 1e6, 3),
                        docs_out=r.num_docs_out,
                        MB_out=round(r.num_bytes_out / 1e6, 3),
                        cached=r.cache_hit,
                    )
                )
            before = r or f  # what the tokenizer read: the stage before it
            docs_in = before.num_docs_out if before is not None else (d.num_docs if d is not None else None)
            mb_in = before.num_bytes_out if before is not None else (d.num_bytes if d is not None else None)
            tokens = s.num_train_tokens + s.num_val_tokens
            rows.append(
                row(
                    source=s.name,
                    stage="tokenize",
                    docs_in=docs_in,
                    MB_in=round(mb_in / 1e6, 3) if mb_in is not None else None,
                    MB_out=round(tokens * int(s.dtype[-1]) / 1e6, 3),
                    tokens_out=tokens,
                    cached=s.cache_hit,
                )
            )
        return rows

    def stage_lines(self) -> list[str]:
        """One log line per source and stage (stage_rows)."""
        out = []
        for r in self.stage_rows():
            what = []
            if r["docs_in"] is not None:
                what.append(f"{r['docs_in']:,} documents ({r['MB_in']:.2f} MB) in")
            if r["docs_out"] is not None:
                what.append(f"{r['docs_out']:,} documents ({r['MB_out']:.2f} MB) out")
            if r["tokens_out"] is not None:
                what.append(f"{r['tokens_out']:,} tokens ({r['MB_out']:.2f} MB) out")
            if r["parts"] is not None:
                what.append(f"in {r['parts']} stored part(s)")
            cached = " (cached)" if r["cached"] else ""
            out.append(f"data stage {r['stage']} of source {r['source']!r}: {', '.join(what)}{cached}")
        return out

    @property
    def is_mixture(self) -> bool:
        return self.mixture

    @property
    def key(self) -> str:
        return self.sets[0].key if not self.is_mixture else ",".join(f"{s.name}={s.key}" for s in self.sets)

    @property
    def cache_key(self) -> str:
        if not self.is_mixture:
            return self.sets[0].cache_key
        import hashlib

        joined = ",".join(f"{s.name}={s.cache_key}" for s in self.sets)
        return "mix-" + hashlib.sha256(joined.encode()).hexdigest()[:24]

    @property
    def url(self) -> str:
        return self.sets[0].url if not self.is_mixture else ", ".join(f"{s.name}={s.url}" for s in self.sets)

    @property
    def num_train_tokens(self) -> int:
        return sum(s.num_train_tokens for s in self.sets)

    @property
    def num_val_tokens(self) -> int:
        return sum(s.num_val_tokens for s in self.sets)

    @property
    def vocab_size(self) -> int:
        return self.sets[0].vocab_size

    @property
    def dtype(self) -> str:
        return self.sets[0].dtype

    @property
    def cache_hit(self) -> bool:
        return all(s.cache_hit for s in self.sets)

    def as_dict(self) -> dict:
        """shards.json of the run folder: the one set's fields (as before mixtures), plus every set."""
        return {
            "cache_key": self.cache_key,
            "key": self.key,
            "url": self.url,
            "num_train_tokens": self.num_train_tokens,
            "num_val_tokens": self.num_val_tokens,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "cache_hit": self.cache_hit,
            "sources": [s.as_dict() for s in self.sets],
            "dedup": [d.as_dict() for d in self.dedup],
            "filtered": [f.as_dict() for f in self.filtered],
            "stages": self.stage_rows(),
        }


def parse_shards_arg(arg: str) -> list[tuple[str, str]]:
    """(name, shard-set key) per source of a ``--shards`` value (DataShards.key)."""
    if "=" not in arg:
        return [(DEFAULT_SOURCE_NAME, arg)]
    return [tuple(part.split("=", 1)) for part in arg.split(",")]  # type: ignore[misc]


class ResumePoint(BaseModel):
    """The newest valid checkpoint of a run (or none) and what was skipped on the way."""

    checkpoint_key: str | None = None
    checkpoint_uri: str | None = None
    step: int = 0
    skipped: list[str] = Field(default_factory=list, description="'<uri>: <reason>' per invalid one")


# the fields an Evaluated event and an EvalResult share (the event's checkpoint is checkpoint_uri)
_EVALUATED = (
    "step",
    "val_loss",
    "val_ppl",
    "windows",
    "bits_per_byte",
    "mc_accuracy",
    "mc_accuracy_norm",
    "num_mc_items",
    "mc_accuracy_clean",
    "mc_accuracy_norm_clean",
    "num_mc_items_clean",
    "sources",
)


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
    mc_accuracy_clean: float | None = Field(
        None, description="acc on the clean subset: the items data.decontaminate did not find in the training data"
    )
    mc_accuracy_norm_clean: float | None = Field(None, description="acc_norm on the clean subset")
    num_mc_items_clean: int | None = Field(None, description="multiple-choice items of the clean subset")
    sources: dict | None = Field(
        None,
        description="a mixture (data.sources): per source, val_loss, bits_per_byte and windows of its own "
        "validation split (val_loss and bits_per_byte above are their means)",
    )

    @classmethod
    def of_event(cls, e, seconds: float) -> "EvalResult":
        """The result of an evaluation process's Evaluated event."""
        shared = {k: getattr(e, k) for k in _EVALUATED}
        return cls(checkpoint_uri=e.checkpoint, seconds=seconds, **shared)

    def to_event(self):
        """The Evaluated event of this result (for the metric sinks)."""
        from stoker.contracts import events

        shared = {k: getattr(self, k) for k in _EVALUATED}
        return events.Evaluated(checkpoint=self.checkpoint_uri, **shared)


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
    micro_batch_size: int | None = Field(
        None, description="train.micro_batch_size 'auto': the value the ranks chose at start-up (the last launch's)"
    )
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
    source_val_losses: list[dict] = Field(
        default_factory=list, description="a mixture: per in-loop evaluation, {'step', 'losses': {source: loss}}"
    )
    mix: list[dict] = Field(
        default_factory=list,
        description="a mixture: per log step, {'step', 'sources': {source: {'tokens', 'epochs'}}} seen so far",
    )
    epoch_limits: list[dict] = Field(
        default_factory=list, description="sources that reached max_epochs: step, source, epochs, action"
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
    plan: dict | None = Field(
        None,
        description="the run's plan (arithmetic.plan): memory per device by part, tokens, FLOPs, step and wall time, cost",
    )
    micro_batch_size: int | None = Field(None, description="train.micro_batch_size 'auto': the value the ranks chose")
    sources: list[dict] = Field(
        default_factory=list,
        description="a mixture: per source, its name, shard set, tokens and epochs trained on, and its "
        "last validation loss (in-loop) and final evaluation",
    )
    ledger: dict | None = Field(
        None,
        description="the flow run's goodput and cost ledger (observe.ledger): seconds, share and "
        "cost per cause of its wall-clock, goodput = productive steps / wall-clock",
    )
    lineage: list[dict] = Field(
        default_factory=list,
        description="a branch (train.branch_from): its ancestry, nearest first: each run's parent, the step "
        "and checkpoint it left it at, and that checkpoint's commit-manifest sha256",
    )
    since_base: dict | None = Field(
        None,
        description="a run from a base: per source, its validation loss and bits per byte at the base "
        "(step 0) and at the last evaluation, and their change (gain < 0, forgetting > 0)",
    )
