"""The sections of the run configuration: one typed model per component (data, tokenizer,
model, train, checkpoint, eval, launch and its nodes, ray, engine, storage, metrics).

Validation is declarative, so the UI form shows it: bounds are field constraints, each field
may carry a ``fix`` (in its JSON schema) that is told with any problem of that field, and
cross-field rules are validators on the section that owns them. No section touches the
filesystem (every rank re-validates config.json on its own host).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from stoker.fields import NonBlank, _field, _not_blank, _rule, _Section  # noqa: F401 (the sections' base)

BUILTIN_SOURCE = "builtin:stdlib"
# the built-in corpora: general text (the standard library's sources) and a small synthetic
# domain corpus (data.synthetic: template contracts), for mixtures and anneals out of the box
BUILTIN_SOURCES = (BUILTIN_SOURCE, "builtin:contracts")


def default_root() -> str:
    """The embedded default object store: a local folder, overridable with STOKER_ROOT."""
    env = os.environ.get("STOKER_ROOT")
    if env:
        return env
    return "file://" + str(Path.cwd() / "stoker-data")


# option names that hold credentials (fsspec/s3fs/gcsfs/adlfs spellings); matched case-blind,
# at any depth, plus any name containing one of the words
_SECRET_NAMES = {
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "session_token",
    "access_key",
    "secret_key",
    "client_secret",
    "account_key",
    "sas_token",
    "connection_string",
    "credentials",
    "private_key",
}
_SECRET_WORDS = ("secret", "password", "token", "credential", "private_key")
CREDENTIALS_FIX = (
    "credentials never go in the config (it is written to the store and to "
    "Prefect): give them to the environment (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials), where s3fs, "
    "the ranks and the evaluations find them, or name a Prefect Secret or "
    "AwsCredentials block in storage.credentials_block"
)
_BLOCK_NAME = re.compile(r"^(?:[a-z0-9][a-z0-9-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _secret_paths(value: Any, path: str = "") -> list[str]:
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            name = str(k).lower()
            here = f"{path}.{k}" if path else str(k)
            if name in _SECRET_NAMES or any(w in name for w in _SECRET_WORDS):
                found.append(here)
            else:
                found += _secret_paths(v, here)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _secret_paths(v, f"{path}[{i}]")
    return found


def _no_credentials(options: dict[str, Any]) -> dict[str, Any]:
    found = _secret_paths(options)
    if found:
        raise PydanticCustomError(
            "secret_in_config", f"holds credentials ({', '.join(found)})", {"fix": CREDENTIALS_FIX}
        )
    return options


SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# the one-source shorthand's name (data.source): a run of one source has no per-source metrics
DEFAULT_SOURCE_NAME = "main"
# what a source of data.sources may set for itself; unset, it takes the data section's value
SOURCE_OPTIONS = (
    "storage_options",
    "text_field",
    "hf_name",
    "hf_split",
    "hf_revision",
    "on_decode_error",
    "max_bytes",
    "dedup",
    "decontaminate",
    "filters",
)


def _source_form(source: str) -> str:
    s = source.strip()
    if s.startswith("hf:") and not s[3:].strip():
        raise _rule("'hf:' needs a dataset", "e.g. 'hf:wikitext' or 'hf:/path/to/folder'")
    if s.startswith("builtin:") and s not in BUILTIN_SOURCES:
        raise _rule("is an unknown built-in corpus", f"use one of {', '.join(map(repr, BUILTIN_SOURCES))}")
    problem = _url_problem(s, "the source")
    if problem is not None:
        raise problem
    return source


def _options_need_a_url(options: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
    if options is None:
        return options
    _no_credentials(options)
    source = info.data.get("source")
    if options and source is not None and not _is_url_or_hf(source):
        raise _rule(f"only used with a URL source, and {source!r} is not one")
    return options


def _only_for_hf(value: str | None, info: ValidationInfo) -> str | None:
    source = info.data.get("source")
    if value and source is not None and not source.strip().startswith("hf:"):
        raise _rule("only applies to 'hf:' sources")
    return value


class SourceConfig(_Section):
    """One named source of a mixture (data.sources). Its options left unset take the data
    section's values (data.text_field, data.max_bytes, ...)."""

    name: str = _field(
        ...,
        "The source's name: in the metrics (val/NAME/loss, data/NAME/tokens), the schedule and the report.",
        fix="letters, digits, '_', '.' or '-' (max 64), starting with a letter or digit, e.g. 'web'",
        pattern=SOURCE_NAME.pattern,
    )
    source: NonBlank = _field(
        ...,
        "Where this source's raw text comes from: any form data.source takes (a path, glob, "
        "fsspec URL, 'hf:NAME' or 'builtin:stdlib').",
        fix="use 'builtin:stdlib', a path or URL to text data, or 'hf:NAME'",
    )
    weight: float = _field(
        1.0,
        "Its share of the training windows, relative to the other sources' weights (until data.schedule changes it).",
        fix="a positive number, e.g. 0.7",
        gt=0,
        allow_inf_nan=False,
    )
    storage_options: dict[str, Any] | None = Field(
        None,
        description="fsspec options for a URL source (default: data.storage_options). Never credentials.",
        json_schema_extra={"fix": "remove them or give the source as a URL"},
    )
    text_field: NonBlank | None = _field(None, "Field or column holding the text (default: data.text_field).")
    hf_name: str | None = _field(None, "Hugging Face configuration name.", fix="remove it or use an 'hf:' source")
    hf_split: NonBlank | None = _field(None, "Hugging Face split (default: data.hf_split).")
    hf_revision: str | None = _field(None, "Hub revision of an 'hf:' source.", fix="remove it or use an 'hf:' source")
    on_decode_error: Literal["fail", "skip"] | None = Field(
        None, description="A file that is not UTF-8 text (default: data.on_decode_error)."
    )
    max_bytes: int | None = _field(
        None, "Cap on raw bytes taken from this source (0 = no cap; default: data.max_bytes).", ge=0
    )
    dedup: Literal["none", "exact", "near"] | None = Field(
        None, description="Duplicate removal for this source (default: data.dedup)."
    )
    decontaminate: bool | None = Field(
        None, description="Remove this source's documents that hold evaluation items (default: data.decontaminate)."
    )
    filters: list[str | dict[str, Any]] | None = Field(
        None,
        description="Quality filters of this source (default: data.filters), e.g. "
        "['gopher_quality', 'gopher_repetition', 'c4', 'fineweb_quality'] for a web-like replay source.",
    )
    max_epochs: float | None = _field(
        None,
        "Epochs of this source's training windows the run may take (default: no limit; a "
        "source that runs out starts a new epoch in a new order).",
        fix="a positive number, e.g. 1, or leave it out",
        gt=0,
        allow_inf_nan=False,
    )
    at_max_epochs: Literal["stop", "warn"] = Field(
        "stop",
        description="When the run would go past max_epochs: 'stop' ends the run (completed, with a "
        "checkpoint) at the last step within the limit; 'warn' says so once and goes on.",
    )

    _source_form = field_validator("source")(classmethod(lambda cls, v: _source_form(v)))
    _options_need_a_url = field_validator("storage_options")(
        classmethod(lambda cls, v, info: _options_need_a_url(v, info))
    )
    _only_for_hf = field_validator("hf_name", "hf_revision")(classmethod(lambda cls, v, info: _only_for_hf(v, info)))


class ScheduleEntry(_Section):
    """From a step on, other weights (data.schedule)."""

    at_step: int = _field(
        ...,
        "The weights apply to the steps after this one (0: from the start); below train.max_steps.",
        fix="a step below train.max_steps, each entry later than the one before",
        ge=0,
    )
    weights: dict[str, float] = Field(
        ...,
        description="A weight per source name; a source left out keeps its weight from before.",
        json_schema_extra={"fix": "name sources of data.sources with positive weights, e.g. {'web': 0.2}"},
    )

    @field_validator("weights")
    @classmethod
    def _positive(cls, weights: dict[str, float]) -> dict[str, float]:
        if not weights:
            raise _rule("is empty")
        for name, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w > 0 and w < float("inf")):
                raise _rule(f"gives {name!r} the weight {w!r}, which is not a positive number")
        return weights


