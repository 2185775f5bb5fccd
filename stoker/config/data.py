"""The data section (``DataConfig``): where the raw text comes from, one source or a mixture
of named sources (``SourceConfig``) with its weight changes over the steps (``ScheduleEntry``),
and what is done to it before training: filters, dedup, decontamination, sharding."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from stoker.config.checks import _no_credentials, _url_problem
from stoker.fields import NonBlank, _field, _rule, _Section

BUILTIN_SOURCE = "builtin:stdlib"
# the built-in corpora: general text (the standard library's sources) and a small synthetic
# domain corpus (data.synthetic: template contracts), for mixtures and anneals out of the box
BUILTIN_SOURCES = (BUILTIN_SOURCE, "builtin:contracts")

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


def _is_url_or_hf(source: str) -> bool:
    source = source.strip()
    return "://" in source or source.startswith("hf:")


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
        "single-threaded process per core; more than one also reads a folder of 64 MiB or more "
        "ahead of the writer, whole files a process. Each unit owns fixed slices of the corpus, so "
        "the stored parts, the shard files and the removals are the same whatever this is.",
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
