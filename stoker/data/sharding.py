"""Tokenize a JSON-lines corpus into shard files with several worker processes.

The corpus is cut into fixed byte ranges (partitions; a line belongs to the partition in
which it starts). Worker ``w`` of ``n`` owns partitions ``w, w+n, w+2n ...`` and writes
each one's tokens and document ends to its own files. The parent then appends the
partitions in order to the shard files, cutting a file after the document that reaches
``shard_tokens``. The shards are therefore a function of the corpus alone: byte-identical
whatever the number of workers or the partition size. Memory stays bounded by one batch
per worker and one copy buffer; disk by the partitions not yet appended.

Workers are fresh interpreters (``python -m stoker.data.sharding JOBS``) with
TOKENIZERS_PARALLELISM=false, so they never import the parent's main module (the
orchestrator) and never fork a process that holds threads. With one partition or one
worker the same code runs in this process instead.

The Ray engine (stoker/data/ray_engine.py) runs the same three definitions on a cluster: the
lines of a partition (``range_lines``), the tokens and split of each document
(``tokenize_docs``) and the cut points of the shard files (``shard_cuts``), so its bytes
cannot differ from these.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import numpy as np

from stoker.arithmetic.token_bytes import byte_table, count_unencodable, lacking_bytes
from stoker.failures import DataError, is_transient

SPLITS = ("train", "val")
PARTITION_BYTES = 4 << 20
BATCH_DOCS = 512
BATCH_BYTES = 256 << 10  # text per encode call: with its encodings, the bulk of a worker's memory
COPY_CHUNK = 4 << 20


# Documents are split by tokens, in pieces of at most this many (the end-of-text token
# included): one huge document must not put its whole weight into one split.
PIECE_TOKENS = 4096


def _doc_offset(doc: str) -> float:
    """A stable number in [0, 1) drawn from the document's content hash."""
    digest = hashlib.blake2b(doc.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def is_val(doc: str, val_fraction: float, piece: int = 0) -> bool:
    """Stable split by content hash and piece number (same across reruns and worker counts).
    Piece k of a document goes to val when (offset + k * val_fraction) mod 1 < val_fraction:
    of any n consecutive pieces, n * val_fraction (rounded up or down) go to val, so the val
    share of tokens holds for one huge document as for many small ones. A document of one
    piece goes where its hash says (offset < val_fraction), as before pieces existed."""
    return (_doc_offset(doc) + piece * val_fraction) % 1.0 < val_fraction


@dataclass
class PartitionJob:
    index: int
    corpus: str  # local JSON-lines file
    start: int  # byte range [start, end) of the corpus
    end: int
    tokenizer: str  # local tokenizer.json
    eot_id: int
    dtype: str  # numpy dtype string, e.g. "<u2"
    val_fraction: float
    out: str  # prefix of this partition's output files

    def paths(self, split: str) -> tuple[str, str]:
        return f"{self.out}.{split}.bin", f"{self.out}.{split}.idx"


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def partition_ranges(size: int, partition_bytes: int) -> list[tuple[int, int]]:
    """The fixed byte ranges [start, end) of a file of `size` bytes (at least one)."""
    return [(s, min(s + partition_bytes, size)) for s in range(0, max(size, 1), partition_bytes)]


def part_ranges(sizes: list[int], partition_bytes: int) -> list[tuple[int, int, int]]:
    """(file, start, end) of every partition of a dataset stored as files of these sizes: each
    file's fixed byte ranges, in order. A stage's units are these, whatever the engine."""
    return [(i, a, b) for i, size in enumerate(sizes) for a, b in partition_ranges(size, partition_bytes)]


# ---- one partition (runs in a worker, or in-process) ------------------------------------
_TOKENIZERS: dict = {}


READ_BYTES = 1 << 20  # of the corpus per read (past the range's end: TAIL_BYTES)
TAIL_BYTES = 64 << 10


def range_lines(
    read: Callable[[int, int], bytes], start: int, end: int, chunk: int = READ_BYTES
) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for each line that starts in [start, end) of a file read through
    `read(offset, size)` (b"" at its end): the one definition of a partition, shared by the
    local and the Ray engine. Reads up to `end` in `chunk`s, then the last line's tail."""

    def more(at: int) -> bytes:
        return read(at, max(min(chunk, end - at), TAIL_BYTES))

    buf, base, nxt = b"", start, start  # buf holds the file from offset `base`; `nxt` is read next
    if start > 0:  # skip the tail of a line begun before `start`
        nxt = start - 1
        while True:
            block = more(nxt)
            if not block:
                return
            cut = block.find(b"\n")
            nxt += len(block)
            if cut >= 0:
                base = nxt - len(block) + cut + 1
                buf = block[cut + 1 :]
                break
    pos = 0  # of the next line in buf
    while base + pos < end:
        cut = buf.find(b"\n", pos)
        if cut < 0:
            block = more(nxt)
            if block:
                buf, base, pos = buf[pos:] + block, base + pos, 0
                nxt += len(block)
                continue
            if pos < len(buf):
                yield base + pos, buf[pos:]  # the last line, without a newline
            return
        yield base + pos, buf[pos : cut + 1]
        pos = cut + 1


def store_lines(store, key: str, size: int, start: int, end: int, chunk: int = READ_BYTES):
    """range_lines over an object of `size` bytes in the store, read in ranged reads (an
    object store's readline is slow): the lines of one partition, whatever the engine."""

    def read(offset: int, count: int) -> bytes:
        return store.read_range(key, offset, min(count, size - offset)) if offset < size else b""

    return range_lines(read, start, end, chunk)


def corpus_text(line: bytes, offset: int) -> str:
    """The text of one corpus line; a damaged line is one DataError, whatever the engine."""
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError) as err:  # not UTF-8, not JSON, no "text"
        text, why = None, f"{type(err).__name__}: {str(err)[:200]}"
    else:
        why = f"its text is {type(text).__name__}, not a string"
    if not isinstance(text, str):
        raise DataError(
            f"the stored corpus is damaged: its line at byte {offset} is not a JSON object "
            f"with a 'text' string ({why}); delete the dataset's folder under datasets/ "
            "in the store and prepare again, which downloads it afresh."
        )
    return text


