"""data.dedup and data.decontaminate: which documents of each source train, decided once.

Two steps per source, each cached in the store by content:

1. Features (``dedup/features/{key}/``): one pass over the stored corpus, in fixed byte
   partitions (``sharding.partition_ranges``), locally or as Ray tasks (data.engine 'ray'),
   giving per document its exact digest (blake2b of the text after NFC and whitespace
   normalization), its MinHash signature (datasketch's affine32 permutations of a 64-bit
   polynomial hash of each word n-gram, built from one blake2b hash per word; only when a source
   of the mixture asks for 'near') and the evaluation items it shares a long word n-gram with
   (the same n-gram hashes looked up among the items', each hit checked against the words).
   Documents are streamed; only the fixed-size features are kept. The key is the dataset's
   fingerprint and the feature settings: a source is featurized once whatever its mixture.
2. Decision (``dedup/{key}/``): the sources in their listed order; a document is removed when
   it holds an evaluation item, else when an earlier kept document (of an earlier source, or
   earlier in this source's files) has its digest ('exact' and 'near') or a signature whose
   estimated Jaccard similarity reaches data.near_dup_threshold ('near'). So which copy
   survives is a pure function of the content and the source order. The kept documents are
   published as a dataset of their own (content fingerprint, as any download), which the
   tokenizer and the shards then use; nothing removed: the source's own dataset. The key holds
   the fingerprints and settings of this source and every one before it: a rerun is a hit, and
   a source added at the end costs only its own features and decision.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import unicodedata
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from stoker.config import DataConfig, EvalConfig, RayConfig
from stoker.contracts.results import DatasetInfo, DedupInfo
from stoker.data.evalitems import EvalItem, eval_items, items_fingerprint
from stoker.data.ray_engine import StoreSpec, _node_id, _result, ray_tasks
from stoker.data.sharding import corpus_text, partition_ranges, range_lines
from stoker.storage.credentials import options_for
from stoker.storage.datasets import CORPUS_FILE, committed_dataset, content_fingerprint, dataset_key, publish_dataset
from stoker.storage.store import Store, build_lock, join, sha256_file

log = logging.getLogger("stoker.data")
DEDUP_VERSION = 2  # of the features and the decision rule: a change makes every result anew
NUM_PERM = 128  # MinHash permutations
MINHASH_SEED = 1
MINHASH_SCHEME = (
    "affine32"  # datasketch 2's 32-bit permutations (its default), named so a new default cannot change them
)
PARTITION_BYTES = 8 << 20  # of the corpus per features task (the same cut on every engine)
MINHASH_BATCH = 512  # documents per datasketch MinHash.bulk call
SAMPLE_PAIRS = 20  # removed documents kept, with the copy they matched, per reason and source
EXCERPT_CHARS = 600
RESULT_FILE = "result.json"
REMOVED_FILE = "removed.jsonl"
_WORD = re.compile(r"\w+")
MIN_ITEM_WORDS = 5  # an item of fewer words is not looked for (it would match common phrases)


# ---- text ------------------------------------------------------------------------------
def normalize(text: str) -> str:
    """The stated normalization of 'exact': Unicode NFC, runs of whitespace as one space, no
    leading or trailing whitespace."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def exact_digest(text: str) -> bytes:
    return hashlib.blake2b(normalize(text).encode("utf-8"), digest_size=16).digest()


def words(text: str) -> list[str]:
    """The words of n-grams (MinHash shingles, decontamination): lower-cased runs of letters,
    digits and '_' of the NFC text; punctuation and whitespace only separate them."""
    return _WORD.findall(unicodedata.normalize("NFC", text).lower())


def shingles(ws: list[str], n: int) -> list[bytes]:
    if len(ws) < n:
        return [" ".join(ws).encode("utf-8")]
    return [" ".join(ws[i : i + n]).encode("utf-8") for i in range(len(ws) - n + 1)]


