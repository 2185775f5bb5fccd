"""The run configuration: one typed model tree, the single source of truth.

The same ``RunConfig`` is the Prefect flow parameter (it renders as a form in the UI),
is written to ``{root}/runs/{run_name}/config.json``, and is what every torch rank reads.
Every field carries a description; ``RunConfig.check()`` collects every problem and
raises one ``ConfigError`` listing all of them, each with the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.failures import ConfigError

RECIPES_DIR = Path(__file__).resolve().parents[1] / "deployments" / "recipes"
BUILTIN_SOURCE = "builtin:stdlib"


def default_root() -> str:
    """The embedded default object store: a local folder, overridable with STOKER_ROOT."""
    env = os.environ.get("STOKER_ROOT")
    if env:
        return env
    return "file://" + str(Path.cwd() / "stoker-data")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def problems(self, prefix: str) -> list[str]:  # pragma: no cover - overridden
        return []


class DataConfig(_Section):
    source: str = Field(
        BUILTIN_SOURCE,
        description="Where the raw text comes from: 'builtin:stdlib' (the Python standard "
        "library's own sources, always present); a local file, folder or glob of text "
        "(.txt/.md/.py), JSON lines (.jsonl/.json, see text_field) or Parquet files, optionally "
        ".gz/.bz2/.xz; any fsspec URL to one object, a folder or a glob (s3://bucket/data/*.jsonl, "
        "https://host/corpus.txt; see storage_options); or 'hf:NAME' for a Hugging Face dataset "
        "(a Hub name or a local dataset folder; see hf_name, hf_split, hf_revision).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for a URL source (e.g. {'endpoint_url': ...} for an "
        "S3-compatible store, {'anon': true} for a public bucket); credentials best come from "
        "the environment.",
    )
    text_field: str = Field(
        "text", description="Field (JSON lines) or column (Parquet, Hugging Face) holding the text."
    )
    hf_name: str | None = Field(
        None, description="Hugging Face dataset configuration (subset) name, if it has several."
    )
    hf_split: str = Field("train", description="Hugging Face dataset split to read.")
    hf_revision: str | None = Field(
        None,
        description="Hub branch, tag or commit of an 'hf:' dataset (default: main). It is "
        "resolved to a commit sha, which is the dataset's fingerprint.",
    )
    on_decode_error: Literal["fail", "skip"] = Field(
        "fail",
        description="A source file that is not UTF-8 text: 'fail' stops with its name, 'skip' "
        "leaves it out and counts it.",
    )
    max_bytes: int = Field(
        3_000_000,
        description="Cap on raw bytes taken from the source (0 = no cap). Keeps the built-in "
        "corpus small enough for a CPU run.",
    )
    val_fraction: float = Field(
        0.05, description="Fraction of documents held out for validation, chosen by document hash."
    )
    shard_tokens: int = Field(
        2_000_000, description="Tokens per shard file (a file is closed after the document that reaches it)."
    )
    token_dtype: Literal["auto", "uint16", "uint32"] = Field(
        "auto",
        description="Token id type of the shard files: 'auto' is uint16 while the vocabulary "
        "fits (<= 65536 ids), else uint32.",
    )
    num_workers: int = Field(
        2,
        description="Tokenizer worker processes. Each owns fixed slices of the corpus, so the "
        "shard files are byte-identical whatever this is.",
    )

    def problems(self, prefix: str) -> list[str]:
        out = []
        source = self.source.strip()
        is_hf, is_url = source.startswith("hf:"), "://" in source
        if not source:
            out.append(f"{prefix}.source: is empty; use 'builtin:stdlib' or a path/URL to text data.")
        elif is_hf:
            name = source[3:].strip()
            if not name:
                out.append(f"{prefix}.source: 'hf:' needs a dataset, e.g. 'hf:wikitext' or 'hf:/path/to/folder'.")
            elif name.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(name)):
                out.append(
                    f"{prefix}.source: no local dataset folder {name!r}; give an existing folder "
                    "or a Hub name such as 'hf:wikitext'."
                )
        elif source.startswith("builtin:"):
            if source != BUILTIN_SOURCE:
                out.append(f"{prefix}.source: unknown built-in corpus {source!r}; use {BUILTIN_SOURCE!r}.")
        elif not is_url or source.startswith("file://"):
            import glob

            path = source[len("file://"):] if is_url else source
            if not glob.glob(os.path.expanduser(path)):
                out.append(
                    f"{prefix}.source: no file matches {self.source!r}; give an existing file, "
                    "folder or glob, or use 'builtin:stdlib'."
                )
        if self.storage_options and not (is_url or is_hf):
            out.append(
                f"{prefix}.storage_options: only used with a URL source, and {self.source!r} is "
                "not one; remove them or give data.source as a URL."
            )
        if not is_hf:
            for name in ("hf_name", "hf_revision"):
                if getattr(self, name):
                    out.append(
                        f"{prefix}.{name}: only applies to 'hf:' sources; remove it or set "
                        f"{prefix}.source to 'hf:NAME'."
                    )
        if not self.hf_split.strip():
            out.append(f"{prefix}.hf_split: is empty; use a split such as 'train'.")
        if not self.text_field.strip():
            out.append(f"{prefix}.text_field: is empty; name the field that holds the text, e.g. 'text'.")
        if self.max_bytes < 0:
            out.append(f"{prefix}.max_bytes: must be >= 0 (got {self.max_bytes}); use 0 for no cap.")
        if not 0.0 < self.val_fraction < 0.5:
            out.append(
                f"{prefix}.val_fraction: must be in (0, 0.5) (got {self.val_fraction}); e.g. 0.05."
            )
        if self.shard_tokens < 1024:
            out.append(f"{prefix}.shard_tokens: must be >= 1024 (got {self.shard_tokens}).")
        if not 1 <= self.num_workers <= 256:
            out.append(
                f"{prefix}.num_workers: must be in [1, 256] (got {self.num_workers}); use about "
                "the number of CPU cores."
            )
        return out


class TokenizerConfig(_Section):
    path: str | None = Field(
        None,
        description="A tokenizer.json to load instead of training one (local path or URL).",
    )
    vocab_size: int = Field(
        2048,
        description="Vocabulary size of the byte-level BPE trained on the corpus; with 'path', "
        "at least the loaded tokenizer's size (it sizes the model's embedding).",
    )
    min_frequency: int = Field(2, description="Minimum pair frequency for a BPE merge.")
    eot_token: str = Field(
        "<|endoftext|>",
        description="End-of-text special token that ends every document in the shards.",
    )

    def problems(self, prefix: str) -> list[str]:
        out = []
        if self.vocab_size < 260:
            out.append(
                f"{prefix}.vocab_size: must be >= 260 to hold the 256 bytes plus specials "
                f"(got {self.vocab_size})."
            )
        if self.vocab_size > 2**32 - 1:
            out.append(f"{prefix}.vocab_size: too large for uint32 token ids ({self.vocab_size}).")
        if self.min_frequency < 1:
            out.append(f"{prefix}.min_frequency: must be >= 1 (got {self.min_frequency}).")
        if not self.eot_token:
            out.append(f"{prefix}.eot_token: is empty; use the tokenizer's end-of-text token, e.g. '<|endoftext|>'.")
        if self.path and "://" not in self.path and not Path(self.path).expanduser().is_file():
            out.append(f"{prefix}.path: {self.path!r} is not a file; give a tokenizer.json or leave it empty to train one.")
        return out


class ModelConfig(_Section):
    n_layer: int = Field(4, description="Number of transformer blocks.")
    n_head: int = Field(4, description="Attention heads per block; must divide n_embd.")
    n_embd: int = Field(128, description="Embedding width.")
    block_size: int = Field(128, description="Context length in tokens.")
    dropout: float = Field(0.0, description="Dropout probability (0 for pretraining from scratch).")
    bias: bool = Field(False, description="Use bias in Linear and LayerNorm layers.")

    def problems(self, prefix: str) -> list[str]:
        out = []
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) < 1:
                out.append(f"{prefix}.{name}: must be >= 1 (got {getattr(self, name)}).")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            out.append(
                f"{prefix}.n_embd: {self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick n_embd as a multiple of n_head."
            )
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"{prefix}.dropout: must be in [0, 1) (got {self.dropout}).")
        return out


class TrainConfig(_Section):
    seed: int = Field(1337, description="Seed of the model init and of the data order.")
    max_steps: int = Field(500, description="Optimizer steps to train in total (across resumes).")
    global_batch_size: int = Field(
        16, description="Sequences per optimizer step across all ranks."
    )
    micro_batch_size: int = Field(
        4, description="Sequences per rank per forward pass; the rest is gradient accumulation."
    )
    lr: float = Field(3e-3, description="Peak learning rate of AdamW.")
    min_lr: float = Field(3e-4, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(20, description="Linear warm-up steps before the cosine decay.")
    weight_decay: float = Field(0.1, description="AdamW weight decay on 2-D weights.")
    beta1: float = Field(0.9, description="AdamW beta1.")
    beta2: float = Field(0.95, description="AdamW beta2.")
    grad_clip: float = Field(1.0, description="Clip the global gradient norm to this (0 = off).")
    log_interval: int = Field(10, description="Steps between training-loss log lines.")
    deterministic: bool = Field(
        True, description="Use deterministic torch algorithms so a resumed run is bitwise equal."
    )

    def problems(self, prefix: str) -> list[str]:
        out = []
        if self.max_steps < 1:
            out.append(f"{prefix}.max_steps: must be >= 1 (got {self.max_steps}).")
        if self.global_batch_size < 1:
            out.append(f"{prefix}.global_batch_size: must be >= 1 (got {self.global_batch_size}).")
        if self.micro_batch_size < 1:
            out.append(f"{prefix}.micro_batch_size: must be >= 1 (got {self.micro_batch_size}).")
        if self.lr <= 0:
            out.append(f"{prefix}.lr: must be > 0 (got {self.lr}); a typical value is 3e-4.")
        if self.min_lr < 0 or (self.lr > 0 and self.min_lr > self.lr):
            out.append(f"{prefix}.min_lr: must be in [0, lr] (got {self.min_lr}, lr={self.lr}).")
        if self.warmup_steps < 0:
            out.append(f"{prefix}.warmup_steps: must be >= 0 (got {self.warmup_steps}).")
        if self.weight_decay < 0:
            out.append(f"{prefix}.weight_decay: must be >= 0 (got {self.weight_decay}).")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                out.append(f"{prefix}.{name}: must be in [0, 1) (got {getattr(self, name)}).")
        if self.grad_clip < 0:
            out.append(f"{prefix}.grad_clip: must be >= 0 (got {self.grad_clip}); 0 turns clipping off.")
        if self.log_interval < 1:
            out.append(f"{prefix}.log_interval: must be >= 1 (got {self.log_interval}).")
        return out


class CheckpointConfig(_Section):
    interval_steps: int = Field(100, description="Steps between checkpoints (the last step always saves).")
    keep_latest_k: int = Field(
        2, description="Committed checkpoints to keep; at least 2, as the newest may still be uploading."
    )
    async_enabled: bool = Field(
        True, description="Upload in the background while training goes on (False: the step "
        "waits for save, upload and commit)."
    )
    upload_timeout_seconds: float = Field(
        900.0, description="How long one rank keeps retrying (with backoff) its upload of one "
        "checkpoint before the checkpoint is given up (reported, never committed)."
    )
    commit_timeout_seconds: float = Field(
        1200.0, description="How long rank 0 waits for every rank's upload receipt before it "
        "gives the checkpoint up."
    )

    def problems(self, prefix: str) -> list[str]:
        out = []
        if self.interval_steps < 1:
            out.append(f"{prefix}.interval_steps: must be >= 1 (got {self.interval_steps}).")
        if self.keep_latest_k < 2:
            out.append(f"{prefix}.keep_latest_k: must be >= 2 (got {self.keep_latest_k}).")
        if self.upload_timeout_seconds <= 0:
            out.append(f"{prefix}.upload_timeout_seconds: must be > 0 (got {self.upload_timeout_seconds}).")
        if self.commit_timeout_seconds < self.upload_timeout_seconds:
            out.append(f"{prefix}.commit_timeout_seconds: must be >= upload_timeout_seconds "
                       f"({self.commit_timeout_seconds} < {self.upload_timeout_seconds}).")
        return out


class EvalConfig(_Section):
    interval_steps: int = Field(100, description="Steps between validation-loss evaluations.")
    num_batches: int = Field(8, description="Validation batches (of micro_batch_size per rank) per evaluation.")
    per_checkpoint_enabled: bool = Field(
        True, description="Evaluate every committed checkpoint in its own task run (a separate "
        "process) while training goes on."
    )

    def problems(self, prefix: str) -> list[str]:
        out = []
        if self.interval_steps < 1:
            out.append(f"{prefix}.interval_steps: must be >= 1 (got {self.interval_steps}).")
        if self.num_batches < 1:
            out.append(f"{prefix}.num_batches: must be >= 1 (got {self.num_batches}).")
        return out


class LaunchConfig(_Section):
    launcher: Literal["local"] = Field(
        "local", description="'local': N simulated nodes on this host, each a torchrun agent."
    )
    num_nodes: int = Field(1, description="torchrun agents (simulated nodes) meeting by c10d rendezvous.")
    nproc_per_node: int = Field(2, description="Training ranks per node.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; 'auto' is NCCL with GPUs, gloo otherwise."
    )
    rdzv_host: str = Field("127.0.0.1", description="Host of the c10d rendezvous endpoint.")
    timeout_seconds: int = Field(3600, description="Wall-clock limit of one training launch.")
    max_attempts: int = Field(2, description="Launch attempts; each retry resumes from the newest valid checkpoint.")
    hang_timeout_seconds: int = Field(
        300,
        description="Hang watchdog: when no training step finishes for this long (rank 0 "
        "reports each one), the gang is killed and the launch fails as transient (retried from "
        "the newest valid checkpoint). Armed at rank 0's first report, so start-up (rendezvous, "
        "loading shards and the checkpoint, the step-0 evaluation) counts only against "
        "timeout_seconds. Keep it above the slowest step plus an evaluation and a checkpoint "
        "save. 0 turns the watchdog off.",
    )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    def problems(self, prefix: str) -> list[str]:
        out = []
        if self.num_nodes < 1:
            out.append(f"{prefix}.num_nodes: must be >= 1 (got {self.num_nodes}).")
        if self.nproc_per_node < 1:
            out.append(f"{prefix}.nproc_per_node: must be >= 1 (got {self.nproc_per_node}).")
        if self.timeout_seconds < 10:
            out.append(f"{prefix}.timeout_seconds: must be >= 10 (got {self.timeout_seconds}).")
        if self.max_attempts < 1:
            out.append(f"{prefix}.max_attempts: must be >= 1 (got {self.max_attempts}).")
        if self.hang_timeout_seconds != 0 and self.hang_timeout_seconds < 5:
            out.append(
                f"{prefix}.hang_timeout_seconds: must be 0 (watchdog off) or >= 5 (got "
                f"{self.hang_timeout_seconds}); give more than the slowest step plus an "
                "evaluation and a checkpoint save, e.g. 300.")
        return out


class StorageConfig(_Section):
    root: str = Field(
        default_factory=default_root,
        description="Object-store root URL: file:///abs/path, s3://bucket/prefix, or any fsspec "
        "URL. Defaults to ./stoker-data (or $STOKER_ROOT).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options (e.g. {'endpoint_url': ...} for S3); credentials "
        "best come from the environment.",
    )

    def problems(self, prefix: str) -> list[str]:
        out = []
        if not self.root.strip():
            out.append(f"{prefix}.root: is empty; use file:///abs/path or s3://bucket/prefix.")
        elif "://" not in self.root and not os.path.isabs(self.root):
            out.append(
                f"{prefix}.root: {self.root!r} is relative; give an absolute path or a URL "
                "such as file:///data/stoker or s3://bucket/prefix."
            )
        return out


class RunConfig(_Section):
    """Everything a pretraining run needs, in one tree."""

    run_name: str | None = Field(
        None,
        description="Name of the run folder. Empty: derived from the config, so the same config "
        "resumes the same run.",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Raw data source and split.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="GPT model size.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimization.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation during training.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="How ranks are started.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Object store.")

    # ---- derived facts -------------------------------------------------------------
    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.launch.world_size * self.train.micro_batch_size)

    def identity_hash(self) -> str:
        """Hash of what determines the run's trajectory (not where it is stored or launched)."""
        payload = self.model_dump(mode="json", exclude={"run_name": True, "storage": True,
                                                        "launch": True, "data": {"num_workers"}})
        payload["world_size"] = self.launch.world_size
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def model_hash(self) -> str:
        """Hash of what must match for a checkpoint to load into this model."""
        payload = {"model": self.model.model_dump(mode="json"), "vocab": self.tokenizer.vocab_size}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def resolved_run_name(self) -> str:
        return self.run_name or f"run-{self.identity_hash()[:10]}"

    # ---- validation ----------------------------------------------------------------
    def problems(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for name in ("data", "tokenizer", "model", "train", "checkpoint", "eval", "launch", "storage"):
            out.extend(getattr(self, name).problems(name))
        if self.run_name is not None:
            import re

            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", self.run_name):
                out.append(
                    f"run_name: {self.run_name!r} is not a safe folder name; use letters, digits, "
                    "'.', '_' or '-' (max 128)."
                )
        t, world = self.train, self.launch.world_size
        if t.global_batch_size >= 1 and t.micro_batch_size >= 1 and world >= 1:
            per_pass = world * t.micro_batch_size
            if t.global_batch_size % per_pass:
                out.append(
                    f"train.global_batch_size: {t.global_batch_size} is not divisible by "
                    f"world_size x micro_batch_size = {world} x {t.micro_batch_size} = {per_pass}; "
                    f"use a multiple of {per_pass} (e.g. {per_pass * max(1, t.global_batch_size // per_pass)})."
                )
        if t.warmup_steps >= t.max_steps >= 1:
            out.append(
                f"train.warmup_steps: {t.warmup_steps} must be below max_steps={t.max_steps}."
            )
        return out

    def check(self) -> "RunConfig":
        """Raise one ConfigError listing every problem; return self when there is none."""
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    # ---- (de)serialization ---------------------------------------------------------
    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def _format_validation_error(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        got = e.get("input")
        out.append(f"{loc}: {e['msg']} (got {got!r}).")
    return out


def load_config(source: "RunConfig | dict | str | Path | None" = None, **overrides: Any) -> RunConfig:
    """Build a checked RunConfig from a model, a dict, a YAML/JSON file or a recipe name.

    ``overrides`` are dotted keys (``train__max_steps=10`` or ``{"train.max_steps": 10}``).
    Type and value problems are reported together in one ConfigError.
    """
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, RunConfig):
        data = source.model_dump(mode="json")
    elif isinstance(source, dict):
        data = json.loads(json.dumps(source))
    else:
        path = Path(source)
        if not path.exists() and (RECIPES_DIR / f"{source}.yaml").exists():
            path = RECIPES_DIR / f"{source}.yaml"
        if not path.exists():
            recipes = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
            raise ConfigError([f"config: {str(source)!r} is neither a file nor a recipe ({recipes})."])
        data = yaml.safe_load(path.read_text()) or {}
    for key, value in overrides.items():
        parts = key.replace("__", ".").split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None
    return cfg.check()
