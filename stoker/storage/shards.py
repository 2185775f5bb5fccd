"""Shard sets: tokenized data under ``{root}/shards/{cache-key}/``, manifest last.

The cache key hashes the raw data's content fingerprint, the tokenizer file's hash,
every parameter that changes the output, and a format version, never paths or worker
counts. A shard set counts only when ``manifest.json`` exists and its files match it.

Choosing is cheap, checking is full where the bytes land (as for checkpoints). The data stage
takes a cached set on its manifest, the listed files' sizes and the absence of an invalid
marker, reading no shard byte; ``materialize`` hashes every file on each host that uses it. A
set whose bytes in the store fail there is marked invalid (``_invalid.json``) and refused with
the file and the fix; the next data stage sees the marker and rebuilds it, which removes the
marker. ``stoker verify`` reads every byte.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid

from stoker.failures import DataError, ShardsDamaged
from stoker.storage.cache import checked_in_place, host_lock, verified_copy
from stoker.storage.manifest import (
    INVALID_MARKER,
    Verdict,
    invalid_reason,
    mark_invalid,
    publish_folder,
    read_manifest,
    verify_files,
)
from stoker.storage.store import Store, join

# 2: per-file token/doc counts, byte sizes and checksums for .bin, .idx and tokenizer.json;
#    eot_id and the resolved dtype in the key's parameters
# 3: the val split by tokens: documents cut in pieces of PIECE_TOKENS, each piece split alone
# 4: unencodable_bytes: the count of the text's bytes the tokenizer's vocabulary cannot spell
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"


def shard_cache_key(dataset_fingerprint: str, tokenizer_sha256: str, params: dict) -> str:
    """Same inputs, same key: the content of everything that shapes the shards."""
    payload = {
        "format_version": FORMAT_VERSION,
        "source": dataset_fingerprint,  # the content fingerprint (storage.datasets)
        "tokenizer": tokenizer_sha256,
        "params": params,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def shard_set_key(cache_key: str) -> str:
    return join("shards", cache_key)


def shard_set_name(key: str) -> str:
    """The cache key of a shard set's key (shards/{cache key})."""
    return key.rstrip("/").rsplit("/", 1)[-1]


def validate_shard_set(store: Store, cache_key: str, deep: bool = False) -> Verdict:
    """A shard set is valid when its manifest exists, no host marked it invalid, and every
    listed file is there at its size; deep also hashes every file (reads every byte)."""
    folder = shard_set_key(cache_key)
    manifest, reason = read_manifest(store, join(folder, MANIFEST))
    if manifest is None:
        return Verdict(False, reason)
    why = invalid_reason(store, folder)
    if why is not None:
        return Verdict(False, f"marked invalid by a host that read it: {why}", manifest)
    if manifest.get("cache_key") != cache_key or manifest.get("format_version") != FORMAT_VERSION:
        return Verdict(False, "manifest belongs to another key or format version", manifest)
    problem = verify_files(store, folder, manifest["files"], deep)
    return Verdict(not problem, problem, manifest)


def staging_key(cache_key: str) -> str:
    """A private folder to build a shard set in before it is published."""
    return join("shards", f".tmp-{cache_key}-{uuid.uuid4().hex[:8]}")


def clear_stale_staging(store: Store, cache_key: str) -> None:
    """Remove staging folders of this key left by dead builds. Only safe while holding the
    key's build lock (storage.store.build_lock), i.e. on local stores."""
    assert store.is_local, "object stores have no build lock: a staging folder may be live"
    for name in store.listdir("shards"):
        if name.startswith(f".tmp-{cache_key}-") or name.startswith(f".trash-{cache_key}-"):
            store.rm(join("shards", name))


def publish_shard_set(store: Store, staging: str, cache_key: str, manifest: dict) -> bool:
    """Publish a built shard set, manifest last (see manifest.publish_folder). Returns False
    when another writer published an intact copy of the same key first. An invalid marker
    left by a host that found the old bytes damaged is removed once the new ones are in."""
    folder = shard_set_key(cache_key)
    published = publish_folder(
        store,
        staging,
        folder,
        MANIFEST,
        manifest,
        is_intact=lambda: bool(validate_shard_set(store, cache_key, deep=True)),
    )
    if published and not store.is_local:  # a local publish renamed the marked folder aside
        store.rm(join(folder, INVALID_MARKER))
    return published


def materialize(store: Store, cache_key: str, cache_dir: str) -> str:
    """A local folder holding the shard set, fully checked on this host (storage.cache).

    Under a host-wide lock (one rank reads, the others wait and reuse): a remote set is
    downloaded into cache_dir, every file hashed against the manifest's size and sha256 as it
    lands, and renamed into place with the manifest last; a cached copy is used only while its
    manifest equals the store's and its stamp (each file's size, mtime, inode, ctime at its
    last full check) holds; a cached copy found damaged is dropped and downloaded again. A
    local set is read in place, hashed once per host and manifest, then trusted while its
    stamp holds. A damaged set in the store is marked invalid there (so the next data stage
    rebuilds it) and raises DataError naming the file and the fix; nothing of it is kept. A set
    already marked invalid raises DataError before any shard byte is read."""
    folder = shard_set_key(cache_key)
    local = os.path.join(cache_dir, "shards", cache_key)
    with host_lock(local):
        manifest, reason = read_manifest(store, join(folder, MANIFEST))
        if manifest is None:
            raise DataError(
                f"shard set {store.url(folder)} is not usable: {reason}; run the data stage again to rebuild it"
            )
        why = invalid_reason(store, folder)
        if why is not None:
            raise ShardsDamaged(
                f"shard set {store.url(folder)} is marked invalid by a host that read "
                f"it ({why}); run the data stage again to rebuild it"
            )
        damaged = functools.partial(_damaged, store, folder)
        if store.is_local:
            checked_in_place(store.local_path(folder), manifest, local + ".verified.json", damaged)
            return store.local_path(folder)
        return verified_copy(
            local,
            manifest,
            MANIFEST,
            f"shard set {store.url(folder)}",
            fetch=lambda name, path: store.get_file(join(folder, name), path),
            damaged=damaged,
        )


def _damaged(store: Store, folder: str, problem: str):
    mark_invalid(store, folder, problem)
    raise ShardsDamaged(
        f"shard set {store.url(folder)} is damaged: {problem}; it is marked invalid "
        f"({INVALID_MARKER}), so running the data stage again rebuilds it"
    )
