"""File manifests: every file of a folder with its size and checksum, written last.

A folder (shard set or checkpoint) counts only when its manifest exists and every file
it lists is present with the listed size and, on a deep check, the listed checksum.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from stoker.storage.store import Store, join


@dataclass
class Verdict:
    """Whether a folder is valid, and if not, why."""

    valid: bool
    reason: str = ""
    manifest: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.valid


def describe_files(store: Store, folder: str, names: list[str] | None = None) -> dict[str, dict]:
    """{name: {size, sha256}} for the given names (default: every file under folder)."""
    if names is None:
        names = sorted(store.walk_files(folder))
    return {
        name: {"size": store.size(join(folder, name)), "sha256": store.sha256(join(folder, name))} for name in names
    }


def verify_files(store: Store, folder: str, files: dict[str, dict], deep: bool) -> str:
    """Return '' when every listed file matches, else the first problem found."""
    present = store.walk_files(folder)
    for name, entry in sorted(files.items()):
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            return f"the manifest's entry for {name} has no size and sha256 (damaged or not ours)"
        if name not in present:
            if any(other.startswith(name.rstrip("/") + "/") for other in present):
                return f"listed file {name} is a directory, not a file"
            return f"listed file {name} is missing"
        if present[name] != entry["size"]:
            return f"{name} has {present[name]} bytes, manifest says {entry['size']}"
    if deep:
        for name, entry in sorted(files.items()):
            if store.sha256(join(folder, name)) != entry["sha256"]:
                return f"{name} fails its sha256 checksum"
    return ""


INVALID_MARKER = "_invalid.json"  # written by a host whose full check of the bytes failed


def mark_invalid(store: Store, folder: str, reason: str) -> None:
    """Record in the store that this folder failed a full check (best effort: the caller
    raises the real problem anyway)."""
    try:
        store.write_json(join(folder, INVALID_MARKER), {"reason": reason, "at": time.time()})
    except Exception:
        pass


def invalid_reason(store: Store, folder: str) -> str | None:
    """None when no host marked the folder invalid, else the reason it recorded ('' when the
    marker cannot be read: a damaged marker still marks)."""
    if not store.exists(join(folder, INVALID_MARKER), refresh=True):  # another host may have written it
        return None
    try:
        return str(store.read_json(join(folder, INVALID_MARKER)).get("reason", ""))
    except Exception:
        return ""


def read_manifest(store: Store, key: str) -> tuple[dict | None, str]:
    """Parse a manifest; returns (manifest, '') or (None, reason)."""
    if not store.exists(key):
        return None, "no manifest (never committed or still being written)"
    try:
        manifest = store.read_json(key)
    except (ValueError, UnicodeDecodeError) as err:
        return None, f"manifest is not valid JSON ({err})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, "manifest has no 'files' table"
    return manifest, ""


def publish_folder(
    store: Store, staging: str, final: str, manifest_name: str, manifest: dict, is_intact: Callable[[], bool]
) -> bool:
    """Publish a folder built at ``staging`` as ``final``, its manifest last.

    Local stores: the manifest is written into staging, then the folder is renamed into
    place (atomic; an invalid leftover at ``final`` is first moved aside). Object stores: the
    listed files are copied, the manifest last. Returns False, discarding staging, when
    ``is_intact()`` says another writer published an intact copy first. Concurrent writers
    of one key publish identical bytes, so an identical manifest already in place is left
    alone rather than deleted."""
    if is_intact():
        store.rm(staging)
        return False
    parent, _, name = final.rstrip("/").rpartition("/")
    if store.is_local:
        store.write_json(join(staging, manifest_name), manifest)
        if store.exists(final):  # an invalid leftover (damaged or half-written): move it aside
            trash = join(parent, f".trash-{name}-{uuid.uuid4().hex[:8]}")
            try:
                store.rename(final, trash)
            except OSError:  # gone meanwhile
                pass
            store.rm(trash)
        try:
            store.rename(staging, final)
        except OSError:  # a concurrent writer renamed first
            store.rm(staging)
            return False
        return True
    old, _ = read_manifest(store, join(final, manifest_name))
    if old is not None and old != manifest:  # readers must not trust it while files change
        store.rm(join(final, manifest_name))
    for file_name in manifest["files"]:
        store.copy(join(staging, file_name), join(final, file_name))
    store.write_json(join(final, manifest_name), manifest)
    store.rm(staging)
    return True


# ---- a host's local record of a manifest (cache copies, "checked" stamps) ------------------
def same_json_file(path: str, value: dict) -> bool:
    """Whether the local JSON file at path holds exactly value (False when absent or bad)."""
    try:
        with open(path) as f:
            return json.load(f) == value
    except (OSError, ValueError):
        return False


def write_json_file(path: str, value: dict) -> None:
    """Write value to path atomically (a reader sees the old file or the whole new one)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)
