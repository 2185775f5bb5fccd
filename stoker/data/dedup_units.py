"""The units of data.dedup and data.decontaminate (stoker.data.units runs them, locally or as
Ray tasks): datatrove's stage design over stoker's partitions, so that no process holds the
corpus's features and the flow process holds nothing per document.

1. ``features_unit``, one per partition of a source (a byte range of one of its stored parts,
   at data.partition_bytes): the partition's documents streamed once into their exact digests, MinHash
   signatures and evaluation matches (stoker.data.minhash), written to the partition's folder:
   ``exact.bin`` (a record per document: its digest, sorted), ``sigs.bin``, ``bands-BxR.bin``
   (a record per band of each signature: the band's hash, the whole signature's hash, sorted),
   each with the offsets of its SLOTS slots of keys (``.slots``, little-endian int64), and ``meta.json`` last (the counts and the
   documents holding evaluation items). Cached per partition, by the part's content: an added
   source, a grown one, or a rerun, computes only the partitions it lacks.
2. ``bucket_unit``, one per bucket (a range of slots; the bucket count grows with the corpus):
   the records of its keys from every partition of every source, sorted; documents with equal
   digests grouped (exact), documents sharing a band hash become candidate pairs, collapsed
   first to one document per identical signature, and every candidate is verified on the two
   signatures (estimated Jaccard >= data.near_dup_threshold, a band really equal). Its output is
   the duplicate relations only: memory bounded by the bucket's records.
3. ``decide_unit``, once: today's rule over those relations, in source and document order: a
   document is removed when it holds an evaluation item, else when an earlier kept document has
   its digest ('exact' and 'near'), else when an earlier kept document is a verified near
   duplicate ('near'). Only documents that take part in a relation are visited; the state is
   per group of duplicates (its first kept member), never per document of the corpus.
4. ``publish_unit``, one per decided source: its kept documents streamed into a dataset of
   their own (content fingerprint, as any download; a part per part of the source), the removed sample, the removed
   documents' numbers and result.json last.

A document's key is ``source << 52 | partition << 28 | document in partition``: their order is
the corpus's order, so which copy survives is a pure function of content and source order,
whatever the engine, the worker count or the bucket count.
"""

from __future__ import annotations

import io
import json
import tempfile
import unicodedata
from collections import Counter, defaultdict

import numpy as np

from stoker.data.evalitems import EvalItem
from stoker.data.minhash import NUM_PERM, EvalIndex, band_keys, features_of, pieces, row_hash, share_a_band
from stoker.data.sharding import corpus_text, store_lines
from stoker.storage.datasets import (
    Part,
    PartWriter,
    committed_dataset,
    content_fingerprint,
    dataset_key,
    publish_dataset,
)
from stoker.storage.store import Store, build_lock, join

SLOT_BITS = 10
SLOTS = 1 << SLOT_BITS  # of each partition's sorted records, by the keys' top bits
BUCKET_DOCS = 1 << 18  # documents of the corpus per bucket: ~50 MB of a bucket's records
EXACT = np.dtype([("key", "<u8"), ("lo", "<u8"), ("doc", "<u4")])  # a digest's 16 bytes
BAND = np.dtype([("key", "<u8"), ("sig", "<u8"), ("doc", "<u4")])  # a band's and the signature's hash
SOURCE_SHIFT, PART_SHIFT = 52, 28
META = "meta.json"
SAMPLE_PAIRS = 20  # removed documents kept, with the copy they matched, per reason and source
EXCERPT_CHARS = 600
RESULT_FILE = "result.json"
REMOVED_FILE = "removed.jsonl"
REMOVED_DOCS = "removed.npy"
REASONS = ("contaminated", "exact", "near")


# ---- keys and small files ---------------------------------------------------------------------
def doc_keys(source: int, part: int, docs: np.ndarray) -> np.ndarray:
    if part >= 1 << (SOURCE_SHIFT - PART_SHIFT) or source >= 1 << (64 - SOURCE_SHIFT):
        raise ValueError(f"partition {part} of source {source}: more than the document keys can number")
    return (np.uint64(source) << np.uint64(SOURCE_SHIFT)) | (np.uint64(part) << np.uint64(PART_SHIFT)) | docs


