"""A host's cache of store folders (shard sets, checkpoints): one host lock, one verified copy.

The bytes a rank uses are checked on the host that uses them. What is checked, and when:

- **after every fetch, a full check**: each file downloaded into the cache is hashed (sha256)
  against the store's manifest as it lands; a local store's folder, read in place, is hashed
  the first time this host uses it.
- **on a cache hit, a stamp**: after a full check passes, a stamp is written next to the copy:
  the manifest, and for every file its (size, mtime_ns, inode, ctime_ns). A hit costs one
  ``stat`` per file and reads no byte. A byte written into a file in place changes its mtime
  and ctime; resetting the mtime (``os.utime``) changes the ctime again, which no user process
  can set back; a replaced file has a new inode. So a flipped byte, even one that keeps the
  size and the mtime, breaks the stamp, and the copy is hashed again: damaged, it is dropped and
  fetched again (logged as a warning); intact (a tool that touched the files without changing
  them), it is stamped again and used.

Not seen by the stamp: a change below the filesystem (bit rot on the disk, a raw write to the
block device). ``stoker verify`` reads every byte of the store's copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import uuid
from typing import Callable, Iterator

from stoker.storage.manifest import same_json_file, write_json_file
from stoker.storage.store import sha256_file

log = logging.getLogger("stoker.host_cache")


@contextlib.contextmanager
def host_lock(path: str) -> Iterator[None]:
    """Hold this host's exclusive lock on the cache entry at path (``path.lock``): one process
    of the host reads or fetches the bytes, the others wait and reuse its result. The lock dies
    with its holder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def file_problem(path: str, entry: dict) -> str:
    """'' when the local file at path has the manifest entry's size and sha256."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return "is missing"
    if size != entry.get("size"):
        return f"has {size} bytes, manifest says {entry.get('size')}"
    if sha256_file(path) != entry.get("sha256"):
        return "fails its sha256 checksum"
    return ""


def hash_problem(folder: str, files: dict[str, dict]) -> str:
    """The full check of a local folder against a manifest's files: '' or the first problem."""
    for name, entry in sorted(files.items()):
        problem = file_problem(os.path.join(folder, name), entry)
        if problem:
            return f"{name} {problem}"
    return ""


def _stamps(folder: str, names) -> dict[str, list[int]] | None:
    out = {}
    for name in sorted(names):
        try:
            st = os.stat(os.path.join(folder, name))
        except OSError:
            return None
        out[name] = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    return out


def is_stamped(folder: str, manifest: dict, stamp_file: str) -> bool:
    """The cheap check of a cache hit: the stamp holds this manifest, and every listed file
    still has the size, mtime, inode and ctime it had when it was last fully checked."""
    try:
        with open(stamp_file) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict) or stamp.get("manifest") != manifest:
        return False
    return stamp.get("files") == _stamps(folder, manifest["files"])


def write_stamp(folder: str, manifest: dict, stamp_file: str) -> None:
    """Record that folder's files passed a full check of manifest. Call only right after one."""
    files = _stamps(folder, manifest["files"])
    assert files is not None, f"stamping {folder}, whose files are not all there"
    tmp = f"{stamp_file}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump({"manifest": manifest, "files": files}, f)
    os.replace(tmp, stamp_file)


def drop_stamp(stamp_file: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(stamp_file)


def checked_in_place(folder: str, manifest: dict, stamp_file: str, damaged: Callable[[str], None]) -> None:
    """A folder read where it lies (a local store): hashed once per host and manifest, then
    trusted while its stamp holds. damaged(problem) raises the caller's error."""
    if is_stamped(folder, manifest, stamp_file):
        return
    drop_stamp(stamp_file)
    problem = hash_problem(folder, manifest["files"])
    if problem:
        damaged(problem)
    write_stamp(folder, manifest, stamp_file)


def verified_copy(
    local: str,
    manifest: dict,
    manifest_name: str,
    what: str,
    fetch: Callable[[str, str], None],
    damaged: Callable[[str], None],
) -> str:
    """This host's copy of a store folder at ``local``, fully checked; the caller holds
    host_lock(local). A copy whose manifest file equals the store's manifest and whose stamp
    holds is used as it is; one whose stamp broke is hashed again and, when damaged, dropped
    and fetched again. fetch(name, path) downloads one listed file to path; each is hashed as
    it lands, and damaged(problem) (raises) is called when one does not match, keeping nothing.
    The manifest file lands last, then the stamp."""
    stamp_file = local + ".verified.json"
    if same_json_file(os.path.join(local, manifest_name), manifest):
        if is_stamped(local, manifest, stamp_file):
            return local
        drop_stamp(stamp_file)
        problem = hash_problem(local, manifest["files"])
        if not problem:
            write_stamp(local, manifest, stamp_file)
            return local
        log.warning(
            "this host's cached copy of %s at %s is damaged (%s): dropped, fetching it again", what, local, problem
        )
    drop_stamp(stamp_file)
    shutil.rmtree(local, ignore_errors=True)  # stale, partial or damaged
    tmp = f"{local}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        for name, entry in sorted(manifest["files"].items()):
            path = os.path.join(tmp, name)
            fetch(name, path)
            problem = file_problem(path, entry)
            if problem:
                damaged(f"{name} {problem} (as downloaded)")
        write_json_file(os.path.join(tmp, manifest_name), manifest)
        os.replace(tmp, local)
        write_stamp(local, manifest, stamp_file)  # every file was hashed as it landed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local