# ---- n-gram hashes ------------------------------------------------------------------------
# A word's hash is blake2b's (64 bits), remembered across documents; a run of n words hashes to
# sum(h[i + j] * P**j) mod 2**64, one prefix sum per document giving every n at once. The
# MinHash of a document then needs no shingle string and no per-shingle Python call.
MAX_CACHED_WORDS = 1 << 18  # word hashes remembered per process (~40 MB; then forgotten, all at once)
_P = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible mod 2**64
_P_INV = np.uint64(pow(int(_P), -1, 1 << 64))
_LENGTH_MIX = 0xC2B2AE3D27D4EB4F  # a whole short document is a shingle of its own length
_WORD_HASHES: dict[str, int] = {}
_POWERS = (np.ones(1, np.uint64), np.ones(1, np.uint64))  # P**t, P**-t mod 2**64


def word_hashes(ws: list[str]) -> np.ndarray:
    """(len(ws),) uint64: blake2b's 64-bit hash of each word."""
    cache = _WORD_HASHES
    try:
        return np.array([cache[w] for w in ws], dtype=np.uint64)
    except KeyError:
        if len(cache) > MAX_CACHED_WORDS:
            cache.clear()
        for w in set(ws).difference(cache):
            cache[w] = int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little")
        return np.array([cache[w] for w in ws], dtype=np.uint64)


def _powers(count: int) -> tuple[np.ndarray, np.ndarray]:
    """(P**t, P**-t) for t < count, mod 2**64 (kept for the longest document seen)."""
    global _POWERS
    if len(_POWERS[0]) < count:
        size = max(count, 2 * len(_POWERS[0]))
        up, down = np.full(size, _P, np.uint64), np.full(size, _P_INV, np.uint64)
        up[0] = down[0] = 1
        _POWERS = (np.cumprod(up), np.cumprod(down))  # wraps mod 2**64, as meant
    return _POWERS[0][:count], _POWERS[1][:count]


class Grams:
    """The hashes of one word list's n-grams, for any n, from one prefix sum."""

    def __init__(self, ws: list[str]):
        self.num_words = len(ws)
        up, _ = _powers(self.num_words)
        self.prefix = np.zeros(self.num_words + 1, np.uint64)
        np.cumsum(word_hashes(ws) * up, out=self.prefix[1:])

    def of(self, n: int) -> np.ndarray:
        """(num_words - n + 1,) uint64: the hash of the n words from each position (none when
        there are fewer than n words)."""
        if n > self.num_words:
            return np.zeros(0, np.uint64)
        _, down = _powers(self.num_words - n + 1)
        return (self.prefix[n:] - self.prefix[: len(self.prefix) - n]) * down

    def shingles(self, n: int) -> np.ndarray:
        """(S,) uint32: a 32-bit hash of each shingle of `shingles(ws, n)`: the n-grams, or
        the whole word list when it is shorter."""
        size = min(n, self.num_words)
        h = self.of(size) + np.uint64(size * _LENGTH_MIX % (1 << 64))
        h ^= h >> np.uint64(33)  # MurmurHash3's 64-bit finalizer: the top bits of all words
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        return (h >> np.uint64(32)).astype(np.uint32)


