"""Checkpoint folders in the object store: naming, commit, validation, listing, retention.

Layout: ``{root}/runs/{run}/checkpoints/step-00001200/`` holding the DCP files of every
rank, ``train_state.json``, and ``commit.json`` written last by rank 0. A folder is
valid only when ``commit.json`` exists, parses, and every file it lists is present with
its size (and, on a deep check, its sha256). A new attempt never writes into a folder
that already exists: it takes ``step-00001200.a1``, ``.a2`` ...

Choosing is cheap, checking is full where the bytes land. ``find_latest_valid`` picks the
resume point from manifests and listings (sizes, identity) without reading tensors; the
sha256 of every file is checked once per host, under a host lock, by ``rehydrate`` (the
download of a remote checkpoint, or a read of a local one; a stamp in the host cache spares
the other ranks and later attempts). A checkpoint that fails there is marked invalid in the
store (``_invalid.json``), so every later choice skips it.

A checkpoint whose every rank receipt exists but whose commit never came (rank 0 died after
the uploads) is skipped, never committed after the fact: nothing proves that the receipts
belong to one consistent save (an earlier attempt may have written some of them). It is
reported as "no manifest" and retention deletes it once a newer checkpoint is committed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from stoker.arithmetic.schedule import continuation_problem, may_go_on_from
from stoker.config.train import EXTENSIBLE
from stoker.failures import CheckpointInvalid, CheckpointUnavailable, ConfigError
from stoker.storage.cache import checked_in_place, host_lock, verified_copy
from stoker.storage.layout import METRICS_FILE, checkpoints_key, run_file_key
from stoker.storage.manifest import Verdict, describe_files, invalid_reason, mark_invalid, read_manifest, verify_files
from stoker.storage.store import Store, join

COMMIT_FILE = "commit.json"
KEEP_MARKER = "keep"
# written before commit.json when each committed checkpoint is evaluated (eval.per_checkpoint_
# enabled); removed by that evaluation; retention spares a pinned checkpoint for a while
EVAL_PIN = ".eval-pending"
DEFAULT_PIN_SECONDS = 7200.0
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
        for name in [n for n in files if n in (COMMIT_FILE, KEEP_MARKER, EVAL_PIN) or n.startswith(RANKS_DIR + "/")]:
            files.pop(name)
    manifest = {"format": FORMAT, "committed_at": time.time(), **meta, "files": files}
    store.write_json(join(key, COMMIT_FILE), manifest)
    return manifest


def validate_checkpoint(store: Store, key: str, deep: bool = False) -> Verdict:
    """Is this checkpoint folder complete and intact? Deep also verifies every checksum."""
    manifest, reason = read_manifest(store, join(key, COMMIT_FILE))
    if manifest is None:
        return Verdict(False, reason)
    why = invalid_reason(store, key)
    if why is not None:
        return Verdict(False, f"marked invalid by a host that read it: {why}", manifest)
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


NUMERICS_FINITE = "finite"  # a manifest's `numerics` when the ranks checked the saved state


def first_nonfinite_step(store: Store, run_name: str) -> int | None:
    """The first step whose training loss the run's metrics.jsonl shows as NaN/inf (a Train
    loss, or a NonFinite failure), in the lineage still going: a later resume from an earlier
    step starts afresh. None when there is none (or no readable metrics)."""
    key = run_file_key(run_name, METRICS_FILE)
    try:
        text = store.read_bytes(key).decode() if store.exists(key) else ""
    except Exception:  # metrics are evidence only; the resume path checks the weights anyway
        return None
    bad = None
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        kind, step = record.get("event"), record.get("step")
        if not isinstance(step, int):
            continue
        if kind == "resumed" and bad is not None and step < bad:
            bad = None
        nonfinite_loss = kind == "train" and not _finite(record.get("loss"))
        failed = kind == "nonfinite" and record.get("action") == "failed"
        if nonfinite_loss or failed:
            first = record.get("first_step", step) if failed else step
            bad = first if bad is None else min(bad, first)
    return bad


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and value == value and abs(value) != float("inf")


def numerics_problem(manifest: dict, step: int, nonfinite_since: int | None) -> str:
    """Why a committed checkpoint may hold NaN/inf weights, or ''. A manifest of this version
    says `numerics: finite` (checked before the save); an older one without the field is
    refused when the run's metrics show a non-finite loss at or before its step (older stoker
    trained on and saved NaN weights), else left to the resume path's check of the loaded
    weights (storage cannot read tensors)."""
    if "numerics" in manifest:
        got = manifest["numerics"]
        return "" if got == NUMERICS_FINITE else f"its manifest says numerics={got!r}"
    if nonfinite_since is not None and nonfinite_since <= step:
        return (
            f"written after a non-finite training loss at step {nonfinite_since} (metrics.jsonl) "
            "by a stoker that did not check numerics: its weights are taken as NaN"
        )
    return ""


def find_latest_valid(
    store: Store, run_name: str, expected: dict[str, str] | None = None, train: Any = None
) -> ResumeChoice:
    """Walk checkpoints newest first; the first whose manifest parses, whose files are all
    listed with their sizes, that no host marked invalid, that is not known to hold NaN/inf
    (numerics_problem), and (given `expected`) whose manifest carries those identity fields,
    wins. No tensor byte is read: the full check is rehydrate's, where the bytes are used."""
    skipped = []
    nonfinite_since: list = []  # read once, when an older manifest needs it
    for ref in list_checkpoints(store, run_name):
        verdict = validate_checkpoint(store, ref.key, deep=False)
        mismatch = identity_problem(verdict.manifest, expected) if verdict and expected else ""
        if verdict and not mismatch and "numerics" not in verdict.manifest and not nonfinite_since:
            nonfinite_since.append(first_nonfinite_step(store, run_name))
        if verdict and not mismatch:
            mismatch = numerics_problem(verdict.manifest, ref.step, nonfinite_since[0] if nonfinite_since else None)
        if verdict and not mismatch and train is not None:  # a run trained longer: never from inside a decay
            mismatch = continuation_problem(verdict.manifest.get("schedule"), ref.step, train)
        if mismatch:
            skipped.append((ref, mismatch))
            continue
        if verdict:
            return ResumeChoice(ref, verdict.manifest, skipped)
        skipped.append((ref, verdict.reason))
    return ResumeChoice(None, {}, skipped)


