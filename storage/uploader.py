"""The checkpoint commit protocol, rank side: upload, receipt, commit, retention. No torch.

``submit`` hands a checkpoint to a background thread, which agrees with the other ranks on
a folder no earlier attempt used (rank 0 picks it; ``agree_key`` tells the others), has the
caller's ``write`` put this rank's files into ``staging_folder(key)`` (the store folder
itself on a local store, a host staging folder otherwise), checksums each file, uploads it
with retries, and writes the rank's receipt (``_ranks/rank-N.json``). Rank 0's thread then
waits for every rank's receipt, writes ``commit.json`` last and applies retention. One
checkpoint is in flight per rank: the next ``submit`` and ``wait()`` wait for the previous
one. The training thread never calls the store here, so an outage delays commits, never steps.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Callable

from core.events import CheckpointCommitted, CheckpointFailed, CheckpointStaged, Event, UploadRetry
from core.failures import retry
from storage.checkpoints import (
    commit_checkpoint,
    list_checkpoints,
    new_checkpoint_key,
    prune_checkpoints,
    rank_receipt_key,
)
from storage.store import Store, join, sha256_file

RECEIPT_POLL_SECONDS = 0.2


def _pin_upload_thread() -> None:
    """STOKER_UPLOAD_CPUS="1" or "2,3": keep this upload thread off the training cores."""
    cpus = os.environ.get("STOKER_UPLOAD_CPUS")
    if cpus and hasattr(os, "sched_setaffinity") and threading.current_thread() is not threading.main_thread():
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


class CheckpointUploader:
    """One per rank; see the module docstring."""

    def __init__(self, store: Store, run_name: str, *, rank: int, world_size: int,
                 staging_root: str, keep_latest_k: int, upload_timeout: float,
                 commit_timeout: float, async_enabled: bool,
                 on_event: Callable[[Event], None] | None = None,
                 after_commit: Callable[[], None] | None = None,
                 agree_key: Callable[[str | None], str] | None = None):
        self.store, self.run_name, self.rank, self.world_size = store, run_name, rank, world_size
        self.staging_root, self.keep_latest_k = staging_root, keep_latest_k
        self.upload_timeout, self.commit_timeout = upload_timeout, commit_timeout
        self.async_enabled = async_enabled
        self.on_event = on_event or (lambda event: None)
        self.after_commit = after_commit or (lambda: None)
        self.agree_key = agree_key or (lambda key: key)  # a single rank agrees with itself
        self.thread: threading.Thread | None = None
        self.failures: list[str] = []
        self.last_finish_seconds = 0.0  # upload (+ commit on rank 0) of the last checkpoint
        # folder names already used, read once; later names are derived without listing
        self.taken = {r.name for r in list_checkpoints(store, run_name)} if rank == 0 else set()

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
        background when async_enabled, else before returning."""
        self.wait()
        job = (step, meta, write)
        if not self.async_enabled:
            self._finish(*job)
            return
        self.thread = threading.Thread(target=self._finish, args=job, daemon=True,
                                       name=f"ckpt-upload-{step}")
        self.thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the checkpoint in flight (at most `timeout` seconds when given)."""
        if self.thread is not None:
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.thread = None

    # ---- background part -------------------------------------------------------------
    def _finish(self, step, meta, write) -> None:
        _pin_upload_thread()
        try:
            t0 = time.perf_counter()
            key = self.agree_key(self.new_key(step) if self.rank == 0 else None)
            local = self.staging_folder(key)
            names = write(key, local)
            staged_seconds = time.perf_counter() - t0
            if self.rank == 0:
                self.on_event(CheckpointStaged(step=step, key=key, seconds=round(staged_seconds, 3)))
        except Exception as err:
            self.failures.append(f"step {step}: {err}")
            self.on_event(CheckpointFailed(step=step, rank=self.rank, error=f"staging: {err}"[:500]))
            return
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.upload_timeout

        def with_retries(fn, what: str):
            def on_retry(attempt: int, err: BaseException, delay: float) -> None:
                self.on_event(UploadRetry(step=step, rank=self.rank, attempt=attempt, error=repr(err)[:200]))
            return retry(fn, what=what, budget_seconds=max(0.0, deadline - time.monotonic()),
                         on_retry=on_retry)

        try:
            files = {}
            for name in names:
                path = os.path.join(local, name)
                files[name] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
                if not self.store.is_local:
                    with_retries(lambda: self.store.put_file(path, join(key, name)), f"upload of {name}")
            receipt = {"rank": self.rank, "files": files, "upload_seconds": time.perf_counter() - t0}
            with_retries(lambda: self.store.write_json(rank_receipt_key(key, self.rank), receipt),
                         "upload receipt")
            if not self.store.is_local and self.rank != 0:  # rank 0 clears the folder after commit
                for name in names:
                    os.remove(os.path.join(local, name))
            if self.rank == 0:
                self._commit(key, local, step, meta, staged_seconds, t0)
            self.last_finish_seconds = time.perf_counter() - t0
        except Exception as err:
            self.failures.append(f"step {step}: {err}")
            self.on_event(CheckpointFailed(step=step, rank=self.rank, error=str(err)[:500]))

    def _receipts(self, key: str) -> dict[int, dict]:
        """Every rank's upload receipt, polled until the commit deadline."""
        deadline = time.monotonic() + self.commit_timeout
        receipts: dict[int, dict] = {}
        while True:
            for r in range(self.world_size):
                try:
                    if r not in receipts and self.store.exists(rank_receipt_key(key, r), refresh=True):
                        receipts[r] = self.store.read_json(rank_receipt_key(key, r))
                except Exception:  # storage blinking: ask again until the deadline
                    pass
            if len(receipts) == self.world_size:
                return receipts
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(receipts))
                raise RuntimeError(f"ranks {missing} never reported their upload; not committed")
            time.sleep(RECEIPT_POLL_SECONDS)

    def _commit(self, key, local, step, meta, staged_seconds, t0) -> None:
        budget = self.commit_timeout
        receipts = self._receipts(key)
        files = {name: entry for rec in receipts.values() for name, entry in rec["files"].items()}
        upload_seconds = max(rec["upload_seconds"] for rec in receipts.values())
        manifest = retry(lambda: commit_checkpoint(self.store, key, {
            "step": step, "world_size": self.world_size, **meta, "upload_seconds": upload_seconds},
            files=files), what="commit manifest", budget_seconds=budget)
        retry(lambda: prune_checkpoints(self.store, self.run_name, self.keep_latest_k),
              what="retention", budget_seconds=budget)
        if not self.store.is_local:
            shutil.rmtree(local, ignore_errors=True)
        self.on_event(CheckpointCommitted(
            step=step, key=key, uri=self.store.url(key), bytes=sum(e["size"] for e in manifest["files"].values()),
            stage_seconds=round(staged_seconds, 3), upload_seconds=round(upload_seconds, 3),
            commit_seconds=round(time.perf_counter() - t0, 3)))
        self.after_commit()