def _partition_docs(path: str, start: int, end: int) -> Iterator[str]:
    """Documents of the lines that start in [start, end) of a local file."""
    with open(path, "rb") as f:

        def read(offset: int, size: int) -> bytes:
            f.seek(offset)
            return f.read(size)

        for offset, line in range_lines(read, start, end):
            yield corpus_text(line, offset)


def load_tokenizer(path: str):
    """A tokenizers.Tokenizer from a local file, loaded once per process."""
    from tokenizers import Tokenizer

    tok = _TOKENIZERS.get(path)
    if tok is None:
        tok = _TOKENIZERS[path] = Tokenizer.from_file(path)
    return tok


UNENCODABLE = "unencodable"  # tokenize_docs' count of the bytes the vocabulary cannot spell
_LACKING: dict[int, Any] = {}


def _lacking_table(tok):
    """token_bytes.byte_table of the tokenizer's lacking bytes, once per tokenizer object."""
    key = id(tok)
    if key not in _LACKING:
        _LACKING[key] = (tok, byte_table(lacking_bytes(tok)))  # the tokenizer kept: its id stays its own
    return _LACKING[key][1]


def merge_unencodable(total: list, found: list | None) -> list:
    """[bytes, first example] of two partitions' counts, in partition order."""
    if not found:
        return total
    return [total[0] + int(found[0]), total[1] or found[1]]


