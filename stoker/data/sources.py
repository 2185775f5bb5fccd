"""Raw-data sources for the download task (plain functions, no Prefect).

A source is local files or a glob, any fsspec URL (one object, a folder, a glob), a
Hugging Face dataset, or the built-in corpus. ``resolve_source`` works out its content
fingerprint before reading any document: a content hash for local files, ETag/VersionId
+ size for object stores and HTTP, the resolved commit for the Hub. ``write_corpus`` then
streams its documents into one JSON-lines file, file by file, with bounded memory.

Network calls retry transient failures (5xx, 429, connection errors) with backoff; a 404,
a refused access or a wrong column is a ``DataError`` at once, naming the config field.
"""

from __future__ import annotations

import array
import bz2
import codecs
import contextlib
import dataclasses
import glob
import gzip
import hashlib
import json
import logging
import lzma
import os
import re
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

from stoker.config import BUILTIN_SOURCE, DataConfig
from stoker.data.synthetic import CONTRACTS_SOURCE, write_contracts
from stoker.failures import (
    DataError,
    RetriesExhausted,
    SourceUnreachable,
    describe,
    http_status,
    is_transient,
    retry,
)
from stoker.storage.datasets import PartWriter
from stoker.storage.store import expand_url, fetch_url, sha256_file

log = logging.getLogger("stoker.data")
T = TypeVar("T")

SOURCE_FORMAT = 2  # bump when the way documents are cut from files changes
DOC_CHARS = 4000  # plain text is cut at blank lines into documents of about this size
MAX_DOC_CHARS = 1 << 20  # ... and hard-cut past this, so one huge line stays bounded
READ_LIMIT = 1 << 20
READ_AHEAD_BYTES = 64 << 20  # a source of several files and this many bytes is read by processes ahead
READ_AHEAD_MAX_FILE = 8 << 30  # ... where no file is larger (one file is one unit of that read)

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}

RETRY_ATTEMPTS = 5
RETRY_BASE_DELAY = 0.5  # seconds, doubled per attempt, with jitter
RETRY_MAX_DELAY = 8.0
RETRY_BUDGET_S = 60.0


def with_retries(what: str, fn: Callable[[], T], field_name: str = "data.source") -> T:
    """Call ``fn`` through failures.retry, bounded in count (RETRY_ATTEMPTS) and time
    (RETRY_BUDGET_S). A permanent failure becomes a DataError naming ``field_name``; still
    failing after the retries is a SourceUnreachable (transient: the task retries later)."""
    try:
        return retry(
            fn,
            what=what,
            attempts=RETRY_ATTEMPTS,
            budget_seconds=RETRY_BUDGET_S,
            base_delay=RETRY_BASE_DELAY,
            max_delay=RETRY_MAX_DELAY,
        )
    except (DataError, SourceUnreachable):
        raise
    except RetriesExhausted as err:
        raise SourceUnreachable(
            f"{field_name}: {what} is unreachable after {err.attempts} attempts in {err.seconds:.1f}s "
            f"(last error: {err.last_error}); check the URL and the network, or try again later."
        ) from err.__cause__
    except Exception as err:
        if is_transient(err):  # an exception type retry() re-raised as is
            raise
        status, root = http_status(err), describe(err)
        if status in (404, 410) or (status is None and isinstance(err, FileNotFoundError)):
            raise DataError(f"{field_name}: {what} does not exist ({root}); check the URL, bucket and key.") from err
        if status in (401, 403) or (status is None and isinstance(err, PermissionError)):
            raise DataError(
                f"{field_name}: access to {what} was refused ({root}); check the "
                "credentials in the environment or data.storage_options."
            ) from err
        if (status is not None and 400 <= status < 500) or isinstance(err, (IsADirectoryError, NotADirectoryError)):
            raise DataError(f"{field_name}: {what} was rejected ({root}); check the URL.") from err
        raise