def pin_for_evaluation(store: Store, key: str) -> None:
    """Mark a checkpoint's evaluation pending, so retention does not delete it first."""
    store.write_json(join(key, EVAL_PIN), {"at": time.time()})


def is_pinned(store: Store, key: str, pin_seconds: float = DEFAULT_PIN_SECONDS) -> bool:
    """Whether an evaluation of this checkpoint is pending, pinned less than pin_seconds ago
    (an older pin, of an evaluation that died, no longer keeps it)."""
    try:
        at = store.read_json(join(key, EVAL_PIN)).get("at")
    except FileNotFoundError:
        return False
    except Exception:  # a damaged pin is still a pin, as old as its file claims nothing
        return True
    return isinstance(at, (int, float)) and time.time() - at < pin_seconds


def finish_evaluation(
    store: Store,
    run_name: str,
    key: str,
    keep_latest_k: int,
    pin_seconds: float = DEFAULT_PIN_SECONDS,
    train: Any = None,
) -> list[str]:
    """After the evaluation of a checkpoint (done, or failed for good): remove its pin and,
    when it had one, apply the retention it held off (`train`: prune_checkpoints'). Returns
    the deleted keys."""
    if not store.exists(join(key, EVAL_PIN), refresh=True):
        return []
    store.rm(join(key, EVAL_PIN))
    return prune_checkpoints(store, run_name, keep_latest_k, pin_seconds, train=train)


def prune_checkpoints(
    store: Store,
    run_name: str,
    keep_latest_k: int,
    pin_seconds: float = DEFAULT_PIN_SECONDS,
    train: Any = None,
) -> list[str]:
    """Delete committed checkpoints beyond the newest K, and every uncommitted or invalid
    folder older than the newest committed one (abandoned: receipts without a commit, a
    crashed attempt's partial files, an empty folder), sparing folders marked to keep and
    those whose evaluation is pending (pinned less than pin_seconds ago; they go at a later
    pruning, once their evaluation removed the pin), and, given `train` (the train section in
    force) of a 'wsd' or 'constant' schedule, its newest stable checkpoint: the newest committed
    one before its decay that it may go on from (schedule.may_go_on_from), where the run trained
    longer goes on from, whatever K newer ones a decay left. Uploads commit in order, so nothing
    older than a committed checkpoint is still in flight. Returns the deleted keys."""
    assert keep_latest_k >= 2, "keep at least two: the newest may still be uploading"
    refs = list_checkpoints(store, run_name)
    verdicts = {r.key: validate_checkpoint(store, r.key) for r in refs}
    committed = [r for r in refs if verdicts[r.key]]
    if not committed:
        return []
    keep = {r.key for r in committed[:keep_latest_k]}
    if train is not None and getattr(train, "lr_schedule", None) in EXTENSIBLE:
        stable = next(
            (r for r in committed if may_go_on_from(verdicts[r.key].manifest.get("schedule"), r.step, train)), None
        )
        if stable is not None:  # where a run trained longer goes on from
            keep.add(stable.key)
    newest = (committed[0].step, committed[0].attempt)
    oldest_kept = committed[min(keep_latest_k, len(committed)) - 1]
    deleted = []
    for ref in refs:
        if ref.key in keep or store.exists(join(ref.key, KEEP_MARKER)):
            continue
        position = (ref.step, ref.attempt)
        abandoned = ref not in committed and position < newest
        if abandoned or position < (oldest_kept.step, oldest_kept.attempt):
            if ref in committed and is_pinned(store, ref.key, pin_seconds):
                continue
            store.rm(ref.key)
            deleted.append(ref.key)
    return deleted