class DataConfig(_Section):
    source: NonBlank = _field(
        BUILTIN_SOURCE,
        "Where the raw text comes from: 'builtin:stdlib' (the Python standard "
        "library's own sources, always present); 'builtin:contracts' (a small synthetic domain "
        "corpus of template contracts, for trying a mixture); a local file, folder or glob of text "
        "(.txt/.md/.py), JSON lines (.jsonl/.json, see text_field) or Parquet files, optionally "
        ".gz/.bz2/.xz; any fsspec URL to one object, a folder or a glob (s3://bucket/data/*.jsonl, "
        "https://host/corpus.txt; see storage_options); or 'hf:NAME' for a Hugging Face dataset "
        "(a Hub name or a local dataset folder; see hf_name, hf_split, hf_revision).",
        fix="use 'builtin:stdlib', a path or URL to text data, or 'hf:NAME'",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for a URL source (e.g. {'endpoint_url': ...} for an "
        "S3-compatible store, {'anon': true} for a public bucket). Never credentials: they "
        "come from the environment, and a config holding any is refused.",
        json_schema_extra={"fix": "remove them or give data.source as a URL"},
    )
    text_field: NonBlank = _field(
        "text",
        "Field (JSON lines) or column (Parquet, Hugging Face) holding the text.",
        fix="name the field that holds the text, e.g. 'text'",
    )
    hf_name: str | None = _field(
        None,
        "Hugging Face dataset configuration (subset) name, if it has several.",
        fix="remove it or set data.source to 'hf:NAME'",
    )
    hf_split: NonBlank = _field("train", "Hugging Face dataset split to read.", fix="use a split such as 'train'")
    hf_revision: str | None = _field(
        None,
        "Hub branch, tag or commit of an 'hf:' dataset (default: main). It is "
        "resolved to a commit sha, which is the dataset's fingerprint.",
        fix="remove it or set data.source to 'hf:NAME'",
    )
    on_decode_error: Literal["fail", "skip"] = Field(
        "fail",
        description="A source file that is not UTF-8 text: 'fail' stops with its name, 'skip' "
        "leaves it out and counts it.",
    )
    max_bytes: int = _field(
        3_000_000,
        "Cap on raw bytes taken from the source (0 = no cap). Keeps the built-in corpus small enough for a CPU run.",
        fix="use 0 for no cap",
        ge=0,
    )
    val_fraction: float = _field(
        0.05,
        "Fraction of documents held out for validation, chosen by document hash.",
        fix="e.g. 0.05",
        gt=0,
        lt=0.5,
    )
    shard_tokens: int = _field(
        2_000_000,
        "Tokens per shard file (a file is closed after the document that reaches it).",
        fix="e.g. 2000000",
        ge=1024,
    )
    token_dtype: Literal["auto", "uint16", "uint32"] = Field(
        "auto",
        description="Token id type of the shard files: 'auto' is uint16 while the vocabulary "
        "fits (<= 65536 ids), else uint32.",
    )
    num_workers: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        "auto",
        description="Worker processes of the data stage's units (tokenization, dedup), or 'auto': "
        "tokenize in this process with the tokenizer's own threads on up to 2 cores (processes "
        "cost more than they give there) and run the dedup units in one worker process, else one "
        "single-threaded process per core. Each unit owns fixed slices of the corpus, so the shard "
        "files and the removals are the same whatever this is.",
        json_schema_extra={"fix": "use 'auto', or about the number of CPU cores"},
    )
    partition_bytes: int = _field(
        8 << 20,
        "Bytes of a source's stored parts (a part closes here, or at the end of a source file once it "
        "holds a quarter of this: a folder's files stay parts of their own) and of the data stage's "
        "units of work over them (the dedup features of a partition, its tokenization): a unit's "
        "memory is bounded by it, never by the corpus. Raise it for a corpus of hundreds of GB "
        "(fewer, larger units, fewer files in the store); the dataset's fingerprint, the shard "
        "files and the documents removed do not depend on it.",
        fix="a whole number of bytes from 4194304 (4 MiB: a document's hard cut, 1 Mi characters, "
        "fits in one), e.g. 268435456",
        ge=4 << 20,
    )

    dedup: Literal["none", "exact", "near"] = Field(
        "exact",
        description="Duplicate documents, removed before tokenization (cached by content): 'exact' "
        "keeps one of the documents equal after Unicode NFC and whitespace normalization; 'near' also "
        "removes those whose MinHash estimate (256 hashes) of word n-gram Jaccard similarity reaches "
        "near_dup_threshold, banded for recall (a pair 0.05 above it found with probability >= 0.95, "
        "one 0.15 below kept with >= 0.99; docs/data.md); 'none' keeps every one. The first copy survives: "
        "across a mixture, in the first source listed; within a source, in file order.",
        json_schema_extra={"fix": "use 'none', 'exact' or 'near'"},
    )
    near_dup_threshold: float = _field(
        0.8,
        "Jaccard similarity of word n-grams (MinHash estimate) from which dedup 'near' removes a document.",
        fix="a number in (0, 1], e.g. 0.8",
        gt=0,
        le=1,
    )
    near_dup_ngram: int = _field(
        5, "Words per shingle of the MinHash of dedup 'near'.", fix="a whole number from 5, e.g. 5", ge=5, le=64
    )
    decontaminate: bool | None = Field(
        None,
        description="Cut out of the training data each decontaminate_ngram-word sequence it shares with "
        "an item of the evaluation sets the run scores (eval.sets 'multiple_choice', eval.harness_tasks), "
        "with 200 characters on each side; the pieces left (200 characters or more) stay as documents, "
        "and a document cut into more than 10 goes whole (GPT-3's appendix C). The report lists the "
        "items found, per set. Empty: true where the run scores such a set, else false; "
        "true with no set to check against is refused.",
        json_schema_extra={"fix": "true, false, or leave it empty"},
    )
    decontaminate_ngram: int = _field(
        13,
        "Words of the shared sequence that makes a document contaminated (13, as GPT-3 and Llama).",
        fix="a whole number from 5, e.g. 13",
        ge=5,
        le=64,
    )
    filters: list[str | dict[str, Any]] = Field(
        [],
        description="The published heuristic quality filters, by their published names, run before "
        "dedup (off: []; per source in data.sources[].filters): 'gopher_quality' and "
        "'gopher_repetition' (Rae et al. 2021), 'c4' (Raffel et al. 2020; it drops lines, as "
        "published) and 'fineweb_quality' (Penedo et al. 2024), datatrove's implementations with "
        "their published parameters; a mapping {name: ..., param: value} changes one. Each filter's "
        "removals are counted, and a sample kept, in the log, the report and `stoker runs`.",
        json_schema_extra={"fix": "a list of filter names, e.g. ['gopher_quality', 'c4'], or []"},
    )
    decontaminate_max_docs: int = _field(
        10,
        "An evaluation item's n-gram found in more documents than this does not count (a common phrase "
        "or boilerplate, as GPT-3's decontamination had it); counted over every decontaminating source.",
        fix="a whole number from 1, e.g. 10",
        ge=1,
    )

    engine: Literal["local", "ray"] = Field(
        "local",
        description="Where the corpus is tokenized: 'local' (num_workers processes on the flow's "
        "host) or 'ray' (one Ray task per fixed partition on the cluster at ray.address, reading "
        "the corpus from the store and writing the shard files to it; the manifest is committed "
        "last). The shard files are byte-identical whatever the engine. Needs the 'ray' extra.",
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers_in_range(cls, n: Any) -> Any:
        if n == "auto":
            return n
        if isinstance(n, str) and n.strip().isdigit():
            n = int(n)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise _rule("must be 'auto' or a whole number between 1 and 256")
        return n

    def resolved_workers(self) -> int:
        """Worker processes for this host (1: in-process, with the tokenizer's threads)."""
        if self.num_workers != "auto":
            return self.num_workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return 1 if cores <= 2 else cores

    sources: list[SourceConfig] = Field(
        default_factory=list,
        description="A mixture: named sources, each with its weight and options, e.g. [{name: "
        "domain, source: ./docs, weight: 0.7}, {name: web, source: 's3://b/web/*.jsonl', weight: "
        "0.3}]. Each is tokenized into its own cached shard set with the run's one tokenizer. "
        "Empty: the one source of data.source.",
        json_schema_extra={"fix": "give each source a name and a source, or use data.source alone"},
    )
    schedule: list[ScheduleEntry] = Field(
        default_factory=list,
        description="Weight changes of data.sources at given steps, e.g. [{at_step: 900, "
        "weights: {domain: 0.8, web: 0.2}}] (annealing on the domain for the last 10%).",
        json_schema_extra={"fix": "entries in step order, each naming sources of data.sources"},
    )

    _source_form = field_validator("source")(classmethod(lambda cls, v: _source_form(v)))
    _options_need_a_url = field_validator("storage_options")(
        classmethod(lambda cls, v, info: _options_need_a_url(v, info))
    )
    _only_for_hf = field_validator("hf_name", "hf_revision")(classmethod(lambda cls, v, info: _only_for_hf(v, info)))

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, data: Any) -> Any:
        # data.source holds its default in any dumped config: only another value contradicts
        if isinstance(data, dict) and data.get("sources") and data.get("source", BUILTIN_SOURCE) != BUILTIN_SOURCE:
            raise _rule(
                "sets both data.source and data.sources",
                "give data.sources alone (data.source is the one-source shorthand), or data.source alone",
            )
        return data

    @field_validator("sources")
    @classmethod
    def _names_once(cls, sources: list[SourceConfig], info: ValidationInfo) -> list[SourceConfig]:
        seen: set[str] = set()
        for s in sources:
            if s.name in seen:
                raise _rule(f"names {s.name!r} twice", "give each source its own name")
            seen.add(s.name)
        return sources

    @field_validator("schedule")
    @classmethod
    def _schedule_names_sources(cls, schedule: list[ScheduleEntry], info: ValidationInfo) -> list[ScheduleEntry]:
        if schedule and "sources" in info.data and not info.data["sources"]:
            raise _rule("needs data.sources (a schedule changes the weights of named sources)")
        names = [s.name for s in info.data.get("sources") or []]
        last = -1
        for entry in schedule:
            if entry.at_step <= last:
                raise _rule(
                    f"has at_step {entry.at_step} after at_step {last}",
                    "list the entries in increasing at_step order, each step once",
                )
            last = entry.at_step
            unknown = sorted(set(entry.weights) - set(names))
            if names and unknown:
                raise _rule(
                    f"at_step {entry.at_step} names {', '.join(map(repr, unknown))}, not a source of data.sources",
                    f"use the names of data.sources: {', '.join(names)}",
                )
        return schedule

    def is_mixture(self) -> bool:
        return bool(self.sources)

    def source_configs(self) -> list[tuple[str, float, "DataConfig"]]:
        """(name, weight, the one-source DataConfig that downloads and shards it) per source: the
        data section's options, each overridden by what the source sets. data.source alone is
        one source named 'main' of weight 1."""
        if not self.sources:
            return [(DEFAULT_SOURCE_NAME, 1.0, self)]
        out = []
        for s in self.sources:
            update = {"source": s.source, "sources": [], "schedule": []}
            update.update({k: getattr(s, k) for k in SOURCE_OPTIONS if getattr(s, k) is not None})
            out.append((s.name, s.weight, self.model_copy(update=update)))
        return out