# ---- resolving a source --------------------------------------------------------------
@dataclass
class SourceFile:
    name: str  # a local path or a URL, for messages
    fmt: str  # "text" | "jsonl" | "parquet"
    compression: str | None
    local: str | None  # where its bytes are on this machine (remote: once fetched)
    info: dict = field(default_factory=dict)  # remote metadata (size, ETag ...)


@dataclass
class Source:
    """A resolved data.source: its fingerprint, and how to read its documents."""

    description: str
    fingerprint: str
    fingerprint_inputs: dict
    files: list[SourceFile] = field(default_factory=list)
    hf: dict | None = None
    workdir: str = ""


def format_of(name: str) -> tuple[str, str | None]:
    base = name.split("?", 1)[0].lower()
    compression = next((c for c in COMPRESSIONS if base.endswith(c)), None)
    if compression:
        base = base[: -len(compression)]
    if base.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if base.endswith(PARQUET_SUFFIXES):
        return "parquet", compression
    return "text", compression


def _known_suffix(name: str) -> bool:
    base = name.split("?", 1)[0].lower()
    for c in COMPRESSIONS:
        base = base.removesuffix(c)
    return base.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)


def _local_files(source: str) -> list[str]:
    if source == BUILTIN_SOURCE:
        return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return sorted(
            p
            for p in glob.glob(os.path.join(path, "**", "*"), recursive=True)
            if os.path.isfile(p) and _known_suffix(p)
        )
    return sorted(p for p in glob.glob(path) if os.path.isfile(p))


def _remote_id(url: str, info: dict) -> dict | None:
    """What identifies a remote object's content without reading it, or None."""
    etag = info.get("ETag") or info.get("etag")
    version = info.get("VersionId") or info.get("version_id") or info.get("generation")
    checksum = info.get("md5Hash") or info.get("crc32c") or info.get("Content-MD5") or info.get("Digest")
    modified = info.get("Last-Modified") if not (etag or version or checksum) else None
    if not (etag or version or checksum or modified):
        return None
    out: dict[str, Any] = {"size": info.get("size")}
    for key, value in (("etag", etag), ("version", version), ("checksum", checksum), ("modified", modified)):
        if value:
            out[key] = str(value)
    if url.startswith(("http://", "https://")) or version or modified:
        out["url"] = url  # HTTP ETags and VersionIds are only unique per URL
    return out


def _fingerprint(cfg: DataConfig, items: list) -> tuple[str, dict]:
    inputs = {
        "format": SOURCE_FORMAT,
        "doc_chars": DOC_CHARS,
        "text_field": cfg.text_field,
        "max_bytes": cfg.max_bytes,
        "on_decode_error": cfg.on_decode_error,
        "items": items,
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]
    return digest, inputs


def resolve_source(cfg: DataConfig, workdir: str) -> Source:
    """List the source and compute its fingerprint, reading no document. Remote objects
    without an ETag, version or checksum are downloaded into workdir and content-hashed."""
    source = cfg.source.strip()
    if source.startswith("hf:"):
        return _resolve_hf(cfg, source[3:].strip(), workdir)
    if "://" in source and not source.startswith("file://"):
        return _resolve_remote(cfg, source, workdir)
    local = source[len("file://") :] if source.startswith("file://") else source
    if source == CONTRACTS_SOURCE:  # written into the work folder, then read as a local folder
        local = write_contracts(os.path.join(workdir, "builtin-contracts"))
    paths = _local_files(local)
    if not paths:
        raise DataError(
            f"data.source: {cfg.source!r} matches no file; give an existing file, "
            "folder or glob, or use 'builtin:stdlib'."
        )
    files = [SourceFile(p, *format_of(p), local=p) for p in paths]
    # the content, not the path: the same data found elsewhere has the same fingerprint
    items = [[f.fmt, f.compression, "sha256:" + sha256_file(f.local)] for f in files]
    fingerprint, inputs = _fingerprint(cfg, items)
    return Source(cfg.source, fingerprint, inputs, files=files, workdir=workdir)