def tokenize_docs(
    docs: Iterable[str],
    tok,
    eot_id: int,
    dtype: np.dtype,
    val_fraction: float,
    files: dict[str, tuple[BinaryIO, BinaryIO]],
) -> dict[str, list[int]]:
    """Tokenize documents into `files` ({split: (tokens, document ends)}): every document's ids
    (special tokens spelled in its text encoded as text) then eot_id, in `dtype`, cut in pieces of PIECE_TOKENS, each piece to the split is_val
    picks (so val_fraction holds by tokens); a piece ends an entry; the ends are cumulative
    little-endian uint64. The one place both engines turn text into shard bytes. Returns
    {split: [num_tokens, num_docs]}, and under UNENCODABLE [bytes, first example] of the text
    the tokenizer's vocabulary cannot spell (token_bytes.lacking_bytes: counted only for a
    tokenizer that lacks some byte that UTF-8 text can hold)."""
    counts: dict = {s: [0, 0] for s in SPLITS}
    counts[UNENCODABLE] = [0, ""]
    table = _lacking_table(tok)
    # a user's text that spells a special token ('<|endoftext|>' in a file about tokenizers) is
    # text: only the eot_id appended here ends a document, for document attention and the loss
    tok.encode_special_tokens = True
    batch: list[str] = []
    size = 0

    def flush() -> None:
        out: dict[str, tuple[list[int], list[int]]] = {s: ([], []) for s in SPLITS}
        if table is not None:
            for doc in batch:
                n, example = count_unencodable(doc, table)
                if n:
                    counts[UNENCODABLE][0] += n
                    counts[UNENCODABLE][1] = counts[UNENCODABLE][1] or example
        for doc, enc in zip(batch, tok.encode_batch_fast(batch)):
            doc_ids = enc.ids + [eot_id]
            offset = _doc_offset(doc)
            for piece, start in enumerate(range(0, len(doc_ids), PIECE_TOKENS)):
                # a piece counts as a document of its split (an entry in its ends)
                val = (offset + piece * val_fraction) % 1.0 < val_fraction  # is_val, hash once
                ids, ends = out["val" if val else "train"]
                ids.extend(doc_ids[start : start + PIECE_TOKENS])
                ends.append(len(ids))
        for split, (ids, ends) in out.items():
            if ids:
                binf, idxf = files[split]
                binf.write(np.asarray(ids, dtype=dtype).data)
                idxf.write((np.asarray(ends, dtype="<u8") + counts[split][0]).data)
                counts[split][0] += len(ids)
                counts[split][1] += len(ends)
        batch.clear()

    for doc in docs:
        if batch and (len(batch) >= BATCH_DOCS or size + len(doc) > BATCH_BYTES):
            flush()  # before, not after: a batch holds at most max(BATCH_BYTES, one document)
            size = 0
        batch.append(doc)
        size += len(doc)
    if batch:
        flush()
    return counts


def tokenize_partition(job: PartitionJob) -> dict[str, list[int]]:
    """Write the partition's tokens (dtype, every document ending in eot) and document ends
    per split; return {split: [num_tokens, num_docs]}."""
    tok = load_tokenizer(job.tokenizer)
    files = {s: tuple(open(p, "wb") for p in job.paths(s)) for s in SPLITS}
    try:
        return tokenize_docs(
            _partition_docs(job.corpus, job.start, job.end),
            tok,
            job.eot_id,
            np.dtype(job.dtype),
            job.val_fraction,
            files,
        )
    finally:
        for pair in files.values():
            for f in pair:
                f.close()


# ---- running partitions --------------------------------------------------------------
class _InProcess:
    def __init__(self, jobs: list[PartitionJob]):
        self.jobs = jobs

    def wait(self, job: PartitionJob) -> dict:
        return tokenize_partition(job)

    def close(self) -> None:
        pass