def rank_receipt_key(key: str, rank: int) -> str:
    return join(key, RANKS_DIR, f"rank-{rank:05d}.json")


def local_checkpoint_dir(cache_dir: str, store: Store, key: str) -> str:
    """Where a remote checkpoint is rehydrated on this host (keyed by store root and key)."""
    tag = hashlib.sha256(store.root.encode()).hexdigest()[:12]
    return os.path.join(cache_dir, "checkpoints", tag, key)


def _stamp_path(cache_dir: str, store: Store, key: str) -> str:
    return local_checkpoint_dir(cache_dir, store, key) + ".verified.json"


def rehydrate(store: Store, key: str, cache_dir: str, expected: dict[str, str] | None = None) -> str:
    """A fully checked local copy of a committed checkpoint; returns its folder.

    Under a host-wide lock (storage.cache.host_lock), so one rank per host reads the bytes
    while the others wait and reuse the result. Remote stores: every file is downloaded into a
    temporary folder and hashed against the manifest's size and sha256 as it lands, then renamed
    into place with commit.json last; a cached copy is used only while its commit.json equals
    the store's and its stamp holds (storage.cache.verified_copy), and a damaged cached copy is
    dropped and downloaded again. Local stores are read in place: hashed once per host and
    commit, then trusted while the stamp in cache_dir holds. A checkpoint whose bytes in the
    store fail is marked invalid in the store and CheckpointInvalid (transient: a retry takes
    the next one) is raised; nothing of it is kept. A checkpoint that is not there, not
    committed or already marked invalid raises CheckpointUnavailable (permanent). Given
    `expected` identity fields, a checkpoint of another run or model raises ConfigError before
    any byte is read."""
    final = local_checkpoint_dir(cache_dir, store, key)
    with host_lock(final):  # one rank per host reads; the rest wait
        verdict = validate_checkpoint(store, key, deep=False)
        if not verdict:
            raise CheckpointUnavailable(unavailable_message(store, key, verdict.reason))
        manifest = verdict.manifest
        mismatch = identity_problem(manifest, expected) if expected else ""
        if mismatch:
            raise ConfigError(
                [
                    f"resume checkpoint {store.url(key)} {mismatch}; resume from a "
                    "checkpoint of this run and model, or start a new run"
                ]
            )
        damaged = functools.partial(_invalid, store, key)
        if store.is_local:
            checked_in_place(store.local_path(key), manifest, _stamp_path(cache_dir, store, key), damaged)
            return store.local_path(key)

        def fetch(name: str, path: str) -> None:
            try:
                store.get_file(join(key, name), path)
            except FileNotFoundError:
                damaged(f"listed file {name} is missing")

        return verified_copy(final, manifest, COMMIT_FILE, f"checkpoint {store.url(key)}", fetch, damaged)


def unavailable_message(store: Store, key: str, reason: str) -> str:
    """One line on a checkpoint that cannot be read, telling a deleted one from the rest."""
    url = store.url(key)
    if not store.walk_files(key):
        return (
            f"checkpoint {url} does not exist (deleted, e.g. by retention "
            "(checkpoint.keep_latest_k), or never written); name one that `stoker "
            "checkpoints RUN` lists"
        )
    return f"checkpoint {url} is not valid: {reason}"


def _invalid(store: Store, key: str, problem: str):
    mark_invalid(store, key, problem)
    raise CheckpointInvalid(
        f"checkpoint {store.url(key)} is not valid: {problem}; it is marked "
        "invalid, so the next attempt resumes from an older one"
    )
