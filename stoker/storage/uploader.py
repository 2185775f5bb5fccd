"""The checkpoint commit protocol, rank side: write, upload, receipt, commit, retention. No torch.

Two background stages per rank, one thread each, each in submission order:

- **write**: agree with the other ranks (``agree``, a collective on the caller's gloo group:
  same order on every rank) on the folder (rank 0 picks one no earlier attempt used), on the
  waiting checkpoints to drop (rank 0 decides) and on whether the store failed permanently
  (any rank may say so); then the caller's ``write(key, folder)`` puts this rank's files into
  ``staging_folder(key)`` (the store folder itself on a local store, a host staging folder
  otherwise). Local disk only, so fast.
- **upload**: written checkpoints, oldest first: checksum each file, upload it with retries
  (transient errors only, for ``upload_timeout`` seconds), write the rank's receipt
  (``_ranks/rank-N.json``). Rank 0 then waits for every rank's receipt, writes ``commit.json``
  last and applies retention.

The caller waits only for the previous write (its host buffers are reused), never for an
upload, so a store outage delays commits, never steps. Written checkpoints wait for the store
in a bounded backlog: when a new one is written while ``max_pending_uploads`` wait, rank 0
drops the oldest waiting ones and names them in the same agreement, so every rank drops the
same checkpoints (staging deleted, a ``CheckpointDropped`` record). A rank drops one only while
its receipt is unwritten, and rank 0 never commits one it dropped, so a dropped checkpoint is
never committed. A permanent storage error (missing bucket, access denied, another 4xx) is not
retried: the rank reports it once, and every later checkpoint fails at once with the same
reason, before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from stoker.contracts.events import (
    CheckpointCommitted,
    CheckpointDropped,
    CheckpointFailed,
    CheckpointStaged,
    Event,
    UploadRetry,
)
from stoker.failures import RetriesExhausted, StokerError, error_code, http_status, retry
from stoker.storage.cache import drop_stamp, host_lock, write_stamp
from stoker.storage.checkpoints import (
    COMMIT_FILE,
    DEFAULT_PIN_SECONDS,
    commit_checkpoint,
    list_checkpoints,
    local_checkpoint_dir,
    new_checkpoint_key,
    pin_for_evaluation,
    prune_checkpoints,
    rank_receipt_key,
)
from stoker.storage.store import Store, join, sha256_file

RECEIPT_POLL_SECONDS = 0.2
# S3 error codes that say the store itself is gone or refused (a missing key is not one)
_STORE_GONE = {
    "NoSuchBucket",
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
}


def _pin_upload_thread() -> None:
    """STOKER_UPLOAD_CPUS="1" or "2,3": keep this upload thread off the training cores."""
    cpus = os.environ.get("STOKER_UPLOAD_CPUS")
    if cpus and hasattr(os, "sched_setaffinity") and threading.current_thread() is not threading.main_thread():
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


class _Stop(StokerError):
    """This checkpoint must not go on; permanent, so retry() gives up at once."""


class _Dropped(_Stop):
    """Rank 0 dropped the checkpoint from the backlog."""


class _Broken(_Stop):
    """The store failed permanently (this rank's error, or another rank's, told by agreement)."""


def _storage_reason(what: str, err: BaseException) -> str:
    """'upload of X: NoSuchBucket: The specified bucket does not exist (HTTP 404)'."""
    code, status = error_code(err), http_status(err)
    text = f"{what}: {code or type(err).__name__}: {err}"
    return text + (f" (HTTP {status})" if status else "")


@dataclass
class _Written:
    """A checkpoint in this rank's staging, waiting for (or in) the upload stage."""

    step: int
    meta: dict
    key: str
    folder: str
    names: list[str]
    staged_seconds: float
    dropped: str = ""  # the reason, once rank 0 dropped it
    settled: bool = False  # its receipt (rank 0: its commit) is under way; no longer droppable
    shared_with_rank0: bool = False  # rank 0 wrote into this same staging folder (same host)