class _WorkerGang:
    """n worker processes; worker w owns the jobs with index % n == w, done in order."""

    def __init__(self, jobs: list[PartitionJob], num_workers: int, work_dir: str):
        self.n = num_workers
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        try:
            for w in range(num_workers):
                mine = [asdict(j) for j in jobs if j.index % num_workers == w]
                job_file = os.path.join(work_dir, f"worker-{w}.json")
                with open(job_file, "w") as f:
                    json.dump(mine, f)
                self.logs.append(os.path.join(work_dir, f"worker-{w}.log"))
                with open(self.logs[-1], "wb") as log:
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "stoker.data.sharding", job_file],
                            stdout=subprocess.PIPE,
                            stderr=log,
                            stdin=subprocess.DEVNULL,
                            env=env,
                        )
                    )
        except BaseException:
            self.close()
            raise

    def wait(self, job: PartitionJob) -> dict:
        w = job.index % self.n
        proc = self.procs[w]
        line = proc.stdout.readline()  # the worker's next line is about its next job: this one
        if not line:
            code = proc.wait()
            with open(self.logs[w], "rb") as f:
                tail = f.read()[-2000:].decode("utf-8", "replace").strip()
            raise ChildProcessError(
                f"tokenizer worker {w} exited with code {code} before partition "
                f"{job.index} was done (killed? out of memory?): {tail}"
            )
        msg = json.loads(line)
        if "error" in msg:
            err = msg["error"]
            if err["type"] == "DataError":
                raise DataError(err["message"])
            kind = ChildProcessError if err["transient"] else RuntimeError
            raise kind(f"tokenizer worker {w}, partition {job.index}: {err['type']}: {err['message']}")
        assert msg["index"] == job.index, (msg, job.index)
        return msg["counts"]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()


def _worker_main(job_file: str) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the log, never into the protocol
    with open(job_file) as f:
        jobs = [PartitionJob(**d) for d in json.load(f)]
    for job in jobs:
        try:
            counts = tokenize_partition(job)
        except Exception as err:
            # a worker opens only files its parent has just written: an OSError there is this
            # host's trouble (disk, temp folder), never the user's, so a retry may help
            transient = isinstance(err, OSError) or is_transient(err)
            proto.write(
                json.dumps(
                    {
                        "index": job.index,
                        "error": {"type": type(err).__name__, "message": str(err), "transient": transient},
                    }
                )
                + "\n"
            )
            return 1
        proto.write(json.dumps({"index": job.index, "counts": counts}) + "\n")
    return 0


# ---- assembling shard files --------------------------------------------------------------
def shard_name(split: str, index: int, ext: str) -> str:
    return f"{split}-{index:05d}.{ext}"


def shard_cuts(ends: np.ndarray, count: int, shard_tokens: int) -> Iterator[tuple[int, int, int, int, bool]]:
    """Where one partition's documents of a split go, the open shard file holding `count`
    tokens: (first doc, end doc, first token, end token, closes) per run of documents that
    lands in one file, `closes` when that file is then full (it is cut after the document
    that reaches shard_tokens). `ends` are the partition's cumulative document ends. The one
    definition of the cut points, shared by both engines."""
    done = first = 0  # tokens and documents of this partition already placed
    while first < len(ends):
        room = shard_tokens - count
        last = min(int(np.searchsorted(ends, done + room, side="left")), len(ends) - 1)
        stop = int(ends[last])
        count += stop - done
        closes = count >= shard_tokens
        yield first, last + 1, done, stop, closes
        count = 0 if closes else count
        done, first = stop, last + 1


def shard_entries(
    split: str, index: int, tokens: int, docs: int, itemsize: int, bin_sha256: str, idx_sha256: str
) -> dict[str, dict]:
    """The manifest entries of one shard file pair."""
    return {
        shard_name(split, index, "bin"): {
            "tokens": tokens,
            "docs": docs,
            "size": tokens * itemsize,
            "sha256": bin_sha256,
        },
        shard_name(split, index, "idx"): {"docs": docs, "size": docs * 8, "sha256": idx_sha256},
    }