_OBJECT_STORES = ("s3", "gs", "gcs", "az", "abfs", "abfss", "r2")


def _url_problem(value: str, what: str) -> PydanticCustomError | None:
    """A URL whose form cannot work: an object-store URL without a bucket, an unknown-looking
    scheme spelled without '//' ... (a string test, no network)."""
    scheme, sep, rest = value.strip().partition("://")
    if not sep:
        return None
    if not scheme or not scheme.replace("+", "").replace("-", "").isalnum():
        return _rule("has no valid URL scheme", f"write {what} as scheme://..., e.g. s3://bucket/prefix")
    if scheme.lower() in _OBJECT_STORES and not rest.split("/", 1)[0]:
        return _rule("names no bucket", f"write {scheme}://<bucket>/<prefix>, e.g. {scheme}://my-bucket/stoker")
    if scheme.lower() in ("http", "https") and not rest.split("/", 1)[0]:
        return _rule("names no host", "write https://host/path")
    return None


def _is_url_or_hf(source: str) -> bool:
    source = source.strip()
    return "://" in source or source.startswith("hf:")


class TokenizerConfig(_Section):
    path: str | None = Field(
        None,
        description="A tokenizer.json to load instead of training one (local path or URL).",
    )
    vocab_size: int = _field(
        2048,
        "Vocabulary size of the byte-level BPE trained on the corpus; with 'path', "
        "at least the loaded tokenizer's size (it sizes the model's embedding).",
        fix="room for the 256 byte tokens plus specials, within uint32 ids; e.g. 2048",
        ge=260,
        le=2**32 - 1,
    )
    min_frequency: int = _field(2, "Minimum pair frequency for a BPE merge.", fix="2 is typical", ge=1)
    eot_token: NonBlank = _field(
        "<|endoftext|>",
        "End-of-text special token that ends every document in the shards.",
        fix="use the tokenizer's end-of-text token, e.g. '<|endoftext|>'",
    )
    document_end: str | None = _field(
        None,
        "The token that ends each document in the packed windows (the boundary model.attention "
        "'document' masks at). Empty: with a base, its end-of-text token: its eos, or, where its "
        "eos ends a chat turn (<|im_end|>, <|eot_id|>) and its vocabulary has an end-of-text "
        "token (<|endoftext|>, <|end_of_text|>), that one; without a base, eot_token. Set, it "
        "must be a token of the vocabulary.",
        fix="give a token of the tokenizer's vocabulary, e.g. '<|endoftext|>', or leave it empty",
        min_length=1,
    )

    @model_validator(mode="before")
    @classmethod
    def _document_end_is_the_eot(cls, data: Any) -> Any:
        """A document_end given without a base is the token a trained tokenizer ends documents
        with (eot_token); with a base, resolve_base reads it against the base's vocabulary."""
        if isinstance(data, dict) and data.get("document_end") and not data.get("path"):
            data = {**data, "eot_token": data["document_end"]}
        return data