def split_key(key: int) -> tuple[int, int, int]:
    """(source, partition, document in partition) of a document key."""
    return (
        key >> SOURCE_SHIFT,
        (key >> PART_SHIFT) & ((1 << (SOURCE_SHIFT - PART_SHIFT)) - 1),
        key & ((1 << PART_SHIFT) - 1),
    )


def _read_npy(store: Store, key: str) -> np.ndarray:
    return np.load(io.BytesIO(store.read_bytes(key)), allow_pickle=False)


def _write_npz(store: Store, key: str, **arrays) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    store.write_bytes(key, buf.getvalue())  # atomic: present means whole


def _json_or_none(store: Store, key: str) -> dict | None:
    try:
        return store.read_json(key)
    except (FileNotFoundError, ValueError):
        return None


def _slots(keys: np.ndarray) -> np.ndarray:
    """(SLOTS + 1,) int64: where each slot of the sorted `keys` begins."""
    top = keys >> np.uint64(64 - SLOT_BITS)
    return np.searchsorted(top, np.arange(SLOTS + 1, dtype=np.uint64), side="left").astype(np.int64)


_ITEMS: dict = {}


def items_key(items_print: str) -> str:
    return join("dedup", "items", f"{items_print}.json")


def put_items(store: Store, items: list[EvalItem], items_print: str) -> str:
    """The evaluation items, once in the store, for every unit to read."""
    key = items_key(items_print)
    if not store.exists(key):
        store.write_json(key, [[it.id, it.text] for it in items])
    return key


def _eval_index(store: Store, key: str, n: int) -> EvalIndex:
    if (key, n) not in _ITEMS:  # one per process: workers reuse it across partitions
        _ITEMS.clear()
        _ITEMS[(key, n)] = EvalIndex([EvalItem(i, t) for i, t in store.read_json(key)], n)
    return _ITEMS[(key, n)]


# ---- 1. features of one partition -------------------------------------------------------------
def features_unit(
    store: Store,
    *,
    folder: str,
    corpus: str,
    size: int,
    start: int,
    end: int,
    near_ngram: int | None,
    items: str | None,
    n: int,
    bands: list[int] | None,
) -> dict:
    """One partition's features into `folder` (see the module doc); cached."""
    meta = _json_or_none(store, join(folder, META))
    cached = meta is not None
    if meta is None:
        meta = _features(store, folder, corpus, size, start, end, near_ngram, items, n)
    if bands and not store.exists(join(folder, f"bands-{bands[0]}x{bands[1]}.done")):
        cached = False
        _bands(store, folder, meta, *bands)
    return {"docs": meta["num_docs"], "bytes": meta["num_bytes"], "cached": cached}


def _clean(meta: dict) -> np.ndarray:
    """The partition's documents that take part in deduplication: all of them (one holding an
    evaluation item may keep its other text, cut in pieces; which n-grams count is known only
    once every partition's are counted, in the decision)."""
    return np.arange(meta["num_docs"], dtype="<u4")


def _features(store, folder, corpus, size, start, end, near_ngram, items, n) -> dict:
    index = _eval_index(store, items, n) if items else None
    docs = (corpus_text(line, offset) for offset, line in store_lines(store, corpus, size, start, end))
    feats = features_of(docs, near_ngram, index)
    meta = {
        "num_docs": len(feats),
        "num_bytes": int(feats.sizes.sum()),
        "matches": {str(k): v for k, v in feats.matches.items()},
        "near": near_ngram is not None,
    }
    ids = _clean(meta)
    digests = feats.digests[ids]
    rec = np.empty(len(ids), EXACT)
    rec["key"] = np.ascontiguousarray(digests[:, :8]).view(">u8").ravel()
    rec["lo"] = np.ascontiguousarray(digests[:, 8:]).view(">u8").ravel()
    rec["doc"] = ids
    rec = rec[np.lexsort((rec["doc"], rec["lo"], rec["key"]))]
    store.write_bytes(join(folder, "exact.bin"), rec.tobytes())
    store.write_bytes(join(folder, "exact.slots"), _slots(rec["key"]).astype("<i8").tobytes())
    if feats.signatures is not None:
        store.write_bytes(join(folder, "sigs.bin"), feats.signatures.astype("<u4").tobytes())
    store.write_json(join(folder, META), meta)  # last: the partition's features are committed
    return meta


