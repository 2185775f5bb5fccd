"""The one fsspec-based layer: an object-store root URL and the few primitives built on it.

URIs stay ``str`` (``pathlib.Path`` collapses the ``//`` of ``s3://``). Every other
module in storage/ builds on ``Store``; nothing outside storage/ touches fsspec.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any, Iterator

from fsspec.core import url_to_fs

from stoker.storage.credentials import options_for

CHUNK = 8 * 1024 * 1024


def join(base: str, *parts: str) -> str:
    """Join URL parts with '/', keeping the scheme's '//' intact."""
    out = base.rstrip("/")
    for p in parts:
        p = str(p).strip("/")
        if p:
            out = f"{out}/{p}"
    return out


def normalize_root(root: str) -> str:
    """Turn a bare absolute path into a file:// URL; leave URLs alone."""
    if "://" not in root:
        return "file://" + os.path.abspath(os.path.expanduser(root))
    return root.rstrip("/")


class Store:
    """An object-store root (``file://``, ``s3://``, ``memory://`` ...) with simple primitives.

    Paths given to the methods are relative keys under the root or full URLs.
    """

    @classmethod
    def of(cls, storage) -> "Store":
        """The store of a StorageConfig (a run config's `storage` section): the one way a run's
        store is opened."""
        return cls(storage.root, storage.storage_options)

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None):
        self.root = normalize_root(root)
        self.storage_options = dict(storage_options or {})  # as given: never with credentials
        self.fs, self._root_path = url_to_fs(self.root, **options_for(self.root, self.storage_options))
        self.protocol = self.root.split("://", 1)[0]

    # ---- naming --------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return self.protocol in ("file", "local")

    def url(self, *parts: str) -> str:
        return join(self.root, *parts)

    def _path(self, key: str) -> str:
        if "://" in key:
            if not key.startswith(self.root):
                raise ValueError(f"{key!r} is outside the store root {self.root!r}")
            key = key[len(self.root) :]
        if any(part in ("..", ".") for part in key.split("/")) or "\\" in key or "\x00" in key:
            raise ValueError(
                f"{key!r} is not a key under the store root {self.root!r} "
                "(no '..', '.', backslash or URL scheme inside a key)"
            )
        return join(self._root_path, key) if key.strip("/") else self._root_path

    def local_path(self, key: str = "") -> str:
        """The local filesystem path of a key (local stores only)."""
        if not self.is_local:
            raise ValueError(f"{self.root} is not a local store")
        return self._path(key)

    # ---- primitives ----------------------------------------------------------------
    def exists(self, key: str, refresh: bool = False) -> bool:
        """Does the key exist? refresh=True drops cached listings first (another process
        may have written it since)."""
        path = self._path(key)
        if refresh and not self.is_local:
            self.fs.invalidate_cache(path)
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])
        return self.fs.exists(path)

    def size(self, key: str) -> int:
        return int(self.fs.size(self._path(key)))

    def open(self, key: str, mode: str = "rb"):
        if "w" in mode and self.is_local:
            self.fs.makedirs(os.path.dirname(self._path(key)), exist_ok=True)
        return self.fs.open(self._path(key), mode)

    def read_bytes(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def read_range(self, key: str, start: int, size: int) -> bytes:
        """Bytes [start, start + size) of an object, in one ranged read (a range GET on
        object stores); the range must lie within the object."""
        return self.fs.cat_file(self._path(key), start=start, end=start + size) if size > 0 else b""

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write a whole object atomically: tmp + rename on local disks, one PUT elsewhere."""
        path = self._path(key)
        if self.is_local:
            os.replace(_complete_temp_file(path, data), path)
        else:
            self.fs.pipe_file(path, data)

    # ---- conditional writes (the run lease) ---------------------------------------------
    @property
    def conditional_writes(self) -> bool:
        """Can this store refuse a write whose precondition fails (create-only, replace-if-
        unchanged)? Local disks (link / a folder lock) and S3 (If-None-Match, If-Match) can;
        elsewhere a writer must verify after writing (write, wait, read back)."""
        return self.is_local or self.protocol in ("s3", "s3a")

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(content, version) of an object, or None when absent. The version is what
        ``write_bytes_if_version`` compares: the ETag on S3, the content's sha256 elsewhere."""
        path = self._path(key)
        if self.protocol not in ("s3", "s3a"):
            try:
                data = self.fs.cat_file(path)
            except FileNotFoundError:
                return None
            return data, hashlib.sha256(data).hexdigest()
        for _ in range(5):  # ETag, body, ETag: equal ETags prove the body is that version
            self.fs.invalidate_cache(path)
            try:
                before = self.fs.info(path)["ETag"]
                data = self.fs.cat_file(path)
                self.fs.invalidate_cache(path)
                after = self.fs.info(path)["ETag"]
            except FileNotFoundError:
                return None
            if before == after:
                return data, after
        raise TimeoutError(f"{self.url(key)} kept changing while it was read")

    def write_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Create an object only if no object has the key; False when one has. Atomic on
        local disks (a hard link of a complete temp file) and S3 (If-None-Match: *); other
        stores check, then write (verify after writing there)."""
        path = self._path(key)
        if self.is_local:
            tmp = _complete_temp_file(path, data)
            try:
                os.link(tmp, path)  # fails if the key exists: the create is all or nothing
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if self.protocol in ("s3", "s3a"):
            try:
                self.fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:
                return False
            except OSError as err:
                if _precondition_failed(err):
                    return False
                raise
        if self.exists(key, refresh=True):
            return False
        self.fs.pipe_file(path, data)
        return True

    def write_bytes_if_version(self, key: str, data: bytes, version: str) -> bool:
        """Replace an object only while it is still at `version` (from ``read_versioned``);
        False when another writer changed or removed it. S3: If-Match; local disks: under a
        lock on the folder; other stores: check, then write (verify after writing there)."""
        path = self._path(key)
        if self.protocol in ("s3", "s3a"):
            try:
                self.fs.pipe_file(path, data, IfMatch=version)
                return True
            except (FileNotFoundError, FileExistsError):
                return False
            except OSError as err:
                if _precondition_failed(err):
                    return False
                raise
        if self.is_local:
            import fcntl

            folder = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                fcntl.flock(folder, fcntl.LOCK_EX)  # every conditional replace of this folder
                current = self.read_versioned(key)
                if current is None or current[1] != version:
                    return False
                self.write_bytes(key, data)
                return True
            finally:
                os.close(folder)  # closing drops the lock
        current = self.read_versioned(key)
        if current is None or current[1] != version:
            return False
        self.fs.pipe_file(path, data)
        return True

    def read_json(self, key: str) -> Any:
        return json.loads(self.read_bytes(key))

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, json.dumps(obj, indent=2, sort_keys=True).encode())

    def append_text(self, key: str, text: str) -> None:
        """Append to a text object (read-modify-write where the store cannot append)."""
        if self.is_local:
            path = self._path(key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a") as f:
                f.write(text)
            return
        old = self.read_bytes(key) if self.exists(key) else b""
        self.write_bytes(key, old + text.encode())

    def put_file(self, local_path: str, key: str) -> None:
        path = self._path(key)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.fs.put_file(local_path, path)

    def get_file(self, key: str, local_path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
        self.fs.get_file(self._path(key), local_path)

    def listdir(self, key: str = "") -> list[str]:
        """Names (not paths) directly under a key; empty when it does not exist."""
        path = self._path(key)
        try:
            entries = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        base = path.rstrip("/")
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base)

    def walk_files(self, key: str) -> dict[str, int]:
        """Every file under a key as {relative name: size}."""
        base = self._path(key).rstrip("/")
        try:
            found = self.fs.find(base, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            rel = path[len(base) :].lstrip("/") if path.startswith(base) else path
            if rel:
                out[rel] = int(info.get("size") or 0)
        return out

    def copy(self, src: str, dst: str) -> None:
        """Copy one object within the store."""
        if self.is_local:
            os.makedirs(os.path.dirname(self._path(dst)), exist_ok=True)
        self.fs.copy(self._path(src), self._path(dst))

    def rm(self, key: str, recursive: bool = True) -> None:
        path = self._path(key)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=recursive)

    def rename(self, src: str, dst: str) -> None:
        """Move a folder (atomic on a local disk; file by file on object stores)."""
        if self.is_local:
            os.replace(self._path(src), self._path(dst))
            return
        for rel in self.walk_files(src):  # object stores have no folders: copy, then delete
            self.copy(join(src, rel), join(dst, rel))
        self.rm(src)

    # ---- content ---------------------------------------------------------------------
    def iter_chunks(self, key: str) -> Iterator[bytes]:
        with self.fs.open(self._path(key), "rb") as f:
            while True:
                block = f.read(CHUNK)
                if not block:
                    return
                yield block

    def sha256(self, key: str) -> str:
        h = hashlib.sha256()
        for block in self.iter_chunks(key):
            h.update(block)
        return h.hexdigest()


def _precondition_failed(err: BaseException) -> bool:
    """An S3 answer 412 (PreconditionFailed) or 409 (ConditionalRequestConflict: a
    concurrent conditional write won), which s3fs turns into a plain OSError."""
    from stoker.failures import error_code, http_status

    if error_code(err) in ("PreconditionFailed", "ConditionalRequestConflict"):
        return True
    if http_status(err) in (409, 412):
        return True
    return "pre-conditions you specified did not hold" in str(err)


def default_cache_dir() -> str:
    """This host's cache for shards and checkpoints read from remote stores."""
    return os.environ.get("STOKER_CACHE", os.path.expanduser("~/.cache/stoker"))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)