def _resolve_remote(cfg: DataConfig, url: str, workdir: str) -> Source:
    listed = with_retries(url, lambda: expand_url(url, **cfg.storage_options))
    single = len(listed) == 1 and listed[0][0].rstrip("/") == url.rstrip("/")
    if not single and not any(c in url.split("://", 1)[1] for c in "*["):
        listed = [(u, i) for u, i in listed if _known_suffix(u)]  # a folder: data files only
    if not listed:
        raise DataError(
            f"data.source: {url!r} matches no object; check the URL, or give a "
            "folder holding .txt/.jsonl/.parquet files."
        )
    files, items = [], []
    for i, (name, info) in enumerate(listed):
        f = SourceFile(name, *format_of(name), local=None, info=info)
        ident = _remote_id(name, info)
        if ident is None:  # no metadata to trust: fetch now and hash the bytes
            f.local = _fetch(f, cfg, os.path.join(workdir, f"remote-{i:05d}"))
            ident = "sha256:" + sha256_file(f.local)
        files.append(f)
        items.append([f.fmt, f.compression, ident])
    fingerprint, inputs = _fingerprint(cfg, items)
    return Source(url, fingerprint, inputs, files=files, workdir=workdir)


def _fetch(f: SourceFile, cfg: DataConfig, local: str) -> str:
    expected = f.info.get("size")

    def attempt() -> str:
        fetch_url(f.name, local, **cfg.storage_options)
        got = os.path.getsize(local)
        if expected is not None and got != expected:
            raise ConnectionError(f"got {got} bytes, the listing says {expected} (cut off, or changed meanwhile)")
        return local

    return with_retries(f.name, attempt)


# ---- Hugging Face datasets -----------------------------------------------------------
def _is_saved_dataset(path: str) -> bool:
    return os.path.exists(os.path.join(path, "state.json")) or os.path.exists(os.path.join(path, "dataset_dict.json"))


def _resolve_hf(cfg: DataConfig, name: str, workdir: str) -> Source:
    if not name:
        raise DataError("data.source: 'hf:' needs a dataset name or folder, e.g. 'hf:wikitext'.")
    local = os.path.expanduser(name)
    spec = {"name": cfg.hf_name, "split": cfg.hf_split}
    if os.path.exists(local):
        paths = sorted(
            p
            for p in glob.glob(os.path.join(local, "**", "*"), recursive=True)
            if os.path.isfile(p) and "/." not in p[len(local) :]
        )
        items = [[os.path.relpath(p, local), "sha256:" + sha256_file(p)] for p in paths]
        hf = {"path": local, "revision": None, "saved": _is_saved_dataset(local), **spec}
        fingerprint, inputs = _fingerprint(cfg, [{"hf_local": items, **spec}])
    else:
        revision = _resolve_hub_revision(name, cfg.hf_revision)
        hf = {"path": name, "revision": revision, "saved": False, **spec}
        fingerprint, inputs = _fingerprint(cfg, [{"hf": name, "revision": revision, **spec}])
    return Source(cfg.source, fingerprint, inputs, hf=hf, workdir=workdir)


