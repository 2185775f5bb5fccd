"""Tokenize a JSON-lines corpus into shard files with several worker processes.

The corpus is cut into fixed byte ranges (partitions; a line belongs to the partition in
which it starts). Worker ``w`` of ``n`` owns partitions ``w, w+n, w+2n ...`` and writes
each one's tokens and document ends to its own files. The parent then appends the
partitions in order to the shard files, cutting a file after the document that reaches
``shard_tokens``. The shards are therefore a function of the corpus alone: byte-identical
whatever the number of workers or the partition size. Memory stays bounded by one batch
per worker and one copy buffer; disk by the partitions not yet appended.

Workers are fresh interpreters (``python -m data.sharding JOBS``) with
TOKENIZERS_PARALLELISM=false, so they never import the parent's main module (the
orchestrator) and never fork a process that holds threads. With one partition or one
worker the same code runs in this process instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np

from core.failures import DataError, is_transient

SPLITS = ("train", "val")
PARTITION_BYTES = 4 << 20
BATCH_DOCS = 512
BATCH_BYTES = 256 << 10  # text per encode call: with its encodings, the bulk of a worker's memory
COPY_CHUNK = 4 << 20
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_val(doc: str, val_fraction: float) -> bool:
    """Stable split by document content hash (same across reruns and worker counts)."""
    digest = hashlib.blake2b(doc.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


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


def partition_jobs(corpus: str, partition_bytes: int, out_dir: str, **common) -> list[PartitionJob]:
    size = os.path.getsize(corpus)
    starts = range(0, max(size, 1), partition_bytes)
    return [PartitionJob(k, corpus, s, min(s + partition_bytes, size), out=os.path.join(out_dir, f"p-{k:05d}"),
                         **common) for k, s in enumerate(starts)]


# ---- one partition (runs in a worker, or in-process) ------------------------------------
_TOKENIZERS: dict = {}


def _partition_docs(path: str, start: int, end: int) -> Iterator[str]:
    """Documents of the lines that start in [start, end)."""
    with open(path, "rb") as f:
        pos = start
        if start > 0:
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())  # the tail of a line begun before `start`
        while pos < end:
            line = f.readline()
            if not line:
                return
            pos += len(line)
            yield json.loads(line)["text"]


def tokenize_partition(job: PartitionJob) -> dict[str, list[int]]:
    """Write the partition's tokens (dtype, every document ending in eot) and document ends
    per split; return {split: [num_tokens, num_docs]}."""
    from tokenizers import Tokenizer

    tok = _TOKENIZERS.get(job.tokenizer)
    if tok is None:
        tok = _TOKENIZERS[job.tokenizer] = Tokenizer.from_file(job.tokenizer)
    dtype = np.dtype(job.dtype)
    counts = {s: [0, 0] for s in SPLITS}
    files = {s: tuple(open(p, "wb") for p in job.paths(s)) for s in SPLITS}
    batch: list[str] = []
    size = 0

    def flush() -> None:
        out: dict[str, tuple[list[int], list[int]]] = {s: ([], []) for s in SPLITS}
        for doc, enc in zip(batch, tok.encode_batch_fast(batch)):
            ids, ends = out["val" if is_val(doc, job.val_fraction) else "train"]
            ids.extend(enc.ids)
            ids.append(job.eot_id)
            ends.append(len(ids))
        for split, (ids, ends) in out.items():
            if ids:
                binf, idxf = files[split]
                binf.write(np.asarray(ids, dtype=dtype).data)
                idxf.write((np.asarray(ends, dtype="<u8") + counts[split][0]).data)
                counts[split][0] += len(ids)
                counts[split][1] += len(ends)
        batch.clear()

    try:
        for doc in _partition_docs(job.corpus, job.start, job.end):
            if batch and (len(batch) >= BATCH_DOCS or size + len(doc) > BATCH_BYTES):
                flush()  # before, not after: a batch holds at most max(BATCH_BYTES, one document)
                size = 0
            batch.append(doc)
            size += len(doc)
        if batch:
            flush()
    finally:
        for pair in files.values():
            for f in pair:
                f.close()
    return counts


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
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH")) if p)
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
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "data.sharding", job_file], stdout=subprocess.PIPE,
                        stderr=log, stdin=subprocess.DEVNULL, env=env, cwd=PROJECT_ROOT))
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
            raise ChildProcessError(f"tokenizer worker {w} exited with code {code} before partition "
                                    f"{job.index} was done (killed? out of memory?): {tail}")
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
            proto.write(json.dumps({"index": job.index, "error": {
                "type": type(err).__name__, "message": str(err),
                "transient": transient}}) + "\n")
            return 1
        proto.write(json.dumps({"index": job.index, "counts": counts}) + "\n")
    return 0


# ---- assembling shard files --------------------------------------------------------------
class _ShardAssembler:
    """Appends partitions of one split into {split}-00000.bin/.idx ..., cutting a file after
    the document that brings it to shard_tokens; hashes while writing."""

    def __init__(self, folder: str, split: str, dtype: np.dtype, shard_tokens: int,
                 on_close: Callable[[str, str], None]):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.on_close = on_close
        self.index = self.count = self.docs = 0
        self.bin = self.idx = None
        self.files: dict[str, dict] = {}

    def _name(self, ext: str) -> str:
        return f"{self.split}-{self.index:05d}.{ext}"

    def _open(self) -> None:
        self.bin = open(os.path.join(self.folder, self._name("bin")), "wb")
        self.idx = open(os.path.join(self.folder, self._name("idx")), "wb")
        self.bin_hash, self.idx_hash = hashlib.sha256(), hashlib.sha256()

    def add(self, bin_path: str, idx_path: str) -> None:
        ends = np.fromfile(idx_path, dtype="<u8").astype(np.int64)  # (docs,) cumulative ends
        itemsize = self.dtype.itemsize
        with open(bin_path, "rb") as src:
            done = first = 0  # tokens and documents of this partition already appended
            while first < len(ends):
                if self.bin is None:
                    self._open()
                room = self.shard_tokens - self.count
                last = min(int(np.searchsorted(ends, done + room, side="left")), len(ends) - 1)
                stop = int(ends[last])
                self._copy(src, (stop - done) * itemsize)
                block = (ends[first:last + 1] - done + self.count).astype("<u8").tobytes()
                self.idx.write(block)
                self.idx_hash.update(block)
                self.count += stop - done
                self.docs += last + 1 - first
                done, first = stop, last + 1
                if self.count >= self.shard_tokens:
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
        self.files[names[0]] = {"tokens": self.count, "docs": self.docs,
                                "size": self.count * self.dtype.itemsize, "sha256": self.bin_hash.hexdigest()}
        self.files[names[1]] = {"docs": self.docs, "size": self.docs * 8, "sha256": self.idx_hash.hexdigest()}
        for name in names:
            self.on_close(name, os.path.join(self.folder, name))
        self.index, self.count, self.docs, self.bin, self.idx = self.index + 1, 0, 0, None, None


def build_shards(jobs: list[PartitionJob], folder: str, shard_tokens: int, num_workers: int,
                 work_dir: str, on_close: Callable[[str, str], None] = lambda name, path: None,
                 ) -> dict[str, dict[str, dict]]:
    """Tokenize every partition and assemble the shard files into `folder`; returns
    {split: {file name: manifest entry}}. `on_close(name, path)` sees each finished file."""
    dtype = np.dtype(jobs[0].dtype)
    n = max(1, min(num_workers, len(jobs)))
    writers = {s: _ShardAssembler(folder, s, dtype, shard_tokens, on_close) for s in SPLITS}
    runner = _InProcess(jobs) if n == 1 else _WorkerGang(jobs, n, work_dir)
    try:
        for job in jobs:  # in partition order, whatever finishes first
            runner.wait(job)
            for split in SPLITS:
                bin_path, idx_path = job.paths(split)
                writers[split].add(bin_path, idx_path)
                os.remove(bin_path)
                os.remove(idx_path)
    finally:
        runner.close()
    for w in writers.values():
        w.close()
    return {s: w.files for s, w in writers.items()}


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