class CheckpointUploader:
    """One per rank; see the module docstring."""

    def __init__(
        self,
        store: Store,
        run_name: str,
        *,
        rank: int,
        world_size: int,
        staging_root: str,
        keep_latest_k: int,
        upload_timeout: float,
        commit_timeout: float,
        async_enabled: bool,
        max_pending_uploads: int = 2,
        on_event: Callable[[Event], None] | None = None,
        after_commit: Callable[[], None] | None = None,
        agree: Callable[[dict], list[dict]] | None = None,
        cache_dir: str | None = None,
        pin_evaluations: bool = False,
        pin_seconds: float = DEFAULT_PIN_SECONDS,
        train: Any = None,
    ):
        """train: the train section in force; of a 'wsd' or 'constant' schedule, retention also
        keeps its newest stable checkpoint (the newest before its decay that it may go on from,
        where a run trained longer goes on from: prune_checkpoints)."""
        assert max_pending_uploads >= 1
        self.train = train
        self.store, self.run_name, self.rank, self.world_size = store, run_name, rank, world_size
        self.staging_root, self.keep_latest_k = staging_root, keep_latest_k
        self.upload_timeout, self.commit_timeout = upload_timeout, commit_timeout
        self.async_enabled, self.max_pending_uploads = async_enabled, max_pending_uploads
        self.on_event = on_event or (lambda event: None)
        self.after_commit = after_commit or (lambda: None)
        # every rank's proposal, in rank order; a single rank agrees with itself
        self.agree = agree or (lambda mine: [mine])
        # each committed checkpoint gets an evaluation (eval.per_checkpoint_enabled): rank 0 pins
        # it before the commit, so retention cannot delete it before its evaluation reads it
        self.pin_evaluations, self.pin_seconds = pin_evaluations, pin_seconds
        self.failures: list[str] = []
        self.broken = ""  # a permanent storage error: no later checkpoint is attempted
        self.last_finish_seconds = 0.0  # upload (+ commit on rank 0) of the last checkpoint
        # folder names already used, read once; later names are derived without listing
        self.taken = {r.name for r in list_checkpoints(store, run_name)} if rank == 0 else set()
        self.cond = threading.Condition()
        self.to_write: deque[tuple] = deque()  # submitted, not yet written
        self.to_upload: deque[_Written] = deque()  # written, waiting for the upload stage
        self.uploading: _Written | None = None
        self.num_unwritten = 0
        self.num_unfinished = 0  # submitted and not yet committed (rank 0) / receipted, failed or dropped
        self.threads: list[threading.Thread] = []
        # host copies (remote stores): this host's staged files of a committed checkpoint become
        # its verified cache copy (what rehydrate would have downloaded), so a restart on this
        # host loads without a download; see _adopt
        self.cache_dir = cache_dir
        self.kept: list[_Written] = []  # receipted checkpoints whose files this rank still holds
        self.adopted: str | None = None  # the one host copy rank 0 keeps

    def new_key(self, step: int) -> str:
        """A folder for this step's checkpoint that no earlier attempt wrote into (rank 0)."""
        key = new_checkpoint_key(self.store, self.run_name, step, taken=self.taken)
        self.taken.add(key.rsplit("/", 1)[-1])
        return key

    def staging_folder(self, key: str) -> str:
        """Where this rank writes the checkpoint's files before submit()."""
        if self.store.is_local:  # written in place: the commit manifest is what makes it count
            return self.store.local_path(key)
        return os.path.join(self.staging_root, key)

    def submit(self, step: int, meta: dict, write: Callable[[str, str], list[str]]) -> None:
        """Save this step's checkpoint: ``write(key, folder)`` puts this rank's files into
        folder and returns their names; then upload and, on rank 0, commit. In the
        background when async_enabled (this returns at once), else before returning."""
        if not self.async_enabled:
            written = self._write(step, meta, write)
            if written is not None:
                with self.cond:
                    self.uploading = written
                try:
                    self._upload(written)
                finally:
                    with self.cond:
                        self.uploading = None
            return
        if not self.threads:
            for loop, name in ((self._write_loop, "ckpt-write"), (self._upload_loop, "ckpt-upload")):
                thread = threading.Thread(target=loop, daemon=True, name=f"{name}-rank{self.rank}")
                thread.start()
                self.threads.append(thread)
        with self.cond:
            self.to_write.append((step, meta, write))
            self.num_unwritten += 1
            self.num_unfinished += 1
            self.cond.notify_all()

    def wait_written(self, timeout: float | None = None) -> bool:
        """Wait until every submitted checkpoint is written to staging (its host buffers are
        free again). True when none is left to write."""
        with self.cond:
            return self.cond.wait_for(lambda: self.num_unwritten == 0, timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted checkpoint is committed (rank 0) or receipted, failed
        or dropped (at most `timeout` seconds when given). True when none is left."""
        with self.cond:
            return self.cond.wait_for(lambda: self.num_unfinished == 0, timeout)

    def release_host_files(self, wait_seconds: float = 0.0) -> None:
        """At the end: clear the staged files this rank still keeps for rank 0 to adopt, after
        waiting up to wait_seconds for rank 0 to be done with them. Sharing rank 0's staging
        folder, that is its adoption, which takes the folder away (moved into the cache, or
        removed when incomplete): the commit in the store comes a moment before it, and files
        cleared in between would leave the host without its copy. On another host, where
        nobody adopts, the commit in the store is the end of it."""
        if not self.cache_dir:
            return
        deadline = time.monotonic() + wait_seconds
        for w in list(self.kept):
            while time.monotonic() < deadline:
                try:
                    if w.shared_with_rank0:
                        if not os.path.isdir(w.folder):
                            break
                    elif self.store.exists(join(w.key, COMMIT_FILE), refresh=True):
                        break
                except Exception:  # storage blinking: the deadline bounds the wait
                    pass
                time.sleep(RECEIPT_POLL_SECONDS)
        self._release_kept()

    def _staging_id(self) -> str:
        """Names this rank's staging folder: ranks with the same one share their files."""
        return f"{socket.gethostname()}:{os.path.realpath(self.staging_root)}"

    def pending_steps(self) -> list[int]:
        """Steps written to staging and not yet uploaded (and committed), oldest first."""
        with self.cond:
            return [w.step for w in ([self.uploading] if self.uploading else []) + list(self.to_upload)]

    # ---- write stage -----------------------------------------------------------------
    def _write_loop(self) -> None:
        _pin_upload_thread()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.to_write)
                job = self.to_write[0]
            written = None
            try:
                written = self._write(*job)
            finally:
                with self.cond:
                    self.to_write.popleft()
                    self.num_unwritten -= 1
                    if written is None:
                        self.num_unfinished -= 1
                    else:
                        self.to_upload.append(written)
                    self.cond.notify_all()

    def _write(self, step: int, meta: dict, write) -> _Written | None:
        """Agree, drop what rank 0 dropped, write this rank's files; None when not written."""
        t0 = time.perf_counter()
        try:
            mine = {"key": None, "drop": [], "why": "", "broken": self.broken, "staging": self._staging_id()}
            if self.rank == 0:
                why = (
                    f"step {step} was written while {self.max_pending_uploads} older checkpoint(s) "
                    "waited for upload (checkpoint.max_pending_uploads); the oldest not yet "
                    "uploading is dropped"
                )
                mine.update(key=self.new_key(step), drop=self._choose_drops(why), why=why)
            everyone = self.agree(mine)
            key, drops, why = everyone[0]["key"], everyone[0]["drop"], everyone[0]["why"]
            self._drop(drops, why)
            broken = next((p["broken"] for p in everyone if p["broken"]), "")
            if broken:  # the store failed permanently on some rank: nothing more is attempted
                self.broken = self.broken or broken
                self._not_attempted(step)
                return None
            if self.cache_dir:
                self._release_kept(keep_last=1)
            folder = self.staging_folder(key)
            names = write(key, folder)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            self.failures.append(f"step {step}: staging: {err}")
            self.on_event(CheckpointFailed(step=step, rank=self.rank, error=f"staging: {err}"[:500]))
            return None
        staged_seconds = time.perf_counter() - t0
        if self.rank == 0:
            self.on_event(CheckpointStaged(step=step, key=key, seconds=round(staged_seconds, 3)))
        return _Written(
            step, meta, key, folder, names, staged_seconds, shared_with_rank0=everyone[0]["staging"] == mine["staging"]
        )

    def _choose_drops(self, why: str) -> list[str]:
        """Rank 0: the oldest waiting checkpoints beyond max_pending_uploads - 1 (the new one
        makes it max_pending_uploads), marked dropped now so none of them starts its commit.
        The one being uploaded counts but is never chosen: were it dropped, an upload slower
        than max_pending_uploads checkpoint intervals would never commit anything."""
        with self.cond:
            started = [self.uploading] if self.uploading and not self.uploading.settled else []
            waiting = [w for w in started + list(self.to_upload) if not w.settled and not w.dropped]
            excess = max(0, len(waiting) - (self.max_pending_uploads - 1))
            chosen = [w for w in waiting if w not in started][:excess]
            for w in chosen:
                w.dropped = why
            return [w.key for w in chosen]

    def _drop(self, keys: list[str], why: str) -> None:
        """Every rank: drop these checkpoints where this rank has not receipted them yet."""
        if not keys:
            return
        with self.cond:
            gone = [w for w in self.to_upload if w.key in keys]
            for w in gone:
                self.to_upload.remove(w)
                self.num_unfinished -= 1
            if self.uploading is not None and self.uploading.key in keys and not self.uploading.settled:
                self.uploading.dropped = why  # the upload stage stops at its next store call
            self.cond.notify_all()
        for w in gone:
            self._discard(w, why)

    def _discard(self, w: _Written, why: str) -> None:
        self._clear_staging(w)
        self.failures.append(f"step {w.step}: dropped: {why}")
        self.on_event(CheckpointDropped(step=w.step, rank=self.rank, reason=why[:500]))

    def _clear_staging(self, w: _Written) -> None:
        """This rank's files of a checkpoint that will not be committed (other ranks on this
        host share the folder and clear their own); the folder goes with the last of them."""
        for name in w.names:
            try:
                os.remove(os.path.join(w.folder, name))
            except OSError:
                pass
        try:
            os.rmdir(w.folder)
        except OSError:
            pass

    def _adopt(self, w: _Written, manifest: dict) -> None:
        """Rank 0, after the commit: when this host's staging folder holds every file of the
        manifest (all ranks ran here), it becomes the host's cache copy of the checkpoint, with
        commit.json, as rehydrate would have left it after a download: the files are the ones
        each rank checksummed for its receipt. Otherwise (ranks on other hosts) it is removed.
        Only the newest adopted copy is kept."""
        if not self.cache_dir:
            shutil.rmtree(w.folder, ignore_errors=True)
            return
        final = local_checkpoint_dir(self.cache_dir, self.store, w.key)
        with host_lock(final):  # the same lock as rehydrate and _release_kept
            complete = all(
                os.path.isfile(os.path.join(w.folder, n)) and os.path.getsize(os.path.join(w.folder, n)) == e["size"]
                for n, e in manifest["files"].items()
            )
            if not complete:
                shutil.rmtree(w.folder, ignore_errors=True)
                return
            with open(os.path.join(w.folder, COMMIT_FILE), "w") as f:
                json.dump(manifest, f)
            drop_stamp(final + ".verified.json")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(w.folder, final)
            # each rank hashed these very files for its receipt (the manifest's sha256s): the
            # full check after this "fetch" is done, so the copy is stamped as verified
            write_stamp(final, manifest, final + ".verified.json")
        previous, self.adopted = self.adopted, final
        if previous and previous != final:
            shutil.rmtree(previous, ignore_errors=True)

    def _release_kept(self, keep_last: int = 0) -> None:
        """A non-zero rank: clear its files of earlier checkpoints (rank 0 adopted the folder
        already, or it never will), under each key's host lock so no adoption sees half. At a
        write the newest receipted one is kept (keep_last=1): its commit may still be coming."""
        with self.cond:
            cut = max(0, len(self.kept) - keep_last)
            kept, self.kept = self.kept[:cut], self.kept[cut:]
        for w in kept:
            with host_lock(local_checkpoint_dir(self.cache_dir, self.store, w.key)):
                self._clear_staging(w)

    def _not_attempted(self, step: int) -> None:
        """A checkpoint after a permanent storage error: fails at once, said once (rank 0)."""
        error = f"not attempted: the store failed permanently ({self.broken})"
        self.failures.append(f"step {step}: {error}")
        if self.rank == 0:
            self.on_event(CheckpointFailed(step=step, rank=self.rank, error=error[:500]))

    # ---- upload stage ----------------------------------------------------------------
    def _upload_loop(self) -> None:
        _pin_upload_thread()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.to_upload)
                self.uploading = self.to_upload.popleft()
            try:
                self._upload(self.uploading)
            finally:
                with self.cond:
                    self.uploading = None
                    self.num_unfinished -= 1
                    self.cond.notify_all()

    def _upload(self, w: _Written) -> None:
        """Checksum, upload, receipt; on rank 0 the commit. Never raises."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.upload_timeout
        try:
            files = {}
            for name in w.names:
                path = os.path.join(w.folder, name)
                self._check(w)
                files[name] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
                if not self.store.is_local:
                    self._call(
                        w,
                        lambda path=path, name=name: self.store.put_file(path, join(w.key, name)),
                        f"upload of {name} to {self.store.url(w.key)}",
                        deadline,
                    )
            receipt = {"rank": self.rank, "files": files, "upload_seconds": time.perf_counter() - t0}
            if self.rank != 0:
                self._settle(w)
            self._call(
                w,
                lambda: self.store.write_json(rank_receipt_key(w.key, self.rank), receipt),
                "upload of the receipt",
                deadline,
            )
            if not self.store.is_local and self.rank != 0:  # rank 0 clears the folder after commit
                if self.cache_dir:  # kept for rank 0 to adopt; cleared at this rank's next write
                    with self.cond:
                        self.kept.append(w)
                else:
                    for name in w.names:
                        os.remove(os.path.join(w.folder, name))
            if self.rank == 0:
                self._commit(w, t0)
            self.last_finish_seconds = time.perf_counter() - t0
        except _Dropped:
            self._discard(w, w.dropped)
        except _Broken as err:
            if not self.broken:  # the first permanent error on this rank: said with its reason
                self.broken = str(err)
                self._fail(w, f"the store failed permanently; no later checkpoint is attempted: {err}")
            else:
                self._clear_staging(w)
                self._not_attempted(w.step)
        except BaseException as err:
            self._fail(w, str(err))

    def _fail(self, w: _Written, error: str) -> None:
        self._clear_staging(w)
        self.failures.append(f"step {w.step}: {error}")
        self.on_event(CheckpointFailed(step=w.step, rank=self.rank, error=error[:500]))

    def _check(self, w: _Written) -> None:
        if w.dropped:
            raise _Dropped(w.dropped)
        if self.broken:
            raise _Broken(self.broken)

    def _settle(self, w: _Written) -> None:
        """From here on the checkpoint is no longer droppable on this rank."""
        with self.cond:
            self._check(w)
            w.settled = True

    def _call(self, w: _Written, fn, what: str, deadline: float):
        """fn() with retries of transient errors until the deadline; a permanent storage error
        (an S3 error code or an HTTP 4xx) breaks the stream."""

        def attempt():
            if not w.settled:
                self._check(w)
            return fn()

        def on_retry(attempt: int, err: BaseException, delay: float) -> None:
            self.on_event(UploadRetry(step=w.step, rank=self.rank, attempt=attempt, error=repr(err)[:200]))

        try:
            return retry(attempt, what=what, budget_seconds=max(0.0, deadline - time.monotonic()), on_retry=on_retry)
        except (_Stop, RetriesExhausted):
            raise
        except Exception as err:  # retry() raises only permanent errors as they are
            if error_code(err) or http_status(err):
                raise _Broken(_storage_reason(what, err)) from err
            raise

    def _receipts(self, w: _Written) -> dict[int, dict]:
        """Every rank's upload receipt, polled until the commit deadline (or until rank 0
        drops the checkpoint, or the store is known broken)."""
        deadline = time.monotonic() + self.commit_timeout
        receipts: dict[int, dict] = {}
        while True:
            self._check(w)
            for r in range(self.world_size):
                if r in receipts:
                    continue
                try:
                    if self.store.exists(rank_receipt_key(w.key, r), refresh=True):
                        receipts[r] = self.store.read_json(rank_receipt_key(w.key, r))
                    elif r == 0:  # a read tells a receipt not yet there from a bucket gone
                        self.store.read_json(rank_receipt_key(w.key, r))
                except Exception as err:  # storage blinking: ask again until the deadline
                    if error_code(err) in _STORE_GONE:
                        raise _Broken(_storage_reason("wait for the ranks' receipts", err)) from err
            if len(receipts) == self.world_size:
                return receipts
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(receipts))
                raise RuntimeError(f"ranks {missing} never reported their upload; not committed")
            time.sleep(RECEIPT_POLL_SECONDS)

    def _commit(self, w: _Written, t0: float) -> None:
        receipts = self._receipts(w)
        self._settle(w)  # every rank's files are in: commit, unless dropped a moment ago
        files = {name: entry for rec in receipts.values() for name, entry in rec["files"].items()}
        upload_seconds = max(rec["upload_seconds"] for rec in receipts.values())
        deadline = time.monotonic() + self.commit_timeout
        if self.pin_evaluations:  # before the commit: no pruning ever sees it committed and unpinned
            self._call(w, lambda: pin_for_evaluation(self.store, w.key), "evaluation pin", deadline)
        manifest = self._call(
            w,
            lambda: commit_checkpoint(
                self.store,
                w.key,
                {"step": w.step, "world_size": self.world_size, **w.meta, "upload_seconds": upload_seconds},
                files=files,
            ),
            "commit manifest",
            deadline,
        )
        try:  # the checkpoint is committed whatever happens here; the next commit prunes again
            retry(
                lambda: prune_checkpoints(
                    self.store, self.run_name, self.keep_latest_k, self.pin_seconds, train=self.train
                ),
                what="retention",
                budget_seconds=max(0.0, deadline - time.monotonic()),
            )
        except Exception as err:
            print(f"retention after {w.key} failed, left to the next commit: {err!r}", file=sys.stderr, flush=True)
        if not self.store.is_local:
            self._adopt(w, manifest)
        self.on_event(
            CheckpointCommitted(
                step=w.step,
                key=w.key,
                uri=self.store.url(w.key),
                bytes=sum(e["size"] for e in manifest["files"].values()),
                stage_seconds=round(w.staged_seconds, 3),
                upload_seconds=round(upload_seconds, 3),
                commit_seconds=round(time.perf_counter() - t0, 3),
            )
        )
        self.after_commit()