def _resolve_hub_revision(repo: str, revision: str | None) -> str:
    """The commit sha a Hub revision (branch, tag, sha, default main) points at now."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise DataError(
            f"data.hf_revision: the Hub is offline (HF_HUB_OFFLINE), so {revision or 'main'!r} of "
            f"{repo!r} cannot be resolved; give a 40-hex commit sha, or a local dataset folder."
        )
    try:
        return with_retries(f"the Hub dataset {repo!r}", lambda: HfApi().dataset_info(repo, revision=revision).sha)
    except DataError as err:
        if "RevisionNotFound" in str(err):
            raise DataError(
                f"data.hf_revision: {repo!r} has no revision {revision!r}; give a branch, tag or commit that exists."
            ) from err
        raise


def _hf_documents(hf: dict, text_field: str, cache_dir: str) -> Iterator[str]:
    import datasets

    what = f"hf:{hf['path']}"
    try:
        if hf["saved"]:  # a folder written by save_to_disk, which load_dataset refuses
            ds = datasets.load_from_disk(hf["path"])
            if isinstance(ds, datasets.DatasetDict):
                if hf["split"] not in ds:
                    raise DataError(
                        f"data.hf_split: {what} has no split {hf['split']!r} "
                        f"(splits: {sorted(ds)}); set data.hf_split to one of them."
                    )
                ds = ds[hf["split"]]
        else:
            ds = datasets.load_dataset(
                hf["path"],
                name=hf["name"],
                split=hf["split"],
                revision=hf["revision"],
                streaming=True,
                cache_dir=cache_dir,
            )
    except DataError:
        raise
    except ValueError as err:  # datasets reports a bad split or config name as ValueError
        text = str(err)
        fld = (
            "data.hf_split"
            if "split" in text.lower()
            else "data.hf_name"
            if "config" in text.lower()
            else "data.source"
        )
        raise DataError(f"{fld}: datasets could not load {what}: {text}") from None
    except FileNotFoundError as err:
        raise DataError(f"data.source: datasets found no data for {what} ({err}); check the name or folder.") from None
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise DataError(
            f"data.text_field: {what} has no column {text_field!r} (columns: "
            f"{sorted(columns)}); set data.text_field to the text column."
        )
    for record in ds:
        value = record.get(text_field)
        if isinstance(value, str):
            yield value
        elif value is not None:
            raise DataError(
                f"data.text_field: column {text_field!r} of {what} holds "
                f"{type(value).__name__}, not text; pick a string column."
            )


# ---- documents of one file -----------------------------------------------------------
def _open_local(f: SourceFile):
    opener = COMPRESSIONS[f.compression] if f.compression else open
    return opener(f.local, "rb")


def _text_documents(stream) -> Iterator[str]:
    """Plain text cut at blank lines into documents of about DOC_CHARS characters, so one
    big file still yields many documents for the hash-chosen validation split."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    parts: list[str] = []
    size = 0
    first = True
    while True:
        raw = stream.readline(READ_LIMIT)
        if not raw:
            break
        if first:
            raw, first = raw.removeprefix(codecs.BOM_UTF8), False
        piece = decoder.decode(raw)
        parts.append(piece)
        size += len(piece)
        if (size >= DOC_CHARS and not piece.strip()) or size >= MAX_DOC_CHARS:
            yield "".join(parts)
            parts, size = [], 0
    parts.append(decoder.decode(b"", final=True))
    if parts:
        yield "".join(parts)


def _jsonl_documents(stream, name: str, text_field: str) -> Iterator[str]:
    for lineno, raw in enumerate(stream, 1):
        line = raw.decode("utf-8")  # strict: UnicodeDecodeError is handled by the caller
        if lineno == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"data.source: {name} line {lineno} is not JSON ({err.msg}); fix it, or give plain text a .txt name."
            ) from None
        if not isinstance(record, dict):
            raise DataError(
                f"data.source: {name} line {lineno} is a JSON {type(record).__name__}, "
                f"not an object with a {text_field!r} field."
            )
        if text_field not in record:
            raise DataError(
                f"data.text_field: {name} line {lineno} has no field {text_field!r} "
                f"(fields: {sorted(record)}); set data.text_field to the right one."
            )
        value = record[text_field]
        if isinstance(value, str):
            yield value
        elif value is not None:
            raise DataError(
                f"data.text_field: {name} line {lineno}: field {text_field!r} holds "
                f"{type(value).__name__}, not text; point data.text_field at a string field."
            )


def _parquet_documents(f: SourceFile, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f.local)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"data.source: {f.name} is not a Parquet file ({err}).") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"data.text_field: {f.name} has no column {text_field!r} (columns: "
            f"{sorted(schema.names)}); set data.text_field to the text column."
        )
    kind = schema.field(text_field).type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
        raise DataError(
            f"data.text_field: column {text_field!r} of {f.name} is {kind}, not text; pick a string column."
        )
    for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
        yield from (v for v in batch.column(0).to_pylist() if v)