class TrainConfig(_Section):
    seed: int = Field(1337, description="Seed of the model init and of the data order.")
    max_steps: int = _field(500, "Optimizer steps to train in total (across resumes).", ge=1)
    global_batch_size: int = _field(
        16,
        "Sequences per optimizer step across all ranks.",
        fix="use a multiple of world_size x micro_batch_size",
        ge=1,
    )
    micro_batch_size: int | Literal["auto"] = _field(
        4,
        "Sequences per rank per forward pass; the rest is gradient accumulation. 'auto': the "
        "largest that fits the device by the run's plan (stoker plan), confirmed on a GPU by a "
        "probe step at start-up; the global batch, the data order and so the run stay the same "
        "as with that value set by hand. The value chosen is logged and in the run's result.",
        fix="give a number of sequences, e.g. 4, or 'auto'",
    )
    lr: float = _field(3e-3, "Peak learning rate of AdamW.", fix="a typical value is 3e-4", gt=0)
    lr_from_base: bool | None = Field(
        None,
        description="Set by stoker when the config is loaded, for a run from a base (model.init_from). "
        "true: the config writes no train.lr (a built-in recipe not written for this base gives its rate "
        "way), so train.lr is the continued-pretraining default, set when the base is read: a tenth of "
        "the peak a base of its width was pretrained at (min(3e-3, 1.2288 / hidden size), calibrated on "
        "Llama 3, Qwen and SmolLM2: stoker.arithmetic.learning_rate), and, where the config writes "
        "none, lr_schedule 'wsd' (a re-warm and hold, trained longer or annealed by a branch), "
        "decay_steps a fifth of max_steps and min_lr 0. false: train.lr as written. Empty: no base. "
        "The plan says which, with the number.",
        json_schema_extra={"fix": "leave it empty: write train.lr to choose the rate"},
    )
    min_lr: float = _field(
        3e-4, "Learning rate at the end of the decay (cosine, linear, wsd).", fix="e.g. a tenth of lr", ge=0
    )
    warmup_steps: int = _field(
        20, "Linear warm-up steps before the schedule.", fix="a few percent of max_steps is typical", ge=0
    )
    lr_schedule: Literal["cosine", "wsd", "constant", "linear"] = Field(
        "cosine",
        description="The learning rate over the run's steps, after the warm-up: 'cosine' (to min_lr "
        "at max_steps), 'linear' (likewise, in a line), 'wsd' (warmup-stable-decay: lr until the "
        "last decay_steps steps, then decay_shape down to min_lr at the last step) or 'constant' "
        "(lr). A 'wsd' or 'constant' run's past does not depend on its end: given a larger "
        "max_steps under the same name it goes on from its newest checkpoint before its decay (retention "
        "keeps it; a change that leaves none to go on from is refused).",
        json_schema_extra={"fix": "use 'cosine', 'wsd', 'constant' or 'linear'"},
    )
    decay_steps: int | None = _field(
        None,
        "'wsd': the steps of the final decay, at the end of the run (Hagele et al. 2024: about 20% "
        "of the steps matches cosine).",
        fix="e.g. a fifth of max_steps, below max_steps - warmup_steps",
        ge=1,
        validate_default=True,
    )
    decay_shape: Literal["linear", "sqrt", "cosine"] = Field(
        "linear",
        description="'wsd': the shape of the decay from lr to min_lr: 'linear', 'sqrt' (1 - sqrt of "
        "the progress) or 'cosine'.",
        json_schema_extra={"fix": "use 'linear', 'sqrt' or 'cosine'"},
    )
    warmup_from: float = _field(
        0.0,
        "Where the linear warm-up starts, as a fraction of lr (re-warming a base from the end of its "
        "own schedule: e.g. 0.1); 0: from (nearly) zero.",
        fix="a fraction in [0, 1], e.g. 0.1",
        ge=0,
        le=1,
    )
    branch_from: str | None = _field(
        None,
        "Start this run from a committed checkpoint of another run (its URI, as `stoker checkpoints "
        "RUN` lists it, under this run's storage.root): its weights, optimizer state, step and data "
        "position. This run's config may change the schedule (decay now), the learning rate, the "
        "mixture, the evaluation, the parallelism and the world size, not the model or tokenizer. "
        "The parent run is never written; the branch records its lineage.",
        fix="give a checkpoint URI from `stoker checkpoints RUN`, or leave it empty",
        min_length=1,
    )
    branch_sha256: str | None = _field(
        None,
        "Set by stoker from train.branch_from: the sha256 of that checkpoint's commit manifest, which "
        "pins the branch to it. Leave it empty.",
        fix="leave it empty: stoker computes it from train.branch_from",
        pattern=r"^[0-9a-f]{64}$",
    )
    rewarm: bool = _field(
        False,
        "A branch (train.branch_from) warms up again from its branch point: train.warmup_steps counted "
        "from there, from warmup_from x lr up to lr; a 'cosine' or 'linear' schedule then decays over the "
        "branch's own steps, from the end of that warm-up to min_lr at max_steps ('wsd' keeps its decay "
        "over the last decay_steps). Off: the branch keeps the whole run's timeline (its warm-up counted "
        "from step 0, so none after it; a 'cosine' or 'linear' branch takes the curve of steps 0 to "
        "max_steps at its own steps).",
        fix="true only with train.branch_from; warmup_steps then counts from the branch point",
    )
    branch_step: int | None = _field(
        None,
        "Set by stoker from train.branch_from: the step of that checkpoint, where a re-warmed branch's "
        "schedule starts (train.rewarm). Leave it empty.",
        fix="leave it empty: stoker reads it from train.branch_from's checkpoint",
        ge=0,
    )
    weight_decay: float = _field(0.1, "AdamW weight decay on 2-D weights.", fix="0.1 is typical", ge=0)
    beta1: float = _field(0.9, "AdamW beta1.", fix="0.9 is typical", ge=0, lt=1)
    beta2: float = _field(0.95, "AdamW beta2.", fix="0.95 is typical", ge=0, lt=1)
    grad_clip: float = _field(
        1.0, "Clip the global gradient norm to this (0 = off).", fix="0 turns clipping off; 1.0 is typical", ge=0
    )
    log_interval: int = _field(10, "Steps between training-loss log lines.", ge=1)
    deterministic: bool | Literal["auto"] = Field(
        "auto",
        description="Deterministic torch algorithms (and, past 2 ranks, DDP's gradient "
        "buckets fixed) so a run resumed at the same world size ends bitwise equal to one that "
        "never stopped. 'auto': on with CPU ranks (it costs almost nothing there), off on CUDA "
        "(it costs speed; a resumed GPU run is then equal up to rounding). true or false: "
        "always on or off.",
        json_schema_extra={"fix": "give true, false or 'auto'"},
    )
    nonfinite: Literal["fail", "skip"] = Field(
        "fail",
        description="What a step whose loss or gradient norm is NaN/inf does. 'fail': "
        "the run stops within one log interval (and before any checkpoint), naming the step, and "
        "is not retried. 'skip': the step's update is not applied (the step number, the data "
        "order and the learning-rate schedule go on), up to nonfinite_skip_limit skipped steps, "
        "then fail; skip reads one flag per step (a host sync the fail policy does not need).",
        json_schema_extra={"fix": "use 'fail' (the default) or 'skip'"},
    )
    nonfinite_skip_limit: int = _field(
        3,
        "Under nonfinite='skip': how many non-finite steps one launch may skip before it fails.",
        fix="a small count such as 3; 0 fails at the first non-finite step",
        ge=0,
    )

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _a_count_or_auto(cls, value: Any) -> Any:
        """One problem for a bad value, not one per member of the union."""
        if value == "auto":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _rule("must be a whole number of sequences of at least 1, or 'auto'")
        return value

    @field_validator("min_lr")
    @classmethod
    def _min_lr_below_lr(cls, min_lr: float, info: ValidationInfo) -> float:
        lr = info.data.get("lr")
        if lr is not None and min_lr > lr:
            raise _rule(f"must be in [0, lr] with lr={lr}")
        return min_lr

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_below_max_steps(cls, warmup_steps: int, info: ValidationInfo) -> int:
        max_steps = info.data.get("max_steps")
        if max_steps is not None and warmup_steps >= max_steps:
            raise _rule(f"must be below max_steps={max_steps}")
        return warmup_steps

    @field_validator("decay_steps", mode="after")
    @classmethod
    def _decay_within_the_run(cls, decay_steps: int | None, info: ValidationInfo) -> int | None:
        kind, max_steps, warmup = (
            info.data.get("lr_schedule"),
            info.data.get("max_steps"),
            info.data.get("warmup_steps"),
        )
        if kind == "wsd" and decay_steps is None:
            raise _rule(
                "is empty, and lr_schedule 'wsd' decays over the last decay_steps steps",
                "set it, e.g. a fifth of max_steps",
            )
        if kind == "wsd" and max_steps is not None and warmup is not None and decay_steps > max_steps - warmup:
            raise _rule(
                f"is longer than the {max_steps - warmup} steps after the warm-up (max_steps={max_steps}, "
                f"warmup_steps={warmup})",
                f"use at most {max_steps - warmup}, or raise train.max_steps",
            )
        return decay_steps

    @field_validator("rewarm")
    @classmethod
    def _rewarm_needs_a_branch(cls, rewarm: bool, info: ValidationInfo) -> bool:
        if rewarm and not info.data.get("branch_from"):
            raise _rule(
                "is true, and this run is no branch: a run warms up from step 0 as it is",
                "set train.branch_from (or stoker run --branch-from URI), or leave rewarm false",
            )
        return rewarm


