"""Raw datasets in the store: ``{root}/datasets/{fingerprint}/corpus.jsonl`` and ``info.json``,
the info (with the corpus file's size and sha256) published last.

The fingerprint is the content's: the sha256 of the normalized corpus (one ``{"text": ...}``
line per document), so the same documents from another file format or place are stored, and
tokenized, once. A source is known by its own fingerprint (content hashes, ETags, revisions;
taken before any document is read), and ``datasets/by-source/{source fingerprint}.json`` says
which content it gave, so a known source is a cache hit without a download."""

from __future__ import annotations

import uuid

from stoker.storage.manifest import publish_folder, read_manifest, verify_files
from stoker.storage.store import Store, join

CORPUS_FILE = "corpus.jsonl"
INFO_FILE = "info.json"


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


def committed_dataset(store: Store, fingerprint: str) -> dict | None:
    """info.json of a dataset folder whose corpus is present with the listed size."""
    key = dataset_key(fingerprint)
    info, _ = read_manifest(store, join(key, INFO_FILE))
    if info is None or verify_files(store, key, info["files"], deep=False):
        return None
    return info


def publish_dataset(store: Store, fingerprint: str, corpus_path: str, info: dict) -> None:
    """Upload a local corpus file and publish it with its info, info last. Nothing of a
    failed publication is left behind."""
    staging = join("datasets", f".tmp-{fingerprint}-{uuid.uuid4().hex[:8]}")
    try:
        store.put_file(corpus_path, join(staging, CORPUS_FILE))
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