def _signature_rows(store: Store, folder: str, rows: np.ndarray) -> np.ndarray:
    """(len(rows), NUM_PERM) uint32: the signatures of these (sorted) documents of a partition,
    read in ranges (neighbours read together)."""
    out = np.empty((len(rows), NUM_PERM), "<u4")
    width = NUM_PERM * 4
    k = 0
    while k < len(rows):
        j = k
        while j + 1 < len(rows) and rows[j + 1] - rows[j] <= 16:
            j += 1
        raw = store.read_range(join(folder, "sigs.bin"), int(rows[k]) * width, int(rows[j] - rows[k] + 1) * width)
        block = np.frombuffer(raw, "<u4").reshape(-1, NUM_PERM)
        out[k : j + 1] = block[rows[k : j + 1] - rows[k]]
        k = j + 1
    return out


def _bands(store: Store, folder: str, meta: dict, num_bands: int, rows: int) -> None:
    ids = _clean(meta)
    sigs = np.frombuffer(store.read_bytes(join(folder, "sigs.bin")), "<u4").reshape(-1, NUM_PERM)[ids]
    keys = band_keys(sigs, num_bands, rows)  # (M, bands)
    rec = np.empty(keys.size, BAND)
    rec["key"] = keys.ravel()
    rec["sig"] = np.repeat(row_hash(sigs), num_bands)
    rec["doc"] = np.repeat(ids, num_bands)
    rec = rec[np.lexsort((rec["doc"], rec["key"]))]
    name = f"bands-{num_bands}x{rows}"
    store.write_bytes(join(folder, f"{name}.bin"), rec.tobytes())
    store.write_bytes(join(folder, f"{name}.slots"), _slots(rec["key"]).astype("<i8").tobytes())
    store.write_bytes(join(folder, f"{name}.done"), b"")  # last: the bands are committed


# ---- 2. one bucket of keys ------------------------------------------------------------------
def _records(store: Store, parts: list, name: str, dtype: np.dtype, s0: int, s1: int):
    """(records, document keys) of slots [s0, s1) of every partition's `name` file."""
    recs, keys = [], []
    for source, part, folder in parts:
        # the offsets of the bucket's first and past-last slot: one ranged read of its slots
        offsets = np.frombuffer(store.read_range(join(folder, f"{name}.slots"), s0 * 8, (s1 - s0 + 1) * 8), "<i8")
        a, b = int(offsets[0]), int(offsets[-1])
        if b > a:
            raw = store.read_range(join(folder, f"{name}.bin"), a * dtype.itemsize, (b - a) * dtype.itemsize)
            r = np.frombuffer(raw, dtype)
            recs.append(r)
            keys.append(doc_keys(source, part, r["doc"].astype(np.uint64)))
    if not recs:
        return np.zeros(0, dtype), np.zeros(0, np.uint64)
    return np.concatenate(recs), np.concatenate(keys)