class CheckpointConfig(_Section):
    interval_steps: int = _field(
        100,
        "Steps between checkpoints (the last step always saves, and so does the step where a 'wsd' decay begins).",
        ge=1,
    )
    keep_latest_k: int = _field(
        2,
        "Committed checkpoints to keep; at least 2, as the newest may still be uploading.",
        fix="keep at least 2, as the newest may still be uploading",
        ge=2,
    )
    async_enabled: bool = Field(
        True,
        description="Upload in the background while training goes on (False: the step "
        "waits for save, upload and commit).",
    )
    upload_timeout_seconds: float = _field(
        900.0,
        "How long one rank keeps retrying (with backoff) its upload of one "
        "checkpoint before the checkpoint is given up (reported, never committed).",
        fix="e.g. 900",
        gt=0,
    )
    commit_timeout_seconds: float = _field(
        1200.0,
        "How long rank 0 waits for every rank's upload receipt before it gives the checkpoint up.",
        fix="give at least upload_timeout_seconds, e.g. 1200",
        gt=0,
    )
    max_pending_uploads: int = _field(
        2,
        "Checkpoints written to local staging and waiting for their upload (an object-store "
        "outage): when a new one is written while this many wait, the oldest waiting one that "
        "has not started its upload is dropped (its staging deleted, a checkpoint_dropped "
        "record, never committed), so the local disk holds at most this many (one more at 1, "
        "while one uploads) and training never waits for the store. The upload under way is "
        "never dropped, so a store slower than the checkpoints still commits every other one.",
        fix="give at least 1, e.g. 2 (each costs one checkpoint of local disk per host)",
        ge=1,
    )
    evaluation_pin_seconds: float = _field(
        7200.0,
        "With eval.per_checkpoint_enabled, each committed checkpoint is pinned until its "
        "evaluation is done, and retention (keep_latest_k) spares it meanwhile; a pin older than "
        "this (an evaluation that died) no longer keeps it.",
        fix="give more than an evaluation takes with its retries, e.g. 7200",
        gt=0,
    )

    @field_validator("commit_timeout_seconds")
    @classmethod
    def _commit_outwaits_upload(cls, commit: float, info: ValidationInfo) -> float:
        upload = info.data.get("upload_timeout_seconds")
        if upload is not None and commit < upload:
            raise _rule(f"must be >= upload_timeout_seconds={upload}")
        return commit


EVAL_SETS = ("loss", "bpb", "multiple_choice")  # eval.sets: what a checkpoint's evaluation measures


class EvalConfig(_Section):
    interval_steps: int = _field(100, "Steps between validation-loss evaluations.", ge=1)
    num_batches: int = _field(8, "Validation batches (of micro_batch_size per rank) per evaluation.", ge=1)
    per_checkpoint_enabled: bool = Field(
        True,
        description="Evaluate every committed checkpoint in its own task run (a separate "
        "process) while training goes on.",
    )
    sets: list[Literal["loss", "bpb", "multiple_choice"]] = Field(
        default_factory=lambda: list(EVAL_SETS),
        description="What the evaluation of a committed checkpoint (a process of its own) "
        "measures: 'loss' (validation loss and perplexity over the validation split; always "
        "listed), 'bpb' (bits per byte of the same windows: the loss per UTF-8 byte of text, so "
        "runs with other tokenizers compare; almost free), 'multiple_choice' (accuracy on "
        "stoker's vendored set of next-line questions about standard-library code, scored as "
        "HellaSwag is: eval.multiple_choice_items items).",
        json_schema_extra={"fix": "give a list of 'loss', 'bpb' and 'multiple_choice', with 'loss' in it"},
    )
    multiple_choice_items: int = _field(
        100,
        "Items of the vendored multiple-choice set (500 in all) that eval.sets 'multiple_choice' "
        "scores: the first N, each 4 forward rows of up to block_size tokens.",
        fix="a number from 1 to 500, e.g. 100",
        ge=1,
        le=500,
    )

    @field_validator("sets", mode="before")
    @classmethod
    def _known_sets(cls, sets: Any) -> Any:
        if isinstance(sets, str):  # one name, as --set eval.sets=bpb gives it
            sets = [sets]
        if not isinstance(sets, (list, tuple)):
            return sets
        unknown = [s for s in sets if s not in EVAL_SETS]
        if unknown:
            raise _rule(f"{', '.join(map(repr, unknown))}: not an evaluation set")
        if "loss" not in sets:
            raise _rule("leaves out 'loss', which every evaluation measures", "add 'loss' to the list")
        return list(dict.fromkeys(sets))  # each once, in the order given

    harness_tasks: list[NonBlank] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks (the 'harness' extra: pip install 'stoker[harness]') "
        "that `stoker harness` runs on an exported checkpoint: local-file tasks only, "
        "nothing is downloaded. 'stoker_mc' is stoker's vendored multiple-choice set as an "
        "lm-eval task; eval.harness_include adds your own. Empty: none.",
        json_schema_extra={"fix": "give task names, e.g. ['stoker_mc'], or an empty list"},
    )
    harness_include: list[NonBlank] = Field(
        default_factory=list,
        description="Folders of lm-eval task YAML files (e.g. dataset_path: json with "
        "dataset_kwargs.data_files naming a local file) whose tasks eval.harness_tasks may name, "
        "beside stoker's own (stoker/evalsets/harness).",
        json_schema_extra={"fix": "give folders that hold lm-eval task YAML files"},
    )
    harness_limit: int | None = _field(
        None,
        "Items of each harness task that are scored (the first N); empty: every item.",
        fix="a whole number of at least 1, or leave it empty for every item",
        ge=1,
    )

    @field_validator("harness_tasks", "harness_include", mode="before")
    @classmethod
    def _one_or_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # --set eval.harness_tasks=stoker_mc


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class NodeConfig(_Section):
    """One node of launch.nodes: where its torchrun agent runs and how the others reach it."""

    prefix: list[NonBlank] = Field(
        default_factory=list,
        description="Command that starts this node's torchrun agent on its machine, one word per "
        "item, run as is (no shell): ['srun', '--nodes=1', '--ntasks=1', '--nodelist=host1'] or "
        "['ssh', 'host1']. The agent gets this host's environment and env only through a "
        "prefix that passes them on (srun does, ssh does not). Empty: this host.",
        json_schema_extra={"fix": "give the command as a list of words, e.g. ['ssh', 'host1']"},
    )
    address: str | None = Field(
        None,
        description="Where the other nodes reach this one (torchrun --local-addr), on the "
        "interface env names. The node whose address is launch.rdzv_host hosts the rendezvous.",
        json_schema_extra={"fix": "give an IP address or host name, e.g. '10.0.0.11'"},
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Added to the agent's environment: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME "
        "(the interface of address), STOKER_CACHE (the node's cache folder). Never credentials.",
        json_schema_extra={"fix": "give variable names such as GLOO_SOCKET_IFNAME"},
    )

    @field_validator("prefix")
    @classmethod
    def _a_list_of_words(cls, prefix: list[str]) -> list[str]:
        if prefix and len(prefix[0].split()) > 1:  # no program's name holds a space
            raise _rule(
                "is one shell string", f"give one word per item: {prefix[0].split()!r}; it is run without a shell"
            )
        return prefix

    @field_validator("address")
    @classmethod
    def _an_address(cls, address: str | None) -> str | None:
        if address is None or not address.strip():
            return None
        address = address.strip()
        if len(address.split()) > 1 or "/" in address:
            raise _rule("is not an address")
        return address

    @field_validator("env")
    @classmethod
    def _names_without_credentials(cls, env: dict[str, str]) -> dict[str, str]:
        _no_credentials(env)  # first: the other problem's line would show the values
        bad = [name for name in env if not _ENV_NAME.match(name)]
        if bad:
            raise _rule(
                f"{bad!r} cannot be an environment variable's name",
                "use letters, digits and '_', e.g. GLOO_SOCKET_IFNAME",
            )
        return env