class _ShardAssembler:
    """Appends partitions of one split into {split}-00000.bin/.idx ..., cutting a file after
    the document that brings it to shard_tokens; hashes while writing."""

    def __init__(
        self, folder: str, split: str, dtype: np.dtype, shard_tokens: int, on_close: Callable[[str, str], None]
    ):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.on_close = on_close
        self.index = self.count = self.docs = 0
        self.bin = self.idx = None
        self.files: dict[str, dict] = {}

    def _name(self, ext: str) -> str:
        return shard_name(self.split, self.index, ext)

    def _open(self) -> None:
        self.bin = open(os.path.join(self.folder, self._name("bin")), "wb")
        self.idx = open(os.path.join(self.folder, self._name("idx")), "wb")
        self.bin_hash, self.idx_hash = hashlib.sha256(), hashlib.sha256()

    def add(self, bin_path: str, idx_path: str) -> None:
        ends = np.fromfile(idx_path, dtype="<u8").astype(np.int64)  # (docs,) cumulative ends
        itemsize = self.dtype.itemsize
        with open(bin_path, "rb") as src:
            for first, end, done, stop, closes in shard_cuts(ends, self.count, self.shard_tokens):
                if self.bin is None:
                    self._open()
                self._copy(src, (stop - done) * itemsize)
                block = (ends[first:end] - done + self.count).astype("<u8").tobytes()
                self.idx.write(block)
                self.idx_hash.update(block)
                self.count += stop - done
                self.docs += end - first
                if closes:
                    self.close()

    def _copy(self, src, nbytes: int) -> None:
        while nbytes > 0:
            block = src.read(min(COPY_CHUNK, nbytes))
            assert block, "partition file shorter than its index says"
            self.bin.write(block)
            self.bin_hash.update(block)
            nbytes -= len(block)

    def close(self) -> None:
        if self.bin is None:
            return
        self.bin.close()
        self.idx.close()
        names = (self._name("bin"), self._name("idx"))
        self.files.update(
            shard_entries(
                self.split,
                self.index,
                self.count,
                self.docs,
                self.dtype.itemsize,
                self.bin_hash.hexdigest(),
                self.idx_hash.hexdigest(),
            )
        )
        for name in names:
            self.on_close(name, os.path.join(self.folder, name))
        self.index, self.count, self.docs, self.bin, self.idx = self.index + 1, 0, 0, None, None


def build_shards(
    jobs: list[PartitionJob],
    folder: str,
    shard_tokens: int,
    num_workers: int,
    work_dir: str,
    on_close: Callable[[str, str], None] = lambda name, path: None,
    found: dict | None = None,
    tracker=None,
    cached: dict[int, dict] | None = None,
    on_tokenized: Callable[[PartitionJob, dict], None] | None = None,
    fetch: Callable[[PartitionJob], None] | None = None,
) -> dict[str, dict[str, dict]]:
    """Tokenize every partition and assemble the shard files into `folder`; returns
    {split: {file name: manifest entry}}. `on_close(name, path)` sees each finished file;
    `found` (when given) gets UNENCODABLE: [bytes, first example] over every partition;
    `tracker` (stoker.data.units.Tracker) sees each partition tokenized. `cached`: {job index:
    counts} of the jobs tokenized before (not run), whose files `fetch(job)` puts at their paths
    when the shards reach them; `on_tokenized(job, counts)` sees each job tokenized here, before
    its files are assembled."""
    dtype = np.dtype(jobs[0].dtype)
    cached = cached or {}
    todo = [j for j in jobs if j.index not in cached]
    n = max(1, min(num_workers, len(todo)))
    writers = {s: _ShardAssembler(folder, s, dtype, shard_tokens, on_close) for s in SPLITS}
    runner = _InProcess(todo) if n == 1 or not todo else _WorkerGang(todo, n, work_dir)
    unencodable = [0, ""]
    try:
        for job in jobs:  # in partition order, whatever finishes first
            if job.index in cached:
                counts = cached[job.index]
                if fetch is not None:
                    fetch(job)
            else:
                counts = runner.wait(job)
                if on_tokenized is not None:
                    on_tokenized(job, counts)
            unencodable = merge_unencodable(unencodable, counts.get(UNENCODABLE))
            if tracker is not None:
                tracker.step(sum(counts[s][1] for s in SPLITS))
            for split in SPLITS:
                bin_path, idx_path = job.paths(split)
                writers[split].add(bin_path, idx_path)
                os.remove(bin_path)
                os.remove(idx_path)
    finally:
        runner.close()
    for w in writers.values():
        w.close()
    if found is not None:
        found[UNENCODABLE] = unencodable
    return {s: w.files for s, w in writers.items()}


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