def _file_documents(workdir: str, f: SourceFile, cfg: DataConfig, index: int) -> Iterator[str]:
    """`cfg`: what is read of it is text_field and storage_options."""
    if f.local is None:  # remote: fetched now, deleted once read, so disk stays one file deep
        f.local = _fetch(f, cfg, os.path.join(workdir, f"remote-{index:05d}"))
    try:
        if f.fmt == "parquet":
            yield from _parquet_documents(f, cfg.text_field)
            return
        with _open_local(f) as stream:
            if f.fmt == "jsonl":
                yield from _jsonl_documents(stream, f.name, cfg.text_field)
            else:
                yield from _text_documents(stream)
    finally:
        if f.name != f.local and f.local.startswith(workdir):
            os.remove(f.local)
            f.local = None


def _lines(docs: Iterator[str]) -> Iterator[tuple[bytes, int]]:
    """A file's non-empty documents as the corpus's lines: (the line, the text's UTF-8 bytes)."""
    try:
        for doc in docs:
            if doc.strip():
                yield json.dumps({"text": doc}, ensure_ascii=False).encode("utf-8") + b"\n", len(doc.encode("utf-8"))
    finally:
        docs.close()


def iter_source_files(source: Source, cfg: DataConfig, workers: int = 1) -> Iterator[tuple[str, Iterator]]:
    """(name, its lines: see _lines) per source file, in a fixed order. A source of several
    files, with at least READ_AHEAD_BYTES to read, is read by up to `workers` processes of this
    host, each normalizing whole files ahead of the writer (file_lines); the lines come in the
    same order, the same bytes."""
    if source.hf is not None:
        cache_dir = os.path.join(source.workdir, "hf-cache")
        yield source.description, _lines(_hf_documents(source.hf, cfg.text_field, cache_dir))
        return
    if workers > 1 and len(source.files) > 1 and _read_ahead_pays(source, cfg):
        yield from _read_ahead(source, cfg, workers)
        return
    for i, f in enumerate(source.files):
        yield f.name, _lines(_file_documents(source.workdir, f, cfg, i))


def _read_ahead_pays(source: Source, cfg: DataConfig) -> bool:
    """At least READ_AHEAD_BYTES to read, every file's size known and none past
    READ_AHEAD_MAX_FILE (a unit of the read ahead is one file, under UNIT_TIMEOUT_S)."""
    sizes = [
        os.path.getsize(f.local) if f.local is not None and os.path.exists(f.local) else f.info.get("size")
        for f in source.files
    ]
    if any(size is None for size in sizes) or max(sizes) > READ_AHEAD_MAX_FILE:
        return False
    total = sum(sizes)
    return (min(total, cfg.max_bytes) if cfg.max_bytes else total) >= READ_AHEAD_BYTES


class _FileUnits(Sequence):
    """The read ahead's units (file_lines), one a source file, each made when it is asked for:
    nothing more is held per file than the source's own list."""

    def __init__(self, source: Source, cfg: DataConfig, folder: str):
        self.source, self.cfg, self.folder = source, cfg, folder

    def __len__(self) -> int:
        return len(self.source.files)

    def out(self, i: int) -> str:
        return os.path.join(self.folder, f"{i:06d}.jsonl")

    def __getitem__(self, i: int):
        from stoker.data.units import Unit

        f = self.source.files[i]
        args = {
            # what a worker reads of the file: the size of a remote one checks its fetch
            "file": {**dataclasses.asdict(f), "info": {"size": f.info.get("size")}},
            "index": i,
            "workdir": self.source.workdir,
            "out": self.out(i),
            "text_field": self.cfg.text_field,
            "storage_options": self.cfg.storage_options,
        }
        return Unit("stoker.data.sources:file_lines", args, f"reading {f.name}")


def _read_ahead(source: Source, cfg: DataConfig, workers: int) -> Iterator[tuple[str, Iterator]]:
    from stoker.data.units import stream_units
    from stoker.storage.store import Store

    folder = os.path.join(source.workdir, "read-ahead")
    os.makedirs(folder, exist_ok=True)
    units = _FileUnits(source, cfg, folder)
    # the units need no store: a local one of the work folder keeps the workers off the network
    results = stream_units(units, Store("file://" + folder), workers, ahead=2 * workers)
    try:
        for i, result in enumerate(results):
            yield source.files[i].name, _lines_read(result, units.out(i))
    finally:
        results.close()


