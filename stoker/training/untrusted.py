"""Reading checkpoint files that may have been tampered with, without running their code.

DCP's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``: a
planted file would run any code on load. ``SafeReader`` unpickles it with an allowlist of
the classes DCP metadata is made of (its dataclasses, torch dtypes and sizes, paths) and
refuses anything else. Tensor data is read by DCP with ``weights_only`` loading, and
``training.checkpoint.load_checkpoint`` refuses non-tensor entries before reading them.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_MODULES = {"torch.distributed.checkpoint.metadata"}  # DCP's metadata dataclasses and enums
_NAMES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to the layout
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(ValueError):
    """A checkpoint file refers to something that is not checkpoint data; it was not run."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _MODULES or (module, name) in _NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"checkpoint metadata refers to {module}.{name}, which is not "
            "checkpoint data; refusing to load it (nothing was run)"
        )


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata unpickling runs no code; see the module docstring."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = (
            self._get_metadata_path(kwargs.get("rank"))
            if hasattr(self, "_get_metadata_path")
            else self.path / ".metadata"
        )
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
