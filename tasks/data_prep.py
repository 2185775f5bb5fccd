"""Data preparation as plain functions (no Prefect): download, tokenizer, tokenize+shard.

Each function is idempotent against the object store: it first looks for its committed
output and does no work when it is there. The Prefect tasks in tasks/data.py wrap them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

from storage.shards import (
    FORMAT_VERSION,
    TOKENIZER_FILE,
    publish_shard_set,
    shard_cache_key,
    shard_set_key,
    staging_key,
    validate_shard_set,
)
from storage.store import Store, join, open_url, sha256_file
from training.config import BUILTIN_SOURCE, DataConfig, TokenizerConfig

EOT = "<|endoftext|>"
CORPUS_FILE = "corpus.jsonl"
BATCH_DOCS = 512
DOC_CHARS = 4000


class DataError(ValueError):
    """Bad data input (empty source, undecodable file, missing field); never retried."""


@dataclass
class DatasetInfo:
    fingerprint: str
    key: str  # {root}/datasets/{fingerprint}
    num_docs: int
    num_bytes: int
    cache_hit: bool


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


# ---- sources -----------------------------------------------------------------------
def _source_files(source: str) -> list[str]:
    if source == BUILTIN_SOURCE:
        return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if "://" in source:
        return [source]
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return sorted(
            p for p in glob.glob(os.path.join(path, "**", "*"), recursive=True)
            if p.endswith((".txt", ".jsonl", ".md", ".py"))
        )
    return sorted(glob.glob(path))


def _docs_of(name: str, raw: bytes, text_field: str) -> Iterator[str]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data.source: {name} is not UTF-8 text ({err}); remove or convert it.") from None
    if name.endswith(".jsonl"):
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if text_field not in record:
                raise DataError(
                    f"data.text_field: {name} line {lineno} has no field {text_field!r} "
                    f"(fields: {sorted(record)}); set data.text_field to the right one."
                )
            yield str(record[text_field])
    else:
        yield from _pack_paragraphs(text)


def _pack_paragraphs(text: str, target: int = DOC_CHARS) -> Iterator[str]:
    """Plain text becomes documents of about `target` characters, cut at blank lines, so
    that one big file still yields many documents for the hash-chosen validation split."""
    parts: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        parts.append(para)
        size += len(para) + 2
        if size >= target:
            yield "\n\n".join(parts)
            parts, size = [], 0
    if parts:
        yield "\n\n".join(parts)


def iter_source_docs(cfg: DataConfig) -> Iterator[str]:
    """Documents of the configured source, in a fixed order, up to max_bytes."""
    files = _source_files(cfg.source)
    if not files:
        raise DataError(f"data.source: {cfg.source!r} matches no file.")
    taken = 0
    for name in files:
        if "://" in name:
            with open_url(name) as f:
                raw = f.read()
        else:
            with open(name, "rb") as f:
                raw = f.read()
        for doc in _docs_of(name, raw, cfg.text_field):
            if not doc.strip():
                continue
            size = len(doc.encode())
            if cfg.max_bytes and taken + size > cfg.max_bytes and taken > 0:
                return
            taken += size
            yield doc


def download_dataset(cfg: DataConfig, store: Store) -> DatasetInfo:
    """Copy the source into {root}/datasets/{fingerprint}/ (info.json last).

    The fingerprint is a hash of the documents' content, so the same data lands in the
    same folder whatever path it came from; a second call finds it and copies nothing."""
    h = hashlib.sha256()
    tmp = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8")
    num_docs = num_bytes = 0
    try:
        with tmp:
            for doc in iter_source_docs(cfg):
                line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
                h.update(line.encode())
                tmp.write(line)
                num_docs += 1
                num_bytes += len(doc.encode())
        if num_docs == 0:
            raise DataError(f"data.source: {cfg.source!r} holds no non-empty document.")
        fingerprint = h.hexdigest()[:24]
        key = join("datasets", fingerprint)
        if store.exists(join(key, "info.json")):
            return DatasetInfo(fingerprint, key, num_docs, num_bytes, cache_hit=True)
        store.put_file(tmp.name, join(key, CORPUS_FILE))
        info = {"source": cfg.source, "num_docs": num_docs, "num_bytes": num_bytes,
                "fingerprint": fingerprint}
        store.write_json(join(key, "info.json"), info)
        return DatasetInfo(fingerprint, key, num_docs, num_bytes, cache_hit=False)
    finally:
        os.unlink(tmp.name)


def iter_corpus(store: Store, dataset: DatasetInfo) -> Iterator[str]:
    with store.open(join(dataset.key, CORPUS_FILE), "rb") as f:
        for line in f:
            yield json.loads(line)["text"]


# ---- tokenizer ---------------------------------------------------------------------
def train_tokenizer(dataset: DatasetInfo, cfg: TokenizerConfig, store: Store) -> TokenizerInfo:
    """Train a byte-level BPE on the corpus (or load cfg.path); stored under tokenizers/."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, TOKENIZER_FILE)
        if cfg.path:
            if "://" in cfg.path:
                with open_url(cfg.path) as src, open(local, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            else:
                shutil.copyfile(os.path.expanduser(cfg.path), local)
            cache_hit = False
        else:
            recipe = hashlib.sha256(
                json.dumps([dataset.fingerprint, cfg.vocab_size, cfg.min_frequency, EOT]).encode()
            ).hexdigest()[:24]
            cached = join("tokenizers", recipe, TOKENIZER_FILE)
            cache_hit = store.exists(cached)
            if cache_hit:
                store.get_file(cached, local)
            else:
                tok = Tokenizer(models.BPE())
                tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
                tok.decoder = decoders.ByteLevel()
                trainer = trainers.BpeTrainer(
                    vocab_size=cfg.vocab_size,
                    min_frequency=cfg.min_frequency,
                    special_tokens=[EOT],
                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                    show_progress=False,
                )
                tok.train_from_iterator(iter_corpus(store, dataset), trainer=trainer)
                tok.save(local)
                store.put_file(local, cached)
        tok = Tokenizer.from_file(local)
        eot_id = tok.token_to_id(EOT)
        if eot_id is None:
            raise DataError(f"tokenizer.path: the tokenizer has no {EOT!r} token; add it as a special token.")
        digest = sha256_file(local)
        key = join("tokenizers", "by-hash", digest[:24], TOKENIZER_FILE)
        if not store.exists(key):
            store.put_file(local, key)
        return TokenizerInfo(digest, key, tok.get_vocab_size(), eot_id, cache_hit)


# ---- tokenize and shard --------------------------------------------------------------
def _is_val(doc: str, val_fraction: float) -> bool:
    """Stable split by document content hash (same across reruns and worker counts)."""
    digest = hashlib.blake2b(doc.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


class _ShardWriter:
    def __init__(self, folder: str, split: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.index, self.count, self.f, self.ends = 0, 0, None, []
        self.files: dict[str, dict] = {}

    def _name(self, ext: str) -> str:
        return f"{self.split}-{self.index:05d}.{ext}"

    def write(self, ids: list[int]) -> None:
        if self.f is None:
            self.f = open(os.path.join(self.folder, self._name("bin")), "wb")
        arr = np.asarray(ids, dtype=self.dtype)
        self.f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
        self.count += len(ids)
        self.ends.append(self.count)
        if self.count >= self.shard_tokens:
            self.close()

    def close(self) -> None:
        if self.f is None:
            return
        self.f.close()
        np.asarray(self.ends, dtype="<u8").tofile(os.path.join(self.folder, self._name("idx")))
        self.files[self._name("bin")] = {"tokens": self.count}
        self.files[self._name("idx")] = {"docs": len(self.ends)}
        self.index, self.count, self.f, self.ends = self.index + 1, 0, None, []


def tokenize_and_shard(
    dataset: DatasetInfo, tokenizer: TokenizerInfo, cfg: DataConfig, store: Store
) -> ShardInfo:
    """Tokenize the corpus once into flat little-endian token files, manifest last.

    Returns at once (cache_hit=True) when a valid shard set with the same key exists."""
    dtype = np.dtype("<u2") if tokenizer.vocab_size <= 2**16 else np.dtype("<u4")
    params = {"val_fraction": cfg.val_fraction, "shard_tokens": cfg.shard_tokens,
              "dtype": dtype.str, "eot": EOT}
    cache_key = shard_cache_key(dataset.fingerprint, tokenizer.sha256, params)
    final = shard_set_key(cache_key)
    existing = validate_shard_set(store, cache_key, deep=True)  # a damaged set is rebuilt
    if existing:
        return _shard_info(store, cache_key, existing.manifest, cache_hit=True)

    with tempfile.TemporaryDirectory() as tmp:
        staging = staging_key(cache_key)
        build = store.local_path(staging) if store.is_local else os.path.join(tmp, "build")
        os.makedirs(build, exist_ok=True)
        try:
            store.get_file(tokenizer.key, os.path.join(build, TOKENIZER_FILE))
            files = _write_shards(store, dataset, tokenizer, cfg, build, dtype)
            for name, entry in files.items():
                path = os.path.join(build, name)
                entry.update(size=os.path.getsize(path), sha256=sha256_file(path))
                if not store.is_local:
                    store.put_file(path, join(staging, name))
        except BaseException:
            store.rm(staging)  # nothing half-written survives a failure
            raise
        bins = sorted(n for n in files if n.endswith(".bin"))
        manifest = {
            "format_version": FORMAT_VERSION,
            "cache_key": cache_key,
            "inputs": {"source_fingerprint": dataset.fingerprint,
                       "tokenizer_sha256": tokenizer.sha256, "params": params},
            "dtype": dtype.str,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "splits": {s: [n for n in bins if n.startswith(s + "-")] for s in ("train", "val")},
            "num_tokens": {s: sum(files[n]["tokens"] for n in bins if n.startswith(s + "-"))
                           for s in ("train", "val")},
            "files": files,
        }
        published = publish_shard_set(store, staging, cache_key, manifest)
    verdict = validate_shard_set(store, cache_key)
    assert verdict, f"shard set {final} did not validate after publishing: {verdict.reason}"
    return _shard_info(store, cache_key, verdict.manifest, cache_hit=not published)


def _write_shards(
    store: Store, dataset: DatasetInfo, tokenizer: TokenizerInfo, cfg: DataConfig, build: str,
    dtype: np.dtype,
) -> dict[str, dict]:
    """Stream the corpus through the tokenizer into per-split shard files under `build`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(build, TOKENIZER_FILE))
    writers = {s: _ShardWriter(build, s, dtype, cfg.shard_tokens) for s in ("train", "val")}
    batch: list[str] = []

    def flush() -> None:
        for doc, enc in zip(batch, tok.encode_batch_fast(batch)):
            split = "val" if _is_val(doc, cfg.val_fraction) else "train"
            writers[split].write(enc.ids + [tokenizer.eot_id])
        batch.clear()

    for doc in iter_corpus(store, dataset):
        batch.append(doc)
        if len(batch) >= BATCH_DOCS:
            flush()
    flush()
    files: dict[str, dict] = {TOKENIZER_FILE: {}}
    for split, w in writers.items():
        w.close()
        if not w.files:
            raise DataError(
                f"data.val_fraction: the {split} split got no document "
                f"({dataset.num_docs} documents in all); use more data or change val_fraction."
            )
        files.update(w.files)
    return files


def _shard_info(store: Store, cache_key: str, manifest: dict, cache_hit: bool) -> ShardInfo:
    key = shard_set_key(cache_key)
    return ShardInfo(
        cache_key=cache_key,
        key=key,
        url=store.url(key),
        num_train_tokens=manifest["num_tokens"]["train"],
        num_val_tokens=manifest["num_tokens"]["val"],
        vocab_size=manifest["vocab_size"],
        dtype=manifest["dtype"],
        cache_hit=cache_hit,
    )