class LaunchConfig(_Section):
    launcher: Literal["local", "ray"] = Field(
        "local",
        description="'local': torchrun agents (num_nodes simulated nodes on this host, or "
        "one per host with launch.nodes). 'ray': Ray Train workers (TorchTrainer, num_nodes x "
        "nproc_per_node of them) on the cluster at ray.address; needs the 'ray' extra: pip "
        "install 'stoker[ray]'.",
    )
    num_nodes: int = _field(
        1,
        "torchrun agents (nodes) meeting by c10d rendezvous: simulated on this host, or where launch.nodes puts them.",
        ge=1,
    )
    nproc_per_node: int = _field(2, "Training ranks per node.", ge=1)
    accelerator: str | None = _field(
        None,
        "The GPU model of each rank, for the run's plan (stoker plan; the refusal of a run that "
        "cannot fit; train.micro_batch_size 'auto'): e.g. 'H100', 'H200', 'A100-40GB', 'L40S'. "
        "Empty: this host's GPU, read from the driver, or none (CPU ranks).",
        fix="give a GPU model such as 'H100', or leave it empty",
        min_length=1,
    )
    device_memory_gib: float | None = _field(
        None,
        "Memory of one device in GiB, for the plan: needed for a GPU model stoker does not "
        "know; overrides the known one (e.g. 75 to keep a margin).",
        fix="give the device's memory in GiB, e.g. 80",
        gt=0,
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; 'auto' is NCCL with GPUs, gloo otherwise."
    )
    nodes: list[NodeConfig] | None = Field(
        None,
        description="Where each node's torchrun agent runs, one entry per node (num_nodes): "
        "the command prefix that starts it on its machine, its address and environment. Empty: "
        "every node on this host.",
        json_schema_extra={"fix": "give one entry per node, or leave it empty"},
    )
    rdzv_host: str = Field(
        "127.0.0.1",
        validate_default=True,
        description="Host of the c10d rendezvous endpoint. With launch.nodes: the address of the "
        "node whose agent hosts it.",
        json_schema_extra={"fix": "give the address of one node of launch.nodes"},
    )
    rdzv_port: int | None = _field(
        None,
        "Port of the rendezvous endpoint. Needed when its node is another machine (has a "
        "prefix); empty: a free port of this host.",
        fix="give the port the rendezvous node listens on, e.g. 29500",
        ge=1,
        le=65535,
        validate_default=True,
    )
    timeout_seconds: int = _field(3600, "Wall-clock limit of one training launch.", ge=10)
    max_attempts: int = _field(2, "Launch attempts; each retry resumes from the newest valid checkpoint.", ge=1)
    max_restarts: int = _field(
        2,
        "In-place restarts per launch attempt: when a rank dies, torchrun restarts the ranks "
        "and they load the newest valid checkpoint themselves (seconds, not a relaunch). A "
        "failure no restart can fix (a bug, a bad input) is not restarted. 0: every failure "
        "goes to a new launch attempt.",
        fix="e.g. 2, or 0 to relaunch instead",
        ge=0,
        le=100,
    )
    concurrency_limit: str = Field(
        "stoker-accelerators",
        description="Prefect global concurrency limit a launch holds one slot of while its ranks "
        "run, so two runs never take the same accelerators; `stoker deploy` creates it with one "
        "slot. Not on the server (an embedded server, a notebook) or empty: no limit. Give each "
        "machine's runs their own name to run one per machine.",
    )
    hang_timeout_seconds: int = _field(
        300,
        "Hang watchdog: when no training step finishes for this long (rank 0 "
        "reports each one), the gang is killed and the launch fails as transient (retried from "
        "the newest valid checkpoint). Armed at rank 0's first report, so start-up (rendezvous, "
        "loading shards and the checkpoint, the step-0 evaluation) counts only against "
        "timeout_seconds. Keep it above the slowest step plus an evaluation and a checkpoint "
        "save. 0 turns the watchdog off.",
        fix="give 0 (watchdog off) or more than the slowest step plus an evaluation and a checkpoint save, e.g. 300",
        ge=0,
    )

    startup_timeout_seconds: int = _field(
        900,
        "Start-up watchdog: when rank 0 has not reported (its step-0 evaluation or first step) "
        "this long after the launch, start-up has hung (a rendezvous that never completes, a rank "
        "stuck loading) and the gang is killed; the launch fails as transient and is retried. "
        "Give it room for rendezvous, loading the shards and the checkpoint, compiling, and the "
        "step-0 evaluation. 0 turns it off.",
        fix="give 0 (off) or the longest start-up plus a margin, e.g. 900",
        ge=0,
    )
    takeover: bool = Field(
        False,
        description="Take the run over from another launch that holds its lease "
        "({root}/runs/{run}/lease.json) and is still alive: that launch stops at its next "
        "heartbeat. Without it a second launch of the run refuses in one line naming the holder; "
        "a lease whose heartbeat expired (launch.lease_seconds), or whose process on this host "
        "is gone, is taken without it. The CLI's `stoker run --takeover` sets it.",
    )
    lease_seconds: int = _field(
        90,
        "How long the run lease lasts without a heartbeat (renewed every third of it by the "
        "process that launches training). After that another launch may take the run over.",
        fix="give at least 10 seconds, e.g. 90",
        ge=10,
    )
    collective_timeout_seconds: int = _field(
        1800,
        "How long a rank waits in one collective (the process group's timeout, NCCL's and "
        "gloo's) before it fails with an error naming the collective, instead of hanging: "
        "longer than any wait of one rank for another (a peer loading and checking a "
        "checkpoint from the store, compiling, evaluating, a synchronous checkpoint save). "
        "NCCL's own default is 10 minutes, which a slow checkpoint download can exceed.",
        fix="give at least the longest checkpoint download and check plus a compile, e.g. 1800",
        ge=60,
    )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    @field_validator("nodes")
    @classmethod
    def _one_per_node(cls, nodes: list[NodeConfig] | None, info: ValidationInfo) -> list[NodeConfig] | None:
        if not nodes:
            return None  # an empty list (the UI form's) is no list
        if info.data.get("launcher") == "ray":
            raise _rule(
                "places torchrun agents, and launch.launcher is 'ray'",
                "remove launch.nodes (Ray places its workers), or use launcher 'local'",
            )
        num_nodes = info.data.get("num_nodes")
        if num_nodes is not None and len(nodes) != num_nodes:
            raise _rule(
                f"gives {len(nodes)} node(s) for num_nodes={num_nodes}",
                f"give one entry per node, or set launch.num_nodes to {len(nodes)}",
            )
        return nodes

    @field_validator("rdzv_host")
    @classmethod
    def _a_node_hosts_the_rendezvous(cls, host: str, info: ValidationInfo) -> str:
        nodes = info.data.get("nodes")
        if not nodes:  # none given, or they failed (reported on their own)
            return host
        hosting = [i for i, node in enumerate(nodes) if node.address == host]
        addresses = [node.address for node in nodes if node.address]
        if not hosting:
            raise _rule(
                "is no node's address: the rendezvous is hosted by the node whose address it is",
                f"give one of {addresses}"
                if addresses
                else "give that node's address in launch.nodes[i].address and here",
            )
        if len(hosting) > 1:
            raise _rule(
                f"is the address of nodes {hosting}", "give each node its own address: one node hosts the rendezvous"
            )
        return host

    @field_validator("rdzv_port")
    @classmethod
    def _port_of_a_remote_rendezvous(cls, port: int | None, info: ValidationInfo) -> int | None:
        nodes, host = info.data.get("nodes"), info.data.get("rdzv_host")
        if port is not None or not nodes or host is None:
            return port
        for i, node in enumerate(nodes):
            if node.address == host and node.prefix:
                raise _rule(
                    f"is needed: the rendezvous host {host} is node {i}, started on "
                    f"another machine ({node.prefix[0]}), where no free port can be "
                    "picked from here"
                )
        return port

    @field_validator("hang_timeout_seconds")
    @classmethod
    def _off_or_long_enough(cls, seconds: int) -> int:
        if 0 < seconds < 5:
            raise _rule("must be 0 (watchdog off) or >= 5")
        return seconds