def _sorted_member(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Which of `values` are in the sorted array `keys`."""
    if not len(keys):
        return np.zeros(len(values), bool)
    at = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
    return keys[at] == values


class EvalIndex:
    """The word n-grams of evaluation items, and which items hold each one. An item of fewer
    than n words (and at least MIN_ITEM_WORDS) is matched whole: a short item that a document
    holds is as contaminating as a long one."""

    def __init__(self, items: list[EvalItem], n: int):
        self.grams: dict[str, list[str]] = {}
        hashes: dict[int, list[np.ndarray]] = {}  # n-gram length -> their hashes
        for item in items:
            ws = words(item.text)
            size = min(n, len(ws))
            if size < MIN_ITEM_WORDS:
                continue
            hashes.setdefault(size, []).append(Grams(ws).of(size))
            for i in range(len(ws) - size + 1):
                ids = self.grams.setdefault(" ".join(ws[i : i + size]), [])
                if not ids or ids[-1] != item.id:
                    ids.append(item.id)
        self.lengths = sorted(hashes)
        # a hash that matches is checked against the n-gram itself: no false match by collision
        self.hashes = {size: np.unique(np.concatenate(hs)) for size, hs in hashes.items()}

    def matches(self, ws: list[str], grams: Grams | None = None) -> list[str]:
        """The items sharing an n-gram with these words, in first-seen order (by position,
        then n-gram length)."""
        grams = grams or Grams(ws)
        hits = []  # (position, length)
        for size in self.lengths:
            hits += [(int(i), size) for i in np.flatnonzero(_sorted_member(self.hashes[size], grams.of(size)))]
        found: dict[str, None] = {}
        for i, size in sorted(hits):
            ids = self.grams.get(" ".join(ws[i : i + size]))
            if ids:
                found.update(dict.fromkeys(ids))
        return list(found)


# ---- settings --------------------------------------------------------------------------
@dataclass(frozen=True)
class FeatureSpec:
    """What one pass over a corpus computes: signatures when `near_ngram`, matches when `index`."""

    near_ngram: int | None
    decontaminate_ngram: int | None
    items_fingerprint: str | None

    def key(self, dataset_fingerprint: str) -> str:
        import datasketch

        what = [
            DEDUP_VERSION,
            dataset_fingerprint,
            [self.near_ngram, NUM_PERM, MINHASH_SEED, MINHASH_SCHEME, datasketch.__version__]
            if self.near_ngram
            else None,
            [self.decontaminate_ngram, self.items_fingerprint] if self.decontaminate_ngram else None,
        ]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


def settings_of(cfg: DataConfig) -> dict:
    """The data options that shape one source's decision."""
    return {
        "dedup": cfg.dedup,
        "near_dup_threshold": cfg.near_dup_threshold if cfg.dedup == "near" else None,
        "near_dup_ngram": cfg.near_dup_ngram if cfg.dedup == "near" else None,
        "decontaminate": cfg.decontaminate,
        "decontaminate_ngram": cfg.decontaminate_ngram if cfg.decontaminate else None,
    }


# ---- step 1: features of one corpus ---------------------------------------------------------
@dataclass
class Features:
    digests: np.ndarray  # (N, 16) uint8
    sizes: np.ndarray  # (N,) int64: UTF-8 bytes of each document
    signatures: np.ndarray | None  # (N, NUM_PERM) uint32, or None
    matches: dict[int, list[str]]  # document -> evaluation items it holds

    def __len__(self) -> int:
        return len(self.sizes)


_PERMUTATIONS: list[np.ndarray] = []
MINHASH_ROWS = 1 << 13  # shingles permuted at once: (NUM_PERM, MINHASH_ROWS) uint32, 4 MiB


def _permutations() -> tuple[np.ndarray, np.ndarray]:
    """datasketch's affine32 permutations (a, b), each (NUM_PERM,) uint32, checked once per
    process to give what its own MinHash gives for the same 32-bit shingle hashes."""
    if not _PERMUTATIONS:
        from datasketch import MinHash

        a, b = MinHash(num_perm=NUM_PERM, seed=MINHASH_SEED, scheme=MINHASH_SCHEME).permutations
        _PERMUTATIONS[:] = [a.astype(np.uint32), b.astype(np.uint32)]
        probe = np.array([0, 1, 7, 2**32 - 1, 123456789], dtype=np.uint32)
        m = MinHash(num_perm=NUM_PERM, seed=MINHASH_SEED, scheme=MINHASH_SCHEME, hashfunc=int)
        m.update_batch(probe.tolist())
        assert np.array_equal(_signatures([probe]), m.hashvalues.reshape(1, -1)), "datasketch's affine32 changed"
    return _PERMUTATIONS[0], _PERMUTATIONS[1]


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, which datasketch's affine32 applies before permuting."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _signatures(batch: list[np.ndarray]) -> np.ndarray:
    """MinHash signatures, (len(batch), NUM_PERM) uint32, of documents given by their 32-bit
    shingle hashes (each non-empty): datasketch's affine32 scheme (its MinHash with these hashes
    as hashfunc's values), computed for many documents at once in blocks of MINHASH_ROWS."""
    a, b = _permutations()
    hv = _fmix32(np.concatenate(batch))
    starts = np.cumsum([0] + [len(x) for x in batch[:-1]])
    sigs = np.full((len(batch), NUM_PERM), np.iinfo(np.uint32).max, np.uint32)
    for r0 in range(0, len(hv), MINHASH_ROWS):
        r1 = min(r0 + MINHASH_ROWS, len(hv))
        first = np.searchsorted(starts, r0, side="right") - 1  # the document holding row r0
        docs = np.arange(first, np.searchsorted(starts, r1, side="left"))
        cuts = np.maximum(starts[docs], r0) - r0
        phv = np.multiply.outer(a, hv[r0:r1])  # (NUM_PERM, rows): reduced along contiguous rows
        phv += b[:, None]  # wraps mod 2**32, as the scheme says
        sigs[docs] = np.minimum(sigs[docs], np.minimum.reduceat(phv, cuts, axis=1).T)
    return sigs.astype("<u4")


def features_of(docs: Iterator[str], near_ngram: int | None, index: EvalIndex | None) -> Features:
    """Features of documents in order (the one definition both engines run)."""
    digests, sizes, sigs, matches, batch = [], [], [], {}, []
    for k, doc in enumerate(docs):
        digests.append(exact_digest(doc))
        sizes.append(len(doc.encode("utf-8")))
        if near_ngram is None and index is None:
            continue
        ws = words(doc)
        grams = Grams(ws)
        if index is not None:
            found = index.matches(ws, grams)
            if found:
                matches[k] = found
        if near_ngram is not None:
            batch.append(grams.shingles(near_ngram))
            if len(batch) >= MINHASH_BATCH:
                sigs.append(_signatures(batch))
                batch = []
    if near_ngram is not None and batch:
        sigs.append(_signatures(batch))
    return Features(
        np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(-1, 16),
        np.asarray(sizes, dtype=np.int64),
        (np.concatenate(sigs) if sigs else np.zeros((0, NUM_PERM), "<u4")) if near_ngram is not None else None,
        matches,
    )


def join_features(parts: list[Features]) -> Features:
    """Partition features in partition order, numbered as one corpus."""
    matches, base = {}, 0
    for p in parts:
        matches.update({base + k: v for k, v in p.matches.items()})
        base += len(p)
    sigs = [p.signatures for p in parts]
    return Features(
        np.concatenate([p.digests for p in parts]),
        np.concatenate([p.sizes for p in parts]),
        None if sigs[0] is None else np.concatenate(sigs),
        matches,
    )


def partition_features(
    read: Callable[[int, int], bytes],
    start: int,
    end: int,
    near_ngram: int | None,
    items: list[EvalItem] | None,
    n: int,
) -> Features:
    """One partition's features, read through `read(offset, size)` (local file or store)."""
    index = _index(items, n) if items is not None else None
    docs = (corpus_text(line, offset) for offset, line in range_lines(read, start, end))
    return features_of(docs, near_ngram, index)


_INDEXES: dict = {}


def _index(items: list[EvalItem], n: int) -> EvalIndex:
    key = (items_fingerprint(items), n)
    if key not in _INDEXES:  # one per process: Ray workers reuse it across partitions
        _INDEXES.clear()
        _INDEXES[key] = EvalIndex(items, n)
    return _INDEXES[key]


def _compute_features(
    store: Store,
    dataset: DatasetInfo,
    spec: FeatureSpec,
    items: list[EvalItem] | None,
    engine: str,
    ray: RayConfig | None,
) -> Features:
    corpus = join(dataset.key, CORPUS_FILE)
    size = store.size(corpus)
    ranges = partition_ranges(size, PARTITION_BYTES)
    n = spec.decontaminate_ngram or 0
    if engine == "ray":
        return join_features(
            features_on_ray(store, ray or RayConfig(), corpus, size, ranges, spec.near_ngram, items, n)
        )
    with store.open(corpus, "rb") as f:

        def read(offset: int, count: int) -> bytes:
            f.seek(offset)
            return f.read(count)

        return join_features([partition_features(read, s, e, spec.near_ngram, items, n) for s, e in ranges])


# ---- data.dedup: features of the corpus's partitions ---------------------------------------
def features_task(spec: StoreSpec, corpus_key: str, corpus_size: int, start: int, end: int, near_ngram, items, n: int):
    """One partition's dedup features (stoker.data.dedup.partition_features), read by ranges."""
    store = spec.open()

    def read(offset: int, size: int) -> bytes:
        return store.read_range(corpus_key, offset, min(size, corpus_size - offset)) if offset < corpus_size else b""

    return partition_features(read, start, end, near_ngram, items, n), _node_id()


def features_on_ray(store: Store, ray_cfg: RayConfig, corpus_key: str, corpus_size: int, ranges, near_ngram, items, n):
    """The dedup features of every partition, as Ray tasks, in partition order (the local
    engine's cut, so the features and the decisions are the same whatever the engine)."""
    spec = StoreSpec(store.root, options_for(store.root, store.storage_options))
    cpus = ray_cfg.cpus_per_data_task
    with ray_tasks(ray_cfg, cpus) as (ray, refs):
        task = ray.remote(features_task).options(num_cpus=cpus, name="stoker-dedup", scheduling_strategy="SPREAD")
        items_ref = ray.put(items)
        refs += [task.remote(spec, corpus_key, corpus_size, s, e, near_ngram, items_ref, n) for s, e in ranges]
        got = [_result(ray, ref, f"computes the dedup features of partition {k}") for k, ref in enumerate(refs)]
        log.info(
            "data.dedup on ray: %d tasks on %d node(s)",
            len(refs),
            len({node for _, node in got}),
            extra={"ray_nodes": sorted({node for _, node in got})},
        )
        return [features for features, _ in got]


def _features_key(key: str) -> str:
    return join("dedup", "features", key)


def load_or_compute_features(
    store: Store,
    dataset: DatasetInfo,
    spec: FeatureSpec,
    items: list[EvalItem] | None,
    engine: str,
    ray: RayConfig | None,
) -> tuple[Features, bool]:
    """(features, cache hit) of a dataset under `spec`: read from the store, or computed and
    stored (arrays first, features.json last)."""
    key = _features_key(spec.key(dataset.fingerprint))
    with build_lock(store, key):
        try:
            meta = store.read_json(join(key, "features.json"))
            with tempfile.TemporaryDirectory(prefix="stoker-dedup-") as tmp:
                local = os.path.join(tmp, "features.npz")
                store.get_file(join(key, "features.npz"), local)
                with np.load(local) as z:
                    feats = Features(z["digests"], z["sizes"], z["signatures"] if "signatures" in z else None, {})
            feats.matches = {int(k): v for k, v in meta["matches"].items()}
            if len(feats) == meta["num_docs"] == dataset.num_docs:
                return feats, True
        except (FileNotFoundError, KeyError, ValueError, OSError):
            pass  # absent or damaged: computed again
        feats = _compute_features(store, dataset, spec, items, engine, ray)
        with tempfile.TemporaryDirectory(prefix="stoker-dedup-") as tmp:
            local = os.path.join(tmp, "features.npz")
            arrays = {"digests": feats.digests, "sizes": feats.sizes}
            if feats.signatures is not None:
                arrays["signatures"] = feats.signatures
            with open(local, "wb") as f:
                np.savez(f, **arrays)
            store.put_file(local, join(key, "features.npz"))
        store.write_json(
            join(key, "features.json"),
            {"num_docs": len(feats), "matches": {str(k): v for k, v in feats.matches.items()}},
        )
        return feats, False


# ---- step 2: the decision, source after source ------------------------------------------------
def _result_key(prefix: list[tuple[str, dict]], items_print: str | None) -> str:
    what = [
        DEDUP_VERSION,
        [[fp, s] for fp, s in prefix],
        items_print if any(s["decontaminate"] for _, s in prefix) else None,
    ]
    return join("dedup", hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24])