def _lines_read(result: dict, out: str) -> Iterator[tuple[bytes, int]]:
    """The lines a worker wrote (file_lines), removed once read; a file that was not UTF-8
    raises UnicodeError here, as it would have while read in this process."""
    try:
        if result.get("not_utf8") is not None:
            raise UnicodeError(result["not_utf8"])
        sizes = array.array("q")
        with open(out + ".sizes", "rb") as f:
            sizes.frombytes(f.read())
        with open(out, "rb") as f:
            for size in sizes:
                yield f.readline(), size
    finally:
        for path in (out, out + ".sizes"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def file_lines(_store, file: dict, index: int, workdir: str, out: str, text_field: str, storage_options: dict) -> dict:
    """A unit (stoker.data.units): one source file's lines (_lines) written to `out`, each
    document's text size to `out`.sizes; {"docs": n}, or {"not_utf8": why} for a file that is
    not UTF-8 (nothing written). A remote file is fetched here, into `workdir`, and deleted once read."""
    reads = types.SimpleNamespace(text_field=text_field, storage_options=storage_options)
    sizes = array.array("q")
    try:
        with open(out, "wb") as f:
            for line, size in _lines(_file_documents(workdir, SourceFile(**file), reads, index)):
                f.write(line)
                sizes.append(size)
    except UnicodeError as err:
        os.remove(out)
        return {"not_utf8": getattr(err, "reason", str(err)), "docs": 0}
    with open(out + ".sizes", "wb") as f:
        f.write(sizes.tobytes())
    return {"docs": len(sizes)}


# ---- the downloaded corpus -------------------------------------------------------------
@dataclass
class CorpusStats:
    num_docs: int = 0
    num_bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    capped: bool = False  # the source held more than cfg.max_bytes: cut there


def write_corpus(source: Source, cfg: DataConfig, writer: PartWriter, workers: int = 1) -> CorpusStats:
    """Stream the source's documents, normalized ({"text": ...} per line), into the writer's
    parts, up to cfg.max_bytes. A part closes at data.partition_bytes, and at the end of a
    source file once it holds a quarter of that: a source already split into files keeps its
    files as partitions (small ones packed together), so a file added to a folder leaves the
    other files' parts as they were. A file that is not UTF-8 fails, or with
    on_decode_error='skip' is rolled back out of the output and counted. `workers`: see
    iter_source_files (the same bytes however many read)."""
    with contextlib.closing(iter_source_files(source, cfg, workers)) as files:  # a read ahead's workers end with it
        return _write_files(files, cfg, writer)


def _write_files(files: Iterator[tuple[str, Iterator]], cfg: DataConfig, writer: PartWriter) -> CorpusStats:
    stats = CorpusStats()
    for name, lines in files:
        writer.mark()
        mark = (stats.num_docs, stats.num_bytes)
        try:
            for line, size in lines:
                if cfg.max_bytes and stats.num_bytes + size > cfg.max_bytes and stats.num_bytes > 0:
                    lines.close()
                    stats.capped = True
                    writer.release()
                    return stats
                writer.add(line)
                stats.num_docs += 1
                stats.num_bytes += size
        except UnicodeError as err:  # undecodable bytes, or lone surrogates from JSON escapes
            reason = getattr(err, "reason", str(err))
            if cfg.on_decode_error == "fail":
                raise DataError(
                    f"data.source: {name} is not UTF-8 text ({reason}); convert or remove "
                    "it, or set data.on_decode_error='skip' to leave such files out (counted)."
                ) from None
            log.warning("skipping %s: not UTF-8 text (%s)", name, reason)
            writer.rollback()
            stats.num_docs, stats.num_bytes = mark
            stats.skipped.append(name)
        writer.release()
        if writer.size >= writer.partition_bytes // 4:
            writer.cut()
    return stats
