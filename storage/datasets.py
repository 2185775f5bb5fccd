"""Raw datasets in the store: ``{root}/datasets/{fingerprint}/corpus.jsonl`` and ``info.json``,
the info (with the corpus file's size and sha256) published last."""

from __future__ import annotations

import uuid

from storage.manifest import publish_folder, read_manifest, verify_files
from storage.store import Store, join

CORPUS_FILE = "corpus.jsonl"
INFO_FILE = "info.json"


def dataset_key(fingerprint: str) -> str:
    return join("datasets", fingerprint)


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
        publish_folder(store, staging, dataset_key(fingerprint), INFO_FILE, info,
                       is_intact=lambda: committed_dataset(store, fingerprint) is not None)
    except BaseException:
        store.rm(staging)
        raise