def _exact_groups(rec: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(member, first) of every document whose digest an earlier document has."""
    order = np.lexsort((g, rec["lo"], rec["key"]))
    key, lo, g = rec["key"][order], rec["lo"][order], g[order]
    new = np.ones(len(g), bool)
    new[1:] = (key[1:] != key[:-1]) | (lo[1:] != lo[:-1])
    head = g[new][np.cumsum(new) - 1]
    return g[~new], head[~new]


def _band_runs(rec: np.ndarray, g: np.ndarray):
    """Documents sharing a band hash: (member, first) of each document whose whole signature an
    earlier one of the run has, and the candidate pairs (a < b) among the rest."""
    order = np.lexsort((g, rec["key"]))
    key, sig, g = rec["key"][order], rec["sig"][order], g[order]
    new = np.ones(len(g), bool)
    new[1:] = key[1:] != key[:-1]
    run = np.cumsum(new) - 1
    big = (np.bincount(run) >= 2)[run] if len(run) else np.zeros(0, bool)
    members, firsts, cand_a, cand_b = [], [], [], []
    at = np.flatnonzero(big)  # the rows of runs of two or more, run after run
    sel_g, sel_sig, sel_run = g[at].tolist(), sig[at].tolist(), run[at].tolist()
    k = 0
    while k < len(sel_g):
        j = k
        while j < len(sel_g) and sel_run[j] == sel_run[k]:
            j += 1
        first: dict[int, int] = {}
        reps = []
        for gg, ss in zip(sel_g[k:j], sel_sig[k:j]):
            if ss in first:
                members.append(gg)
                firsts.append(first[ss])
            else:
                first[ss] = gg
                reps.append(gg)
        for x in range(len(reps) - 1):
            cand_a += [reps[x]] * (len(reps) - x - 1)
            cand_b += reps[x + 1 :]
        k = j
    u64 = lambda xs: np.asarray(xs, dtype=np.uint64)  # noqa: E731
    return u64(members), u64(firsts), u64(cand_a), u64(cand_b)


def _verify(store, folders, cand_a, cand_b, num_bands, rows, threshold):
    """The candidate pairs that are near duplicates: estimated Jaccard similarity (equal
    signature values of NUM_PERM) >= threshold, and a band of the two signatures equal.
    Returns (a, b, equal values)."""
    if not len(cand_a):
        return cand_a, cand_b, np.zeros(0, np.uint16)
    pairs = np.unique(np.stack([cand_a, cand_b], 1), axis=0)
    a, b = pairs[:, 0], pairs[:, 1]
    need = np.unique(pairs)
    sigs = np.empty((len(need), NUM_PERM), "<u4")
    part_of = need >> np.uint64(PART_SHIFT)  # (source, partition)
    for sp in np.unique(part_of):
        at = np.flatnonzero(part_of == sp)
        docs = (need[at] & np.uint64((1 << PART_SHIFT) - 1)).astype(np.int64)
        sigs[at] = _signature_rows(store, folders[int(sp)], docs)
    sa, sb = sigs[np.searchsorted(need, a)], sigs[np.searchsorted(need, b)]
    count = (sa == sb).sum(axis=1)
    ok = (count / NUM_PERM >= threshold) & share_a_band(sa, sb, num_bands, rows)
    return a[ok], b[ok], count[ok].astype(np.uint16)


def bucket_unit(
    store: Store,
    *,
    out: str,
    parts: list,
    bucket: int,
    num_buckets: int,
    bands: list[int] | None,
    threshold: float,
) -> dict:
    """The duplicate relations of one bucket of keys (see the module doc); cached."""
    key = join(out, f"b-{bucket:05d}.npz")
    if store.exists(key):
        return {"docs": 0, "cached": True}
    s0, s1 = bucket * SLOTS // num_buckets, (bucket + 1) * SLOTS // num_buckets
    rec, g = _records(store, parts, "exact", EXACT, s0, s1)
    exact_member, exact_head = _exact_groups(rec, g)
    empty = np.zeros(0, np.uint64)
    sig_member, sig_first, edge_a, edge_b, count = empty, empty, empty, empty, np.zeros(0, np.uint16)
    if bands:
        rec_b, g_b = _records(store, parts, f"bands-{bands[0]}x{bands[1]}", BAND, s0, s1)
        sig_member, sig_first, cand_a, cand_b = _band_runs(rec_b, g_b)
        if len(sig_member):
            sig_member, at = np.unique(sig_member, return_index=True)  # the same pair in every band
            sig_first = sig_first[at]
        folders = {(s << (SOURCE_SHIFT - PART_SHIFT)) | p: f for s, p, f in parts}
        edge_a, edge_b, count = _verify(store, folders, cand_a, cand_b, bands[0], bands[1], threshold)
    _write_npz(
        store,
        key,
        exact_member=exact_member,
        exact_head=exact_head,
        sig_member=sig_member,
        sig_first=sig_first,
        edge_a=edge_a,
        edge_b=edge_b,
        edge_count=count,
    )
    return {"docs": int(len(g)), "cached": False, "exact": int(len(exact_member)), "pairs": int(len(edge_a))}


# ---- 3. the decision ------------------------------------------------------------------------
def _relations(store: Store, buckets: str, num_buckets: int):
    exact_head, sig_first, adj = {}, {}, defaultdict(list)
    for b in range(num_buckets):
        with np.load(io.BytesIO(store.read_bytes(join(buckets, f"b-{b:05d}.npz")))) as z:
            exact_head.update(zip(z["exact_member"].tolist(), z["exact_head"].tolist()))
            sig_first.update(zip(z["sig_member"].tolist(), z["sig_first"].tolist()))
            for a, c, n in zip(z["edge_a"].tolist(), z["edge_b"].tolist(), z["edge_count"].tolist()):
                adj[a].append((c, n))
                adj[c].append((a, n))
    return exact_head, sig_first, adj


def _greedy(settings: list[dict], contaminated: dict, exact_head: dict, sig_first: dict, adj: dict):
    """(doc key, reason, kept key, equal signature values) of every removed document, in order."""
    heads, firsts = set(exact_head.values()), set(sig_first.values())
    visit = sorted(set(exact_head) | heads | set(sig_first) | firsts | set(adj) | set(contaminated))
    kept_exact: dict[int, int] = {}  # digest group -> its first kept document
    kept_sig: dict[int, int] = {}  # group of one signature -> its first kept document
    removed = []
    for d in visit:
        cfg = settings[d >> SOURCE_SHIFT]
        if d in contaminated:
            removed.append((d, "contaminated", None, None))
            continue
        eg = exact_head.get(d, d if d in heads else None)
        if cfg["dedup"] != "none" and eg is not None and eg in kept_exact:
            removed.append((d, "exact", kept_exact[eg], NUM_PERM))
            continue
        g = sig_first.get(d, d)
        if cfg["dedup"] == "near":
            best = (kept_sig[g], NUM_PERM) if g in kept_sig else None
            for h, n in adj.get(g, ()):
                k = kept_sig.get(h)
                if k is not None and (best is None or k < best[0]):
                    best = (k, n)
            if best is not None:
                removed.append((d, "near", best[0], best[1]))
                continue
        if eg is not None:
            kept_exact.setdefault(eg, d)
        kept_sig.setdefault(g, d)
    return removed


def _texts(store: Store, sources: list[dict], wanted: set[int]) -> dict[int, str]:
    """The texts of some documents (by key), each partition holding one read once."""
    by_part: dict[tuple[int, int], set[int]] = defaultdict(set)
    for key in wanted:
        s, p, d = split_key(key)
        by_part[(s, p)].add(d)
    out = {}
    for (s, p), docs in by_part.items():
        where = sources[s]["parts"][p][1]
        lines = store_lines(store, where["corpus"], where["size"], where["start"], where["end"])
        for d, (offset, line) in enumerate(lines):
            if d in docs:
                out[int(doc_keys(s, p, np.uint64(d)))] = corpus_text(line, offset)
    return out


def _contamination(store: Store, sources: list[dict], max_docs: int):
    """(removed whole: {doc key: items}, cut: {doc key: (pieces, items)}, the n-grams left out as
    common [[n-gram, documents]]) of the decontaminating sources: an n-gram an item holds counts
    where at most `max_docs` documents of them hold it (GPT-3's rule: more are common phrases or
    boilerplate); each counting match is cut out with its margin (minhash.pieces), and a document
    cut into too many pieces, or into none long enough, goes whole. Holds the matching
    documents' spans only."""
    matched: dict[int, dict] = {}
    counts: Counter = Counter()
    for s, src in enumerate(sources):
        if src["settings"]["decontaminate"]:
            for p, (folder, *_rest) in enumerate(src["parts"]):
                for d, m in store.read_json(join(folder, META))["matches"].items():
                    matched[int(doc_keys(s, p, np.uint64(int(d))))] = m
                    counts.update({sp[0] for sp in m["spans"] if sp[0] is not None})
    contaminated, cuts = {}, {}
    for key, m in matched.items():
        spans = [sp for sp in m["spans"] if sp[0] is None or counts[sp[0]] <= max_docs]
        if not spans:
            continue
        ids = list(dict.fromkeys(i for sp in spans for i in sp[1]))
        kept = pieces(m["len"], [(a, b) for _, _, a, b in spans])
        if kept is None:
            contaminated[key] = ids
        else:
            cuts[key] = (kept, ids)
    common = sorted(([g, c] for g, c in counts.items() if c > max_docs), key=lambda gc: (-gc[1], gc[0]))
    return contaminated, cuts, common


def decide_unit(
    store: Store,
    *,
    out: str,
    buckets: str,
    num_buckets: int,
    sources: list[dict],
    threshold: float,
    items: str | None,
    max_docs: int = 10,
) -> dict:
    """Today's decision over the buckets' relations (see the module doc); per source, its
    removed and cut documents and their sample, into `out`; cached."""
    summary = _json_or_none(store, join(out, "decision.json"))
    if summary is not None:
        return summary | {"cached": True}
    exact_head, sig_first, adj = _relations(store, buckets, num_buckets)
    contaminated, cuts, common = _contamination(store, sources, max_docs)
    removed = _greedy([src["settings"] for src in sources], contaminated, exact_head, sig_first, adj)
    item_text = {i: t for i, t in store.read_json(items)} if items else {}
    per_source: dict[int, list] = defaultdict(list)
    for r in removed:
        per_source[r[0] >> SOURCE_SHIFT].append(r)
    gone = {r[0] for r in removed}
    for s in range(len(sources)):
        mine = {k: v for k, v in cuts.items() if k >> SOURCE_SHIFT == s}
        _write_source(store, out, s, sources, per_source.get(s, []), contaminated, mine, gone, threshold, item_text)
    summary = {
        "docs": sum(src["num_docs"] for src in sources),
        "visited": len(removed),
        "common_ngrams": len(common),
        "common_examples": common[:SAMPLE_PAIRS],
    }
    store.write_json(join(out, "decision.json"), summary)
    return summary | {"cached": False}


def _excerpt(text: str, a: int, b: int) -> str:
    """The text around [a, b), EXCERPT_CHARS at most."""
    pad = max(0, (EXCERPT_CHARS - (b - a)) // 2)
    return text[max(0, a - pad) : b + pad][:EXCERPT_CHARS]


def _write_source(store, out, s, sources, removed, contaminated, cuts, gone, threshold, item_text) -> None:
    """Source s's removed documents (numbers in the source), counts and sample."""
    bases = [np.cumsum([0] + [p[2] for p in src["parts"]]).tolist() for src in sources]

    def number(key: int) -> tuple[int, int]:
        src, p, d = split_key(key)
        return src, bases[src][p] + d

    picked = []
    for reason in ("exact", "near", "contaminated"):
        picked += [r for r in removed if r[1] == reason][:SAMPLE_PAIRS]
    cut = sorted(k for k in cuts if k not in gone)  # cut, and not removed as a duplicate
    shown = cut[:SAMPLE_PAIRS]
    texts = _texts(store, sources, {r[0] for r in picked} | {r[2] for r in picked if r[2] is not None} | set(shown))
    samples = []
    for d, reason, kept, n in picked:
        row = {"reason": reason, "source": sources[s]["name"], "doc": number(d)[1], "text": texts[d][:EXCERPT_CHARS]}
        if kept is not None:
            j, k = number(kept)
            row.update(
                kept_source=sources[j]["name"],
                kept_doc=k,
                kept_text=texts[kept][:EXCERPT_CHARS],
                similarity=round(n / NUM_PERM, 4),
            )
        else:
            ids = contaminated[d]
            row.update(items=ids, item_text=item_text.get(ids[0], "")[:EXCERPT_CHARS])
        samples.append(row)
    for d in shown:  # what was cut out of a document kept in pieces: the text between them
        text, kept = unicodedata.normalize("NFC", texts[d]), cuts[d][0]
        gaps = [(b, c) for (_, b), (c, _) in zip([(0, 0)] + kept, kept + [(len(text), len(text))]) if c > b]
        a, b = gaps[0] if gaps else (0, 0)
        ids = cuts[d][1]
        samples.append(
            {
                "reason": "cut",
                "source": sources[s]["name"],
                "doc": number(d)[1],
                "text": _excerpt(text, a, b),
                "pieces": len(kept),
                "items": ids,
                "item_text": item_text.get(ids[0], "")[:EXCERPT_CHARS],
            }
        )
    counts = {reason: sum(r[1] == reason for r in removed) for reason in REASONS}
    counts["cut"] = len(cut)
    items: dict[str, int] = {}  # documents holding each item: removed whole or cut
    holding = [ids for d, ids in contaminated.items() if d >> SOURCE_SHIFT == s] + [v[1] for v in cuts.values()]
    for ids in holding:
        for item in ids:
            items[item] = items.get(item, 0) + 1
    docs = np.asarray(sorted(number(r[0])[1] for r in removed), dtype=np.int64)
    _write_npz(store, join(out, f"source-{s:03d}.npz"), removed=docs)
    store.write_json(
        join(out, f"source-{s:03d}.json"),
        {
            "counts": counts,
            "items": dict(sorted(items.items())),
            "samples": samples,
            "threshold": threshold,
            "cuts": {str(number(d)[1]): cuts[d][0] for d in cut},
        },
    )


# ---- 4. a decided source's kept documents -----------------------------------------------------
def publish_unit(
    store: Store,
    *,
    decision: str,
    index: int,
    result: str,
    dataset: dict,
    settings: dict,
    num_bytes_in: int,
    partition_bytes: int,
    items_checked: dict | None = None,
) -> dict:
    """Source `index`'s kept documents published as a dataset, its removed sample and numbers,
    and result.json last (the commit marker of its decision)."""
    done = _json_or_none(store, join(result, RESULT_FILE))
    if done is not None:
        return done | {"docs": 0}
    with np.load(io.BytesIO(store.read_bytes(join(decision, f"source-{index:03d}.npz")))) as z:
        removed = z["removed"]
    told = store.read_json(join(decision, f"source-{index:03d}.json"))
    cuts = {int(k): v for k, v in told.get("cuts", {}).items()}
    fingerprint, num_docs, num_bytes = _publish_kept(store, dataset, removed, result, partition_bytes, cuts)
    store.write_bytes(
        join(result, REMOVED_FILE),
        "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in told["samples"]).encode(),
    )
    _write_npz(store, join(result, REMOVED_DOCS), removed=removed)
    counts = told["counts"]
    out = {
        "settings": settings,
        "input_fingerprint": dataset["fingerprint"],
        "output_fingerprint": fingerprint,
        "num_docs_in": dataset["num_docs"],
        "num_bytes_in": num_bytes_in,
        "num_exact": counts["exact"],
        "num_near": counts["near"],
        "num_contaminated": counts["contaminated"],
        "num_cut": counts.get("cut", 0),
        "num_docs_out": num_docs,
        "num_bytes_out": num_bytes,
        "items": told["items"],
        "items_checked": items_checked or {},
    }
    store.write_json(join(result, RESULT_FILE), out)
    return out | {"docs": dataset["num_docs"]}


def _publish_kept(
    store: Store, dataset: dict, removed: np.ndarray, key: str, partition_bytes: int, cuts: dict | None = None
) -> tuple[str, int, int]:
    """(fingerprint, documents, bytes) of the kept documents, published as a dataset (the
    source's own when nothing was removed or cut), streamed part by part: nothing held per
    document. A document cut for decontamination becomes its pieces, each a document of its
    own (of its NFC text). Its parts follow the source's (a part that lost nothing is the
    source's own, stored once)."""
    cuts = cuts or {}
    if not len(removed) and not cuts:
        return dataset["fingerprint"], dataset["num_docs"], dataset["num_bytes"]
    parts = [Part(p["key"], p["size"], p["sha256"], p["num_docs"]) for p in dataset["parts"]]
    with tempfile.TemporaryDirectory(prefix="stoker-dedup-") as tmp:
        writer = PartWriter(store, tmp, max(partition_bytes, max(p.size for p in parts) + 1))
        num_docs = num_bytes = 0
        nxt, at, k = (int(removed[0]) if len(removed) else -1), 0, 0
        for part in parts:
            for offset, line in store_lines(store, part.key, part.size, 0, part.size):
                if k == nxt:
                    at += 1
                    nxt = int(removed[at]) if at < len(removed) else -1
                elif k in cuts:
                    text = unicodedata.normalize("NFC", corpus_text(line, offset))
                    for a, b in cuts[k]:
                        writer.add(json.dumps({"text": text[a:b]}, ensure_ascii=False).encode("utf-8") + b"\n")
                        num_docs += 1
                        num_bytes += len(text[a:b].encode("utf-8"))
                else:
                    writer.add(line if line.endswith(b"\n") else line + b"\n")
                    num_docs += 1
                    num_bytes += len(corpus_text(line, offset).encode("utf-8"))
                k += 1
            writer.cut()
        kept, digest = writer.close()
        fingerprint = content_fingerprint(digest)
        with build_lock(store, dataset_key(fingerprint)):
            if committed_dataset(store, fingerprint) is None:
                info = {
                    "source": f"dedup of {dataset['fingerprint']}",
                    "fingerprint": fingerprint,
                    "sha256": digest,
                    "derived_from": dataset["fingerprint"],
                    "dedup_key": key,
                    "num_docs": num_docs,
                    "num_bytes": num_bytes,
                }
                publish_dataset(store, fingerprint, kept, info)
    return fingerprint, num_docs, num_bytes
