"""Checkpoint folders in the object store: naming, commit, validation, listing, retention.

Layout: ``{root}/runs/{run}/checkpoints/step-00001200/`` holding the DCP files of every
rank, ``train_state.json``, and ``commit.json`` written last by rank 0. A folder is
valid only when ``commit.json`` exists, parses, and every file it lists is present with
its size (and, on a deep check, its sha256). A new attempt never writes into a folder
that already exists: it takes ``step-00001200.a1``, ``.a2`` ...
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass

from storage.layout import checkpoints_key
from storage.manifest import Verdict, describe_files, read_manifest, verify_files
from storage.store import Store, join, sha256_file

COMMIT_FILE = "commit.json"
KEEP_MARKER = "keep"
RANKS_DIR = "_ranks"  # per-rank upload receipts: {rank}.json with that rank's files
FORMAT = "stoker-checkpoint/1"
_NAME = re.compile(r"^step-(\d{8})(?:\.a(\d+))?$")


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint folder of a run."""

    step: int
    attempt: int
    key: str  # relative to the store root
    url: str

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rsplit("/", 1)[-1]


def checkpoint_name(step: int, attempt: int = 0) -> str:
    return f"step-{step:08d}" + (f".a{attempt}" if attempt else "")


def list_checkpoints(store: Store, run_name: str) -> list[CheckpointRef]:
    """Every checkpoint folder of a run, newest first (by step, then attempt)."""
    base = checkpoints_key(run_name)
    refs = []
    for name in store.listdir(base):
        m = _NAME.match(name)
        if m:
            key = join(base, name)
            refs.append(CheckpointRef(int(m.group(1)), int(m.group(2) or 0), key, store.url(key)))
    return sorted(refs, key=lambda r: (r.step, r.attempt), reverse=True)


def new_checkpoint_key(store: Store, run_name: str, step: int, taken: set[str] | None = None) -> str:
    """A folder for a new checkpoint at `step` that no earlier attempt has written into.

    `taken` (names already used, kept by the caller) avoids listing the store again."""
    base = checkpoints_key(run_name)
    taken = set(store.listdir(base)) if taken is None else taken
    attempt = 0
    while checkpoint_name(step, attempt) in taken:
        attempt += 1
    return join(base, checkpoint_name(step, attempt))


def commit_checkpoint(store: Store, key: str, meta: dict, files: dict[str, dict] | None = None) -> dict:
    """Write the commit manifest last: every file with size and sha256, plus meta.

    `files` comes from the ranks (checksummed locally before upload, so committing never
    reads the data back); without it, the folder is listed and hashed in the store."""
    if files is None:
        files = describe_files(store, key)
        for name in [n for n in files if n in (COMMIT_FILE, KEEP_MARKER) or n.startswith(RANKS_DIR + "/")]:
            files.pop(name)
    manifest = {"format": FORMAT, "committed_at": time.time(), **meta, "files": files}
    store.write_json(join(key, COMMIT_FILE), manifest)
    return manifest


def validate_checkpoint(store: Store, key: str, deep: bool = False) -> Verdict:
    """Is this checkpoint folder complete and intact? Deep also verifies every checksum."""
    manifest, reason = read_manifest(store, join(key, COMMIT_FILE))
    if manifest is None:
        return Verdict(False, reason)
    if manifest.get("format") != FORMAT:
        return Verdict(False, f"unknown checkpoint format {manifest.get('format')!r}", manifest)
    if ".metadata" not in manifest["files"]:
        return Verdict(False, "manifest lists no DCP .metadata file", manifest)
    problem = verify_files(store, key, manifest["files"], deep)
    if problem:
        return Verdict(False, problem, manifest)
    return Verdict(True, "", manifest)


@dataclass
class ResumeChoice:
    """The newest valid checkpoint (or None) and every newer one skipped, with the reason."""

    checkpoint: CheckpointRef | None
    manifest: dict
    skipped: list[tuple[CheckpointRef, str]]


def identity_problem(manifest: dict, expected: dict[str, str]) -> str:
    """'' when the manifest's identity fields (run_name, model_hash ...) equal `expected`,
    else the first mismatch: a checkpoint of another run or model is never a candidate."""
    for field_name, want in sorted(expected.items()):
        got = manifest.get(field_name)
        if got != want:
            return f"belongs to another {field_name.replace('_', ' ')} ({got!r}, this run has {want!r})"
    return ""