def _committed_result(store: Store, key: str) -> tuple[dict, np.ndarray] | None:
    """(result.json, kept mask) of a decision whose output dataset is in the store."""
    try:
        result = store.read_json(join(key, RESULT_FILE))
        kept = np.frombuffer(store.read_bytes(join(key, "kept.bin")), dtype=np.uint8).astype(bool)
    except (FileNotFoundError, ValueError):
        return None
    if committed_dataset(store, result["output_fingerprint"]) is None or len(kept) != result["num_docs_in"]:
        return None
    return result, kept


class _Seen:
    """The kept documents so far: digests, and (when a source is 'near') an LSH index of their
    signatures. Keys are (source index, document index)."""

    def __init__(self, threshold: float, near: bool):
        from datasketch import MinHashLSH

        self.digests: dict[bytes, tuple[int, int]] = {}
        self.threshold = threshold
        # banded at most at 0.9 (datasketch needs 2 bands or more): the candidates are then
        # checked against the threshold itself
        self.lsh = MinHashLSH(threshold=min(threshold, 0.9), num_perm=NUM_PERM) if near else None
        self.sigs: dict[tuple[int, int], np.ndarray] = {}

    def add(self, key: tuple[int, int], digest: bytes, sig: np.ndarray | None) -> None:
        self.digests.setdefault(digest, key)
        if self.lsh is not None:
            from datasketch import LeanMinHash

            self.lsh.insert(
                key, LeanMinHash(seed=MINHASH_SEED, hashvalues=sig, scheme=MINHASH_SCHEME), check_duplication=False
            )
            self.sigs[key] = sig

    def near(self, sig: np.ndarray) -> tuple[tuple[int, int], float] | None:
        """The first kept document (in source and document order) at least `threshold` similar."""
        from datasketch import LeanMinHash

        best = None
        for key in self.lsh.query(LeanMinHash(seed=MINHASH_SEED, hashvalues=sig, scheme=MINHASH_SCHEME)):
            similarity = float(np.mean(self.sigs[key] == sig))
            if similarity >= self.threshold and (best is None or key < best[0]):
                best = (key, similarity)
        return best


