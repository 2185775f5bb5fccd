"""Raw datasets in the store: ``{root}/datasets/{fingerprint}/info.json``, which lists the
dataset's partitions in order: JSON-lines files (one ``{"text": ...}`` line per document) stored
by their content's sha256 under ``datasets/parts/``, each written as soon as it is made, so a
part shared by two datasets (a grown source, a source and its deduplicated copy) is stored
once. A failed download removes the parts it stored. The info (with every part's size and sha256) is published last: it is the commit. A
dataset stored before partitions (one ``corpus.jsonl`` in its folder) reads as one part.

The fingerprint is the content's: the sha256 of the normalized corpus (the parts' bytes in
order; today's identity, whatever the partitioning), so the same documents from another file
format or place are stored, and tokenized, once. A source is known by its own fingerprint (content hashes, ETags, revisions;
taken before any document is read), and ``datasets/by-source/{source fingerprint}.json`` says
which content it gave, so a known source is a cache hit without a download."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Iterator

from stoker.storage.manifest import publish_folder, read_manifest, verify_files
from stoker.storage.store import Store, join, sha256_file

CORPUS_FILE = "corpus.jsonl"  # a dataset's one file before partitions (read as one part)
INFO_FILE = "info.json"
PARTS_DIR = join("datasets", "parts")


SOURCES_DIR = "by-source"


def dataset_key(fingerprint: str) -> str:
    return join("datasets", fingerprint)


def content_fingerprint(corpus_sha256: str) -> str:
    """The dataset fingerprint of a normalized corpus file with this sha256."""
    return corpus_sha256[:24]


def _source_key(source_fingerprint: str) -> str:
    return join("datasets", SOURCES_DIR, f"{source_fingerprint}.json")


def dataset_of_source(store: Store, source_fingerprint: str) -> tuple[str, dict] | None:
    """(fingerprint, info) of the committed dataset this source gave before, if any."""
    try:
        link = store.read_json(_source_key(source_fingerprint))
        fingerprint = str(link["fingerprint"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):  # a damaged link is only a cache miss
        return None
    info = committed_dataset(store, fingerprint)
    return (fingerprint, info) if info is not None else None


def link_source(store: Store, source_fingerprint: str, fingerprint: str) -> None:
    """Record that this source gave the dataset `fingerprint` (written after its info)."""
    store.write_json(
        _source_key(source_fingerprint), {"source_fingerprint": source_fingerprint, "fingerprint": fingerprint}
    )


@dataclass(frozen=True)
class Part:
    """One partition of a stored dataset: a JSON-lines file of whole documents."""

    key: str
    size: int
    sha256: str
    num_docs: int

    def entry(self) -> dict:
        return {"key": self.key, "size": self.size, "sha256": self.sha256, "num_docs": self.num_docs}


def part_key(sha256: str) -> str:
    return join(PARTS_DIR, sha256[:2], f"{sha256}.jsonl")


def parts_of_info(info: dict, fingerprint: str) -> list[Part]:
    """The parts an info.json lists, in order (a dataset from before partitions: its corpus)."""
    if "parts" in info:
        return [Part(p["key"], int(p["size"]), p["sha256"], int(p["num_docs"])) for p in info["parts"]]
    entry = info["files"][CORPUS_FILE]
    return [Part(join(dataset_key(fingerprint), CORPUS_FILE), entry["size"], entry["sha256"], info["num_docs"])]


def dataset_parts(store: Store, fingerprint: str) -> list[Part]:
    """The parts of a committed dataset, in order; FileNotFoundError when it is not committed."""
    info = committed_dataset(store, fingerprint)
    if info is None:
        raise FileNotFoundError(f"no committed dataset {store.url(dataset_key(fingerprint))}")
    return parts_of_info(info, fingerprint)


def _parts_present(store: Store, parts: list[Part]) -> bool:
    for part in parts:
        try:
            if store.size(part.key) != part.size:
                return False
        except FileNotFoundError:
            return False
    return True


def committed_dataset(store: Store, fingerprint: str) -> dict | None:
    """info.json of a dataset whose every part is present with the listed size."""
    key = dataset_key(fingerprint)
    info, _ = read_manifest(store, join(key, INFO_FILE))
    if info is None or verify_files(store, key, info["files"], deep=False):
        return None
    try:
        if not _parts_present(store, parts_of_info(info, fingerprint)):
            return None
    except (KeyError, TypeError, ValueError):  # a damaged info is a dataset to make again
        return None
    return info


class PartWriter:
    """Normalized corpus lines into parts of about `partition_bytes`, each uploaded to the
    store (under its content's sha256) as soon as it is closed, so this host's disk holds one
    part, not the corpus. `mark()`/`rollback()` take back the lines of one source file (a file
    found not to be UTF-8 midway): the part the file began in is held on disk until
    `release()`, the parts closed inside the file are left out (stored, unlisted). The sha256
    of all the lines kept, in order, is the dataset's identity."""

    def __init__(self, store: Store, work_dir: str, partition_bytes: int):
        self.store, self.work_dir, self.partition_bytes = store, work_dir, partition_bytes
        self.parts: list[Part] = []
        self.stored: set[str] = set()  # the parts this writer put in the store (not found there)
        self.whole = hashlib.sha256()
        self._n = 0
        self._open_new()
        self._mark = None
        self._held: str | None = None

    def _open_new(self) -> None:
        self._n += 1
        self.path = os.path.join(self.work_dir, f"part-{self._n}.jsonl")
        self.file = open(self.path, "ab")
        self.docs = 0

    @property
    def size(self) -> int:
        return self.file.tell()

    def add(self, line: bytes) -> None:
        """One document's line (ending in a newline); closes the part once it is full."""
        self.file.write(line)
        self.whole.update(line)
        self.docs += 1
        if self.size >= self.partition_bytes:
            self.cut()

    def cut(self) -> None:
        """Close the open part (when it holds a document): stored and listed."""
        if not self.docs:
            return
        self.file.close()
        digest = sha256_file(self.path)
        part = Part(part_key(digest), os.path.getsize(self.path), digest, self.docs)
        if not _parts_present(self.store, [part]):  # stored by content: another dataset's is ours
            if self.store.is_local:  # whole or absent: a reader never sees a part being written
                final = self.store.local_path(part.key)
                os.makedirs(os.path.dirname(final), exist_ok=True)
                tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
                shutil.copyfile(self.path, tmp)
                os.replace(tmp, final)
            else:
                self.store.put_file(self.path, part.key)
            self.stored.add(part.key)
        self.parts.append(part)
        if self._mark is not None and self._mark[0] == len(self.parts) - 1 and self._held is None:
            self._held = self.path  # the marked file began here: kept until release()
        else:
            os.remove(self.path)
        self._open_new()

    def mark(self) -> None:
        self.release()
        self._mark = (len(self.parts), self.size, self.docs, self.whole.copy())

    def release(self) -> None:
        if self._held is not None:
            os.remove(self._held)
        self._mark, self._held = None, None

    def rollback(self) -> None:
        """Back to the mark: the lines added since are gone."""
        n_parts, size, docs, whole = self._mark
        self.file.close()
        if len(self.parts) > n_parts:  # parts were closed since: reopen the one the mark was in
            os.remove(self.path)
            self.path, self._held = self._held, None
            self._unstore(self.parts[n_parts:])
            del self.parts[n_parts:]
        with open(self.path, "r+b") as f:
            f.truncate(size)
        self.docs = docs
        self.whole = whole.copy()
        self.file = open(self.path, "ab")
        self._mark = (n_parts, size, docs, whole)

    def _unstore(self, parts: list[Part]) -> None:
        keep = {p.key for p in self.parts[: len(self.parts) - len(parts)]}
        for part in parts:
            if part.key in self.stored and part.key not in keep:
                self.store.rm(part.key)
                self.stored.discard(part.key)

    def discard(self) -> None:
        """After a failure: the parts this writer stored are removed (nothing half-written)."""
        self._unstore(list(self.parts))
        for key in list(self.stored):  # stored, then left out by a rollback
            self.store.rm(key)
        self.stored.clear()
        self.file.close()

    def close(self) -> tuple[list[Part], str]:
        """(the parts, in order; the sha256 of the whole corpus)."""
        self.cut()
        self.release()
        self.file.close()
        if os.path.exists(self.path):
            os.remove(self.path)
        return self.parts, self.whole.hexdigest()


def iter_part_lines(store: Store, parts: list[Part]) -> Iterator[tuple[int, bytes]]:
    """(offset in the whole corpus, line) of every stored line, in order."""
    base = 0
    for part in parts:
        with store.open(part.key, "rb") as f:
            offset = base
            for line in f:
                yield offset, line
                offset += len(line)
        base += part.size


def publish_dataset(store: Store, fingerprint: str, parts: list[Part], info: dict) -> None:
    """Publish a dataset whose parts are stored: its info (listing them) last. Nothing of a
    failed publication is left behind."""
    info = dict(info, files={}, parts=[p.entry() for p in parts])
    staging = join("datasets", f".tmp-{fingerprint}-{uuid.uuid4().hex[:8]}")
    try:
        publish_folder(
            store,
            staging,
            dataset_key(fingerprint),
            INFO_FILE,
            info,
            is_intact=lambda: committed_dataset(store, fingerprint) is not None,
        )
    except BaseException:
        store.rm(staging)
        raise
