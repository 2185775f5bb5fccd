"""Tokenized partitions, cached by content: what the tokenize stage made of one partition of a
stored dataset (a byte range of one content-addressed part), under a key of everything that
decides those bytes (the part's sha256 and range, the tokenizer's sha256, the end-of-document id,
the token dtype, val_fraction and this format's version). A grown source, or another run over
the same parts with the same tokenizer, takes every partition it has seen before from here and
tokenizes only its new ones; the shard files are then assembled from the pieces in order, the
same bytes as ever.

Layout: ``tokenized/{key[:2]}/{key}/`` holds ``{split}.bin`` and ``{split}.idx`` (a partition's
tokens and cumulative document ends, as ``sharding.tokenize_docs`` writes them) and
``counts.json`` (its counts, and every file's size), written last: an entry without it, or with a
file of another size, is no entry (it is made again).
"""

from __future__ import annotations

import hashlib
import json

from stoker.storage.store import Store, join

TOKENIZED_DIR = "tokenized"
TOKENIZED_VERSION = 1
COUNTS_FILE = "counts.json"


def piece_cache_key(
    part_sha256: str, start: int, end: int, tokenizer_sha256: str, eot_id: int, dtype: str, val_fraction: float
) -> str:
    """The folder key of one tokenized partition."""
    spec = {
        "version": TOKENIZED_VERSION,
        "part": part_sha256,
        "range": [start, end],
        "tokenizer": tokenizer_sha256,
        "eot_id": eot_id,
        "dtype": dtype,
        "val_fraction": val_fraction,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    return join(TOKENIZED_DIR, digest[:2], digest)


def piece_file(key: str, split: str, ext: str) -> str:
    return join(key, f"{split}.{ext}")


def cached_counts(store: Store, key: str) -> dict | None:
    """The counts of a complete cached partition (every file present at its recorded size);
    None where there is none."""
    try:
        record = json.loads(store.read_bytes(join(key, COUNTS_FILE)))
    except (FileNotFoundError, ValueError):
        return None
    try:
        if any(store.size(join(key, name)) != size for name, size in record["sizes"].items()):
            return None
    except (FileNotFoundError, KeyError):
        return None
    return record["counts"]


def commit_counts(store: Store, key: str, counts: dict, sizes: dict[str, int]) -> None:
    """Written after the partition's files: the entry's commit."""
    store.write_bytes(join(key, COUNTS_FILE), json.dumps({"counts": counts, "sizes": sizes}).encode())