def _decide(i: int, feats: Features, cfg: DataConfig, seen: _Seen) -> tuple[np.ndarray, list[dict]]:
    """(kept mask, removed records) of source i, adding its kept documents to `seen`."""
    kept = np.ones(len(feats), dtype=bool)
    removed = []
    for k in range(len(feats)):
        digest = feats.digests[k].tobytes()
        sig = feats.signatures[k] if feats.signatures is not None else None
        if cfg.decontaminate and k in feats.matches:
            removed.append({"reason": "contaminated", "doc": k, "items": feats.matches[k]})
        elif cfg.dedup != "none" and digest in seen.digests:
            removed.append({"reason": "exact", "doc": k, "kept": list(seen.digests[digest]), "similarity": 1.0})
        elif cfg.dedup == "near" and (hit := seen.near(sig)) is not None:
            removed.append({"reason": "near", "doc": k, "kept": list(hit[0]), "similarity": round(hit[1], 4)})
        else:
            seen.add((i, k), digest, sig)
            continue
        kept[k] = False
    return kept, removed


def _texts(store: Store, dataset: DatasetInfo, wanted: set[int]) -> dict[int, str]:
    """The texts of some documents of a stored corpus, read by streaming it."""
    out: dict[int, str] = {}
    if not wanted:
        return out
    with store.open(join(dataset.key, CORPUS_FILE), "rb") as f:
        offset = 0
        for k, line in enumerate(f):
            if k in wanted:
                out[k] = corpus_text(line, offset)
                if len(out) == len(wanted):
                    break
            offset += len(line)
    return out