def find_latest_valid(store: Store, run_name: str, cache_dir: str | None = None,
                      expected: dict[str, str] | None = None) -> ResumeChoice:
    """Walk checkpoints newest first; the first that passes a deep check (and, given
    `expected`, whose manifest carries those identity fields) wins.

    With a remote store and a cache_dir, the deep check of the candidate is its download
    into the local cache (rehydrate), so the bytes are read once, not twice."""
    skipped = []
    for ref in list_checkpoints(store, run_name):
        verdict = validate_checkpoint(store, ref.key, deep=False)
        mismatch = identity_problem(verdict.manifest, expected) if verdict and expected else ""
        if mismatch:  # checked before any byte of it is read or downloaded
            skipped.append((ref, mismatch))
            continue
        if verdict and (store.is_local or cache_dir is None):
            verdict = validate_checkpoint(store, ref.key, deep=True)
        if verdict and cache_dir is not None and not store.is_local:
            try:
                rehydrate(store, ref.key, cache_dir)
            except ValueError as err:
                verdict = Verdict(False, str(err).split(": ", 1)[-1], verdict.manifest)
        if verdict:
            return ResumeChoice(ref, verdict.manifest, skipped)
        skipped.append((ref, verdict.reason))
    return ResumeChoice(None, {}, skipped)


def prune_checkpoints(store: Store, run_name: str, keep_latest_k: int) -> list[str]:
    """Delete committed checkpoints beyond the newest K (and any uncommitted folder older
    than the newest committed one), sparing folders marked to keep. Returns deleted keys."""
    assert keep_latest_k >= 2, "keep at least two: the newest may still be uploading"
    refs = list_checkpoints(store, run_name)
    committed = [r for r in refs if store.exists(join(r.key, COMMIT_FILE))]
    if len(committed) <= keep_latest_k:
        return []
    keep = {r.key for r in committed[:keep_latest_k]}
    oldest_kept = committed[keep_latest_k - 1]
    deleted = []
    for ref in refs:
        if ref.key in keep or store.exists(join(ref.key, KEEP_MARKER)):
            continue
        if (ref.step, ref.attempt) < (oldest_kept.step, oldest_kept.attempt):
            store.rm(ref.key)
            deleted.append(ref.key)
    return deleted


def rank_receipt_key(key: str, rank: int) -> str:
    return join(key, RANKS_DIR, f"rank-{rank:05d}.json")


def local_checkpoint_dir(cache_dir: str, store: Store, key: str) -> str:
    """Where a remote checkpoint is rehydrated on this host (keyed by store root and key)."""
    tag = hashlib.sha256(store.root.encode()).hexdigest()[:12]
    return os.path.join(cache_dir, "checkpoints", tag, key)


def rehydrate(store: Store, key: str, cache_dir: str) -> str:
    """A verified local copy of a committed checkpoint; returns its folder.

    Local stores are read in place (after a deep check). Remote ones are downloaded file by
    file into a temporary folder, every file checked against the manifest's size and sha256
    as it lands, then renamed into place with commit.json last; a host-wide lock makes one
    rank download while the others wait and reuse it. Raises ValueError when the checkpoint
    is invalid (nothing of it is kept)."""
    if store.is_local:
        verdict = validate_checkpoint(store, key, deep=True)
        if not verdict:
            raise ValueError(f"checkpoint {store.url(key)} is not valid: {verdict.reason}")
        return store.local_path(key)
    final = local_checkpoint_dir(cache_dir, store, key)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with open(final + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank per host downloads; the rest wait
        manifest, reason = read_manifest(store, join(key, COMMIT_FILE))
        if manifest is None:
            raise ValueError(f"checkpoint {store.url(key)} is not valid: {reason}")
        cached = os.path.join(final, COMMIT_FILE)
        if os.path.exists(cached):
            with open(cached) as f:
                if json.load(f) == manifest:  # the same commit as the store's, not an older one
                    return final
            shutil.rmtree(final, ignore_errors=True)  # stale: the store's checkpoint changed
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            for name, entry in sorted(manifest["files"].items()):
                path = os.path.join(tmp, name)
                try:
                    store.get_file(join(key, name), path)
                except FileNotFoundError:
                    raise ValueError(f"checkpoint {store.url(key)} is not valid: listed file "
                                     f"{name} is missing") from None
                if os.path.getsize(path) != entry["size"] or sha256_file(path) != entry["sha256"]:
                    raise ValueError(f"checkpoint {store.url(key)} is not valid: {name} does not "
                                     "match its manifest entry")
            with open(os.path.join(tmp, COMMIT_FILE), "w") as f:
                json.dump(manifest, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
