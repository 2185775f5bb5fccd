"""The features of documents that data.dedup and data.decontaminate decide on, as plain
functions of text (no store, no engine): the exact digest (blake2b of the text after NFC and
whitespace normalization), the MinHash signature (datasketch's affine32 permutations of a 64-bit
polynomial hash of each word n-gram, built from one blake2b hash per word) and the evaluation
items a document shares a long word n-gram with (the same n-gram hashes looked up among the
items', each hit checked against the words). stoker.data.dedup_units runs them over partitions."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from stoker.data.evalitems import EvalItem

NUM_PERM = 256  # MinHash permutations: the bands use most of them, the verification all
RECALL_MARGIN = 0.05  # a pair this far above the threshold is a candidate with BAND_RECALL at least
BAND_RECALL = 0.995
MINHASH_SEED = 1
MINHASH_SCHEME = (
    "affine32"  # datasketch 2's 32-bit permutations (its default), named so a new default cannot change them
)
MINHASH_BATCH = 512  # documents per datasketch MinHash.bulk call
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

    def _hits(self, ws: list[str], grams: Grams) -> list[tuple[int, int, str, list[str]]]:
        """(position, length, n-gram, items) of every n-gram of the words an item holds."""
        hits = []  # (position, length)
        for size in self.lengths:
            hits += [(int(i), size) for i in np.flatnonzero(_sorted_member(self.hashes[size], grams.of(size)))]
        out = []
        for i, size in sorted(hits):
            gram = " ".join(ws[i : i + size])
            ids = self.grams.get(gram)
            if ids:
                out.append((i, size, gram, ids))
        return out

    def matches(self, ws: list[str], grams: Grams | None = None) -> list[str]:
        """The items sharing an n-gram with these words, in first-seen order (by position,
        then n-gram length)."""
        found: dict[str, None] = {}
        for _, _, _, ids in self._hits(ws, grams or Grams(ws)):
            found.update(dict.fromkeys(ids))
        return list(found)

    def spans(self, text: str) -> tuple[int, list[list]]:
        """(length of the NFC text, [n-gram, items, start, end] per n-gram occurrence an item
        holds): where in the NFC text the matches lie, in characters. Words are found in the
        NFC text and lower-cased one by one; where that reads other words than `words` (a
        letter whose lower case is two characters), the whole text is one span."""
        nfc = unicodedata.normalize("NFC", text)
        found = list(_WORD.finditer(nfc))
        ws = [m.group().lower() for m in found]
        if ws != words(text):
            return len(nfc), [[None, self.matches(words(text)), 0, len(nfc)]]
        return len(nfc), [
            [gram, ids, found[i].start(), found[i + size - 1].end()] for i, size, gram, ids in self._hits(ws, Grams(ws))
        ]


# ---- decontamination by span (GPT-3's appendix C) ---------------------------------------------
SPAN_MARGIN_CHARS = 200  # removed on each side of a matching n-gram
MIN_PIECE_CHARS = 200  # a piece shorter than this is dropped
MAX_PIECES = 10  # a document cut into more pieces than this goes whole


def pieces(length: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The [start, end) character ranges of a text of `length` characters that stay once each
    span and SPAN_MARGIN_CHARS on each side are cut out, pieces shorter than MIN_PIECE_CHARS
    dropped; None when the cuts leave more than MAX_PIECES pieces or none (the document goes)."""
    cuts = sorted((max(0, a - SPAN_MARGIN_CHARS), min(length, b + SPAN_MARGIN_CHARS)) for a, b in spans)
    merged: list[list[int]] = []
    for a, b in cuts:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out, at = [], 0
    for a, b in merged + [[length, length]]:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if len(out) > MAX_PIECES:
        return None
    kept = [(a, b) for a, b in out if b - a >= MIN_PIECE_CHARS]
    return kept or None