def _samples(
    store: Store, i: int, removed: list[dict], datasets: list[DatasetInfo], names: list[str], items: dict
) -> list[dict]:
    """The first SAMPLE_PAIRS removed documents of each reason, with the copy (or the
    evaluation item) they matched, as excerpts a person can compare."""
    picked: list[dict] = []
    for reason in ("exact", "near", "contaminated"):
        picked += [r for r in removed if r["reason"] == reason][:SAMPLE_PAIRS]
    wanted: dict[int, set[int]] = {i: {r["doc"] for r in picked}}
    for r in picked:
        if "kept" in r:
            wanted.setdefault(r["kept"][0], set()).add(r["kept"][1])
    texts = {j: _texts(store, datasets[j], ks) for j, ks in wanted.items()}
    out = []
    for r in picked:
        row = {"reason": r["reason"], "source": names[i], "doc": r["doc"], "text": texts[i][r["doc"]][:EXCERPT_CHARS]}
        if "kept" in r:
            j, k = r["kept"]
            row.update(
                kept_source=names[j], kept_doc=k, kept_text=texts[j][k][:EXCERPT_CHARS], similarity=r["similarity"]
            )
        else:
            row.update(items=r["items"], item_text=items.get(r["items"][0], "")[:EXCERPT_CHARS])
        out.append(row)
    return out