class RayConfig(_Section):
    """The Ray cluster behind launch.launcher 'ray' and data.engine 'ray'. Where work runs, not
    what it computes: left out of the run's identity."""

    address: str | None = Field(
        None,
        description="The cluster: 'ray://HEAD:10001' (Ray Client, from any host that reaches the "
        "head), 'auto' or 'HOST:6379' (from a host that is a node of the cluster). Empty: a "
        "local Ray instance started for the job on 127.0.0.1 and stopped after it. Every node "
        "needs stoker installed and must reach storage.root (an object store, not a local "
        "folder, once the cluster spans hosts).",
        json_schema_extra={"fix": "give ray://HOST:10001, auto or HOST:PORT, or leave it empty"},
    )
    cpus_per_worker: float = _field(
        1.0,
        "CPUs a training worker reserves (Ray's ScalingConfig resources_per_worker).",
        fix="e.g. 1 or 4",
        gt=0,
        le=1024,
    )
    cpus_per_data_task: float = _field(
        1.0, "CPUs a tokenizing task reserves (data.engine 'ray').", fix="e.g. 1", gt=0, le=1024
    )

    @field_validator("address")
    @classmethod
    def _address(cls, address: str | None) -> str | None:
        if address is None or not address.strip():
            return None
        address = address.strip()
        if address == "auto" or address.startswith("ray://"):
            return address
        host, sep, port = address.rpartition(":")
        if not sep or not host or "/" in address or not port.isdigit():
            raise _rule("is not a Ray address")
        return address


# torch.distributed.fsdp.fully_shard is public from torch 2.6, but the sharded init
# (distribute_tensor's src_data_rank=None: every rank fills its own shard, no communication)
# is 2.7's
FSDP2_TORCH = (2, 7)


class EngineConfig(_Section):
    """How the ranks compute: none of it changes what the run is (a run may resume with other
    engine settings), so it is left out of the run's identity."""

    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="Matmul precision: 'bf16' autocast (fp32 weights and optimizer), "
        "'fp32', or 'auto': bf16 on a CUDA device that supports it, fp32 otherwise.",
    )
    tf32: bool = Field(True, description="On CUDA, let fp32 matmuls and convolutions use TF32.")
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the model: 'auto' is on for CUDA, off on CPU (a compiled first step takes 20-60 s).",
    )
    compile_tuning: Literal["none", "coordinate-descent", "max-autotune"] = Field(
        "none",
        description="How hard torch.compile tunes, with compile on: 'coordinate-descent' "
        "tunes the launch parameters of each fused kernel (on an H100, bench_gpu's bare loop "
        "with cuDNN attention went from 42.0% to 42.7% MFU, its first compile from ~25 s to "
        "~150 s); 'max-autotune' also times Triton matmul kernels against cuBLAS (a first "
        "compile of minutes).",
    )
    fused_optimizer: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Fused AdamW kernels: 'auto' is fused on CUDA, multi-tensor "
        "(foreach) on CPU; 'off' is the plain per-parameter loop.",
    )
    parallelism: Literal["ddp", "fsdp", "fsdp+tp"] = Field(
        "ddp",
        description="'ddp': replicated model, gradients all-reduced. 'fsdp': FSDP2 "
        "(fully_shard per block and on the root; bf16 params, fp32 gradient reduction under "
        "bf16) for models whose state does not fit on one device; needs torch 2.7 or newer. "
        "'fsdp+tp' (llama family): FSDP2 over the data-parallel dimension of a 2D mesh and "
        "tensor parallel within each group of engine.tp_degree ranks of a node (torchtitan's "
        "plan: column- and row-wise projections, sequence-parallel norms, a "
        "vocabulary-parallel loss); the global batch is split over world_size / tp_degree "
        "replicas. Checkpoints load under any other parallelism and mesh.",
    )
    tp_degree: int = _field(
        1,
        "Ranks of one tensor-parallel group under engine.parallelism 'fsdp+tp' (2 or more; a "
        "divisor of launch.nproc_per_node, and of the model's n_head, n_kv_head, "
        "intermediate_size and block_size); 1 with 'ddp' and 'fsdp'.",
        fix="e.g. 2, 4 or 8 with 'fsdp+tp', else 1",
        ge=1,
        validate_default=True,  # 'fsdp+tp' with the default 1 is refused
    )
    ep_degree: int = _field(
        1,
        "Expert parallel (a mixture of experts: the qwen3_moe and mixtral families): each "
        "sparse layer's experts are split over groups of ep_degree ranks, tokens sent to their "
        "expert's rank and back by all-to-all, under engine.parallelism 'fsdp' (the experts "
        "sharded by FSDP2 over world_size / ep_degree ranks, the rest over all). A divisor of "
        "the world size and of model.num_experts; 1: every rank runs every expert. "
        "Checkpoints load under any other ep_degree and world size.",
        fix="e.g. 2, 4 or 8 (a divisor of the world size and of model.num_experts), or 1",
        ge=1,
    )
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        "none",
        description="'full': recompute each block in the backward pass (about a third "
        "more compute for the least activation memory). 'selective': keep the outputs of the "
        "matmuls and attention and recompute only the cheap ops between them (LayerNorm, GELU, "
        "dropout, residual adds): less memory than 'none' for little extra compute.",
    )
    cross_entropy: Literal["standard", "chunked"] = Field(
        "standard",
        description="'standard': the output matmul makes the whole (tokens x "
        "vocabulary) logits, then the loss. 'chunked': the matmul and the loss run "
        "engine.cross_entropy_chunk tokens at a time, with the gradient made in the forward "
        "pass, so the whole logits, their fp32 copy and their gradient never exist (GBs at "
        "GPT-2's vocabulary): a larger micro-batch fits. The same loss up to rounding.",
    )
    cross_entropy_chunk: int = _field(
        4096, "Tokens per chunk of the 'chunked' cross-entropy: fewer hold less memory and make smaller matmuls.", ge=1
    )
    prefetch: bool = Field(
        True,
        description="Prepare the next batch in a background thread while the step runs "
        "(pinned memory, non-blocking copies on CUDA).",
    )

    @field_validator("tp_degree")
    @classmethod
    def _tp_degree_fits_the_parallelism(cls, tp_degree: int, info: ValidationInfo) -> int:
        parallelism = info.data.get("parallelism")
        if parallelism == "fsdp+tp" and tp_degree == 1:
            raise _rule(
                "is 1, and engine.parallelism 'fsdp+tp' splits the model over groups of tp_degree ranks",
                "set 2 or more (a divisor of launch.nproc_per_node), or use engine.parallelism 'fsdp'",
            )
        if parallelism in ("ddp", "fsdp") and tp_degree > 1:
            raise _rule(
                f"splits the model over ranks, which engine.parallelism '{parallelism}' does not do",
                "set engine.parallelism to 'fsdp+tp', or tp_degree to 1",
            )
        return tp_degree

    @field_validator("cross_entropy")
    @classmethod
    def _whole_loss_under_tensor_parallel(cls, cross_entropy: str, info: ValidationInfo) -> str:
        if cross_entropy == "chunked" and info.data.get("parallelism") == "fsdp+tp":
            raise _rule(
                "'chunked' is not done under engine.parallelism 'fsdp+tp', whose loss is "
                "vocabulary-parallel (a rank holds 1/tp_degree of the logits)",
                "use 'standard'",
            )
        return cross_entropy

    @field_validator("compile", "fused_optimizer", mode="before")
    @classmethod
    def _on_off_words(cls, value: Any) -> Any:
        """YAML reads on and off (in a recipe, or a --set value) as true and false: they mean
        the words."""
        return ("on" if value else "off") if isinstance(value, bool) else value

    def cpu_problems(self) -> list[str]:
        """What ranks on CPUs cannot do of these settings: checked on the host before the
        launch (launch.devices, for the ranks it starts there) and by each rank."""
        problems = []
        if self.fused_optimizer == "on":
            problems.append(
                "engine.fused_optimizer: fused AdamW needs a CUDA device and the "
                "ranks run on CPUs; use 'auto' or 'off'."
            )
        if self.compile_tuning != "none" and self.compile == "auto":
            problems.append(
                f"engine.compile_tuning: '{self.compile_tuning}' tunes torch.compile, "
                "which engine.compile 'auto' leaves off on CPUs; use 'none', or set "
                "engine.compile to 'on'."
            )
        return problems

    def torch_problems(self, torch_version: str) -> list[str]:
        """What ranks with this torch (its version string, e.g. '2.5.1+cu124') cannot do of
        these settings: checked on the host before the launch, from the installed package's
        metadata, and by each rank."""
        found = re.match(r"(\d+)\.(\d+)", torch_version)
        release = (int(found[1]), int(found[2])) if found else (0, 0)
        if self.parallelism in ("fsdp", "fsdp+tp") and release < FSDP2_TORCH:
            return [
                f"engine.parallelism: '{self.parallelism}' needs torch {FSDP2_TORCH[0]}.{FSDP2_TORCH[1]} or newer "
                f"(FSDP2's fully_shard and its sharded init) and the ranks have torch {torch_version}; upgrade torch, or "
                "use 'ddp'."
            ]
        return []

    @field_validator("compile_tuning")
    @classmethod
    def _tunes_a_compile(cls, tuning: str, info: ValidationInfo) -> str:
        if tuning != "none" and info.data.get("compile") == "off":
            raise _rule(
                "tunes torch.compile, which engine.compile turns off",
                "use 'none', or set engine.compile to 'on' or 'auto'",
            )
        return tuning