# ---- step 1: features of one corpus ---------------------------------------------------------
@dataclass
class Features:
    digests: np.ndarray  # (N, 16) uint8
    sizes: np.ndarray  # (N,) int64: UTF-8 bytes of each document
    signatures: np.ndarray | None  # (N, NUM_PERM) uint32, or None
    matches: dict[int, dict]  # document -> {"len": NFC characters, "spans": [[n-gram, items, start, end]]}

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
        if index is not None and index.matches(ws, grams):  # the spans of the few that match
            length, spans = index.spans(doc)
            matches[k] = {"len": length, "spans": spans}
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


# ---- bands (locality-sensitive hashing of the signatures) ------------------------------------
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wraps mod 2**64, as meant)."""
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


def row_hash(values: np.ndarray, tag: int = 0) -> np.ndarray:
    """(N,) uint64: a 64-bit hash of each row of (N, m) uint32 `values`, apart per `tag`."""
    h = np.full(len(values), (tag + 1) * _GOLDEN % (1 << 64), np.uint64)
    for j in range(values.shape[1]):
        h = _mix64(h ^ values[:, j].astype(np.uint64))
    return h


def candidate_probability(similarity: float, num_bands: int, rows: int) -> float:
    """The chance that two documents of this Jaccard similarity share a band: 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - similarity**rows) ** num_bands


def bands(threshold: float) -> tuple[int, int]:
    """(bands, rows per band) for recall at this threshold: the most rows per band (the fewest
    false candidates) that still make a pair RECALL_MARGIN above the threshold a candidate with
    probability >= BAND_RECALL, at most NUM_PERM hashes in all. Every candidate is then verified
    on all NUM_PERM hashes, so the bands favour recall (datatrove bands 14 x 8 for the same
    reason; datasketch's MinHashLSH balances false positives and negatives: 9 x 13 of 128 at
    0.8, a candidate at 0.85 with probability 0.69). 0.8 gives 25 x 10 (0.996 at 0.85)."""
    target = min(threshold + RECALL_MARGIN, (1 + threshold) / 2)  # near 1: halfway to it
    best = (NUM_PERM // 2, 1)  # at a very low threshold, one hash per band
    for rows in range(1, NUM_PERM // 2 + 1):
        if candidate_probability(target, NUM_PERM // rows, rows) >= BAND_RECALL:
            best = (NUM_PERM // rows, rows)
    return best


def removal_probability(similarity: float, threshold: float) -> float:
    """The chance that a pair of this Jaccard similarity is found a near duplicate: a candidate
    of the bands, then NUM_PERM hashes estimating at least the threshold (binomial; the two
    events taken as independent, which they nearly are). The S-curve of docs/data.md."""
    from math import ceil, comb

    num_bands, rows = bands(threshold)
    need = ceil(threshold * NUM_PERM - 1e-9)
    verified = sum(
        comb(NUM_PERM, k) * similarity**k * (1 - similarity) ** (NUM_PERM - k) for k in range(need, NUM_PERM + 1)
    )
    return candidate_probability(similarity, num_bands, rows) * verified


def band_keys(sigs: np.ndarray, num_bands: int, rows: int) -> np.ndarray:
    """(N, num_bands) uint64: a hash of each band of each signature (band b: columns
    [b * rows, (b + 1) * rows)), apart per band."""
    out = np.empty((len(sigs), num_bands), np.uint64)
    for b in range(num_bands):
        out[:, b] = row_hash(sigs[:, b * rows : (b + 1) * rows], tag=b + 1)
    return out


def share_a_band(a: np.ndarray, b: np.ndarray, num_bands: int, rows: int) -> np.ndarray:
    """(P,) bool: whether signatures a[k] and b[k] ((P, NUM_PERM) each) have an equal band."""
    eq = (a[:, : num_bands * rows] == b[:, : num_bands * rows]).reshape(len(a), num_bands, rows)
    return eq.all(axis=2).any(axis=1)