def _publish_kept(store: Store, dataset: DatasetInfo, kept: np.ndarray, key: str) -> tuple[str, int, int]:
    """(fingerprint, documents, bytes) of the kept documents, published as a dataset (the
    source's own when nothing was removed)."""
    if kept.all():
        return dataset.fingerprint, dataset.num_docs, dataset.num_bytes
    with tempfile.TemporaryDirectory(prefix="stoker-dedup-") as tmp:
        local = os.path.join(tmp, CORPUS_FILE)
        num_docs = num_bytes = 0
        with store.open(join(dataset.key, CORPUS_FILE), "rb") as src, open(local, "wb") as out:
            offset = 0
            for k, line in enumerate(src):
                if kept[k]:
                    out.write(line if line.endswith(b"\n") else line + b"\n")
                    num_docs += 1
                    num_bytes += len(corpus_text(line, offset).encode("utf-8"))
                offset += len(line)
        digest = sha256_file(local)
        fingerprint = content_fingerprint(digest)
        with build_lock(store, dataset_key(fingerprint)):
            if committed_dataset(store, fingerprint) is None:
                info = {
                    "source": f"dedup of {dataset.fingerprint}",
                    "fingerprint": fingerprint,
                    "derived_from": dataset.fingerprint,
                    "dedup_key": key,
                    "num_docs": num_docs,
                    "num_bytes": num_bytes,
                    "files": {CORPUS_FILE: {"size": os.path.getsize(local), "sha256": digest}},
                }
                publish_dataset(store, fingerprint, local, info)
    return fingerprint, num_docs, num_bytes


def _counts(removed: list[dict]) -> tuple[int, int, int, dict[str, int]]:
    items: dict[str, int] = {}
    for r in removed:
        for item in r.get("items", ()):
            items[item] = items.get(item, 0) + 1
    by = {reason: sum(r["reason"] == reason for r in removed) for reason in ("exact", "near", "contaminated")}
    return by["exact"], by["near"], by["contaminated"], dict(sorted(items.items()))


def _info(name: str, key: str, dataset: DatasetInfo, result: dict, cache_hit: bool) -> tuple[DatasetInfo, DedupInfo]:
    fp = result["output_fingerprint"]
    out = DatasetInfo(
        fp,
        dataset_key(fp),
        result["num_docs_out"],
        result["num_bytes_out"],
        dataset.cache_hit,
        dataset.num_skipped_files,
    )
    info = DedupInfo(
        name=name,
        key=key,
        dedup=result["settings"]["dedup"],
        decontaminate=result["settings"]["decontaminate"],
        num_docs_in=result["num_docs_in"],
        num_bytes_in=result["num_bytes_in"],
        num_exact=result["num_exact"],
        num_near=result["num_near"],
        num_contaminated=result["num_contaminated"],
        num_docs_out=result["num_docs_out"],
        num_bytes_out=result["num_bytes_out"],
        items=result["items"],
        cache_hit=cache_hit,
    )
    return out, info


def _feature_spec(cfg: DataConfig, any_near: bool, items_print: str | None) -> FeatureSpec:
    return FeatureSpec(
        cfg.near_dup_ngram if any_near else None,
        cfg.decontaminate_ngram if cfg.decontaminate else None,
        items_print if cfg.decontaminate else None,
    )


def checked_items(sources: list[DataConfig], evaluation: EvalConfig | None) -> list[EvalItem] | None:
    """The evaluation items to check when any source decontaminates (None: none does). A
    source that asked for it (data.decontaminate true) with no item to check is one DataError,
    as the config's own rule says before any work; one that left it empty decontaminates where
    the run scores an evaluation set."""
    if not any(cfg.decontaminate is not False for cfg in sources):
        return None
    items = eval_items(evaluation or EvalConfig())
    if not items and any(cfg.decontaminate for cfg in sources):
        from stoker.failures import DataError

        raise DataError(
            "data.decontaminate: the run scores no evaluation set to check the training data against "
            "(eval.sets has no 'multiple_choice', eval.harness_tasks is empty); add one, or set data.decontaminate false."
        )
    return items or None


def resolved(cfg: DataConfig, items: list[EvalItem] | None) -> DataConfig:
    """A source's settings as decided: decontaminate left empty is true where there are items."""
    return cfg.model_copy(update={"decontaminate": cfg.decontaminate is not False and bool(items)})


def _items_of(cfg: DataConfig, items: list[EvalItem] | None) -> list[EvalItem] | None:
    return items if cfg.decontaminate else None


def _add_kept(seen: _Seen, store: Store, *, j, datasets, cfgs, kept, items, ray) -> None:
    """Source j's kept documents into `seen` (its features from the store, or computed)."""
    any_near = seen.lsh is not None
    items_print = items_fingerprint(items) if items is not None else None
    spec = _feature_spec(cfgs[j], any_near, items_print)
    feats, _ = load_or_compute_features(store, datasets[j], spec, _items_of(cfgs[j], items), cfgs[j].engine, ray)
    for k in np.flatnonzero(kept):
        seen.add((j, int(k)), feats.digests[k].tobytes(), None if feats.signatures is None else feats.signatures[k])


def dedup_sources(
    datasets: list[DatasetInfo],
    sources: list[tuple[str, DataConfig]],
    store: Store,
    evaluation: EvalConfig | None = None,
    ray: RayConfig | None = None,
) -> list[tuple[DatasetInfo, DedupInfo]]:
    """Each source's kept documents (a dataset to tokenize) and what was removed from it and
    why, in the order of `sources` (see the module docstring). Sources whose decision is in the
    store cost one read each; features are computed only for what a missing decision needs."""
    items = checked_items([cfg for _, cfg in sources], evaluation)
    sources = [(name, resolved(cfg, items)) for name, cfg in sources]
    cfgs = [cfg for _, cfg in sources]
    names = [name for name, _ in sources]
    items_print = items_fingerprint(items) if items is not None else None
    any_near = any(cfg.dedup == "near" for cfg in cfgs)
    prefix = [(d.fingerprint, settings_of(cfg)) for d, cfg in zip(datasets, cfgs)]
    keys = [_result_key(prefix[: i + 1], items_print) for i in range(len(sources))]
    done = [_committed_result(store, key) for key in keys]
    out: list[tuple[DatasetInfo, DedupInfo]] = []
    seen: _Seen | None = None
    item_text = {it.id: it.text for it in items or []}
    for i, (name, cfg) in enumerate(sources):
        if done[i] is not None:
            out.append(_info(name, keys[i], datasets[i], done[i][0], cache_hit=True))
            if seen is not None:  # a later source decides against it
                _add_kept(seen, store, j=i, datasets=datasets, cfgs=cfgs, kept=done[i][1], items=items, ray=ray)
            continue
        if seen is None:  # the kept documents of every source before this one
            seen = _Seen(cfgs[0].near_dup_threshold, any_near)
            for j in range(i):
                _add_kept(seen, store, j=j, datasets=datasets, cfgs=cfgs, kept=done[j][1], items=items, ray=ray)
        spec = _feature_spec(cfg, any_near, items_print)
        feats, _ = load_or_compute_features(store, datasets[i], spec, _items_of(cfg, items), cfg.engine, ray)
        kept, removed = _decide(i, feats, cfg, seen)
        result = _record(store, keys[i], i, datasets, names, cfg, feats, kept, removed, item_text)
        done[i] = (result, kept)
        out.append(_info(name, keys[i], datasets[i], result, cache_hit=False))
    return out


def _record(
    store: Store,
    key: str,
    i: int,
    datasets: list[DatasetInfo],
    names: list[str],
    cfg: DataConfig,
    feats: Features,
    kept: np.ndarray,
    removed: list[dict],
    item_text: dict[str, str],
) -> dict:
    """Publish source i's kept documents, then its decision: kept mask, removed samples, and
    result.json last (the commit marker)."""
    fingerprint, num_docs, num_bytes = _publish_kept(store, datasets[i], kept, key)
    exact, near, contaminated, items = _counts(removed)
    samples = _samples(store, i, removed, datasets, names, item_text)
    store.write_bytes(
        join(key, REMOVED_FILE), "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples).encode()
    )
    store.write_bytes(join(key, "kept.bin"), kept.astype(np.uint8).tobytes())
    result = {
        "settings": settings_of(cfg),
        "input_fingerprint": datasets[i].fingerprint,
        "output_fingerprint": fingerprint,
        "num_docs_in": len(feats),
        "num_bytes_in": int(feats.sizes.sum()),
        "num_exact": exact,
        "num_near": near,
        "num_contaminated": contaminated,
        "num_docs_out": num_docs,
        "num_bytes_out": num_bytes,
        "items": items,
    }
    store.write_json(join(key, RESULT_FILE), result)
    return result


def removed_samples(store: Store, info: DedupInfo) -> list[dict]:
    """The sample of removed documents (with what they matched) of one source's decision."""
    try:
        raw = store.read_bytes(join(info.key, REMOVED_FILE))
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line]