class StorageConfig(_Section):
    root: NonBlank = Field(
        default_factory=default_root,
        description="Object-store root URL: file:///abs/path, s3://bucket/prefix, or any fsspec "
        "URL. Defaults to ./stoker-data (or $STOKER_ROOT).",
        json_schema_extra={"fix": "use file:///abs/path or s3://bucket/prefix"},
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options (e.g. {'endpoint_url': ...} for S3). Never "
        "credentials: they come from the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
        "or AWS_PROFILE), and a config holding any is refused.",
    )

    credentials_block: str | None = Field(
        None,
        description="Name of a Prefect block holding the S3 credentials of the store and of S3 "
        "sources: a Secret block whose value is a JSON object with aws_access_key_id and "
        "aws_secret_access_key (and aws_session_token), e.g. 'stoker-s3', or an AwsCredentials "
        "block of prefect-aws as 'aws-credentials/NAME'. Loaded on the host that runs the flow; "
        "the ranks and evaluations get them as AWS_* variables. Empty: the environment or "
        "AWS_PROFILE.",
        json_schema_extra={
            "fix": "give a block name such as 'stoker-s3' or 'aws-credentials/stoker-s3', or leave it empty"
        },
    )

    @field_validator("storage_options")
    @classmethod
    def _without_credentials(cls, options: dict[str, Any]) -> dict[str, Any]:
        return _no_credentials(options)

    @field_validator("credentials_block")
    @classmethod
    def _block_name(cls, name: str | None) -> str | None:
        if name is not None and not name.strip():
            return None
        if name is not None and not _BLOCK_NAME.match(name.strip()):
            raise _rule(
                "is not a Prefect block name",
                "give NAME (a Secret block) or BLOCK-TYPE/NAME, e.g. 'aws-credentials/stoker-s3'",
            )
        return name.strip() if name else None

    @field_validator("root")
    @classmethod
    def _absolute(cls, root: str) -> str:
        if "://" not in root and not os.path.isabs(root):  # a string test, no filesystem access
            raise _rule(
                "is relative", "give an absolute path or a URL such as file:///data/stoker or s3://bucket/prefix"
            )
        problem = _url_problem(root, "the root")
        if problem is not None:
            raise problem
        if root.startswith("file://") and not root[len("file://") :].startswith("/"):
            raise _rule("is a relative file:// URL", "write file:///absolute/path (three slashes)")
        return root


class MetricsConfig(_Section):
    """Where the run's metric records (those rank 0 keeps in {run}/metrics.jsonl) also go. The
    sinks run beside the flow, on the host that launches the ranks, fed from the ranks' event
    stream; they are not part of the run's identity."""

    tensorboard_enabled: bool = Field(
        False,
        description="Write TensorBoard event files of the training and validation "
        "metrics to {root}/runs/{run}/tensorboard/ (tensorboard --logdir <that folder>). Needs "
        "the 'metrics' extra: pip install 'stoker[metrics]'.",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="Also log the metrics (and the config as parameters) to MLflow at this "
        "tracking URI: http(s)://host:5000, sqlite:////abs/mlflow.db, file:///abs/mlruns (MLflow 3 "
        "wants MLFLOW_ALLOW_FILE_STORE=true for that one) or databricks. One MLflow run per stoker "
        "run (tag stoker.run_name), continued when the run resumes. Empty: off. Needs the "
        "'metrics' extra: pip install 'stoker[metrics]'.",
        json_schema_extra={
            "fix": "give http(s)://host:port, sqlite:////abs/path.db or file:///abs/path, or leave it empty"
        },
    )
    mlflow_experiment: NonBlank = _field(
        "stoker", "MLflow experiment of the run (created when missing).", fix="e.g. 'stoker'"
    )

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _tracking_uri(cls, uri: str | None) -> str | None:
        if uri is None or not uri.strip():
            return None
        uri = uri.strip()
        scheme, sep, rest = uri.partition("://")
        if "@" in rest.split("/", 1)[0]:
            raise PydanticCustomError(
                "secret_in_config",
                "holds credentials (user:password@)",
                {
                    "fix": "give them to the environment: MLFLOW_TRACKING_USERNAME and "
                    "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
                },
            )
        problem = _url_problem(uri, "the tracking URI")
        if problem is not None:
            raise problem
        if scheme == "file" and not rest.startswith("/"):
            raise _rule("is a relative file:// URL", "write file:///absolute/path (three slashes)")
        if not sep and uri != "databricks" and not os.path.isabs(uri):  # a string test
            raise _rule("is relative: it would depend on where the flow runs")
        return uri


class CostConfig(_Section):
    """The price of the run's accelerators, for the goodput and cost ledger (the run report,
    `stoker runs`): every second of a flow run is attributed to one cause and priced at
    per_accelerator_hour x launch.world_size (num_nodes x nproc_per_node). Not part of the
    run's identity."""

    per_accelerator_hour: float | None = _field(
        None,
        "Price of one accelerator (one rank's GPU, or CPU slot) for one hour, in your currency, "
        "e.g. 2.5. The ledger prices each cause at this x launch.world_size; time spent queued "
        "(before the flow run started) is shown but not priced, since no accelerator is held "
        "then. Empty or 0: no price shown.",
        fix="give the hourly price of one accelerator, e.g. 2.5, or leave it empty",
        ge=0,
    )


class EventsConfig(_Section):
    """Prefect events the run emits (``stoker.checkpoint.committed``, ``stoker.run.step``,
    ``stoker.run.stalled``, ``stoker.run.failed``) and the per-launch automation that marks a
    flow run stalled. Sent best-effort from the process that launches the ranks: emitting never
    waits for the server and never fails training. Not part of the run's identity."""

    enabled: bool = Field(
        True,
        description="Emit the run's Prefect events, and create the stalled-run automation of each "
        "launch (removed when the launch ends). Off: no event, no automation.",
    )
    step_interval_seconds: float = _field(
        10.0,
        "Heartbeats: at most one stoker.run.step event per this many seconds (each carries the "
        "step, the last loss and the recent median step time).",
        fix="give at least 1 second, e.g. 10",
        ge=1.0,
    )
    stall_factor: float = _field(
        20.0,
        "The stalled-run automation fires when no stoker.run.step event arrives for "
        "max(stall_min_seconds, stall_factor x the recent median step time) plus "
        "step_interval_seconds (the heartbeat period is added so the rate bound never looks like "
        "a stall). Keep the window above the longest pause between steps (an evaluation, a "
        "synchronous checkpoint save).",
        fix="give a factor of at least 2, e.g. 20",
        ge=2.0,
    )
    stall_min_seconds: float = _field(
        120.0,
        "The shortest stall window, whatever the step time (Prefect's proactive triggers need 10 s "
        "at least). Keep it above the step-0 evaluation and a checkpoint save.",
        fix="give at least 10 seconds, e.g. 120",
        ge=10.0,
    )
    stall_action: Literal["mark", "cancel"] = Field(
        "mark",
        description="What the stalled-run automation does: 'mark' sets the flow run's state to "
        "Running named 'Stalled' (the UI shows it; the run goes on, and stoker's own hang watchdog, "
        "launch.hang_timeout_seconds, still kills a gang that truly hangs); 'cancel' cancels the "
        "flow run (the gang is stopped as on any cancel).",
    )
