"""stoker.storage: the one fsspec-based layer (object-store root, shard sets, checkpoints)."""

from stoker.storage.checkpoints import (
    CheckpointRef,
    ResumeChoice,
    commit_checkpoint,
    find_latest_valid,
    list_checkpoints,
    new_checkpoint_key,
    prune_checkpoints,
    validate_checkpoint,
)
from stoker.storage.manifest import Verdict
from stoker.storage.store import Store, join

__all__ = [
    "CheckpointRef",
    "ResumeChoice",
    "Store",
    "Verdict",
    "commit_checkpoint",
    "find_latest_valid",
    "join",
    "list_checkpoints",
    "new_checkpoint_key",
    "prune_checkpoints",
    "validate_checkpoint",
]