# ---- sources outside the store root, and a local build lock (appended) -------------------
def _has_magic(url: str) -> bool:
    path = url.split("://", 1)[-1]
    if url.startswith(("http://", "https://")):
        return "*" in path  # '?' starts a query string there, not a glob
    return any(c in path for c in "*?[")


def expand_url(url: str, **storage_options: Any) -> list[tuple[str, dict]]:
    """The objects a source URL names, as sorted ``(url, info)`` pairs: one object, every
    object under a folder, or a glob's matches. Listings are read fresh (the filesystem's
    listing cache is dropped first), so sizes, ETags and VersionIds describe what is there
    now. Raises FileNotFoundError when nothing is at a non-glob URL."""
    fs, path = url_to_fs(url, **options_for(url, storage_options))
    fs.invalidate_cache()
    if _has_magic(url):
        found = fs.glob(path, detail=True)
    else:
        info = fs.info(path)
        if info.get("type") != "directory":
            return [(url, dict(info))]
        found = fs.find(path, detail=True, withdirs=False)
    return [
        (fs.unstrip_protocol(p), dict(info)) for p, info in sorted(found.items()) if info.get("type") != "directory"
    ]


def fetch_url(url: str, local_path: str, **storage_options: Any) -> None:
    """Download one object (streamed, never held in memory) to a local file."""
    fs, path = url_to_fs(url, **options_for(url, storage_options))
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    fs.get_file(path, local_path)


def build_lock(store: Store, key: str):
    """Hold an exclusive lock on building ``key`` in a local store, so two runs on this host
    do the work once (the second then finds the first one's result). A no-op on object
    stores, where writers of the same key publish identical bytes, manifest last. The lock
    file lives in the temp folder, never in the store, and dies with its holder."""
    import contextlib
    import fcntl
    import tempfile

    @contextlib.contextmanager
    def held():
        if not store.is_local:
            yield
            return
        folder = os.path.join(tempfile.gettempdir(), "stoker-locks")
        os.makedirs(folder, exist_ok=True)
        name = hashlib.sha256(store.local_path(key).encode()).hexdigest()[:32]
        with open(os.path.join(folder, f"{name}.lock"), "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    return held()


def _complete_temp_file(path: str, data: bytes) -> str:
    """`data` in a new file beside `path`, on disk (fsync'd); its name, to rename or link."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp
