"""Reading token shards and the sampler whose order is a pure function of (seed, step, rank).

No state to save beyond the step: the batch of (step, micro-step, rank) is drawn from a
generator seeded with exactly those numbers, so a resumed run sees the same batches.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

MANIFEST = "manifest.json"


class TokenStream:
    """All shard files of one split, memory-mapped, addressed as one flat sequence."""

    def __init__(self, folder: str, split: str):
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
        self.vocab_size = int(manifest["vocab_size"])
        self.eot_id = int(manifest["eot_id"])
        dtype = np.dtype(manifest["dtype"])
        self.parts = [
            np.memmap(os.path.join(folder, name), dtype=dtype, mode="r")
            for name in manifest["splits"][split]
        ]
        self.parts = [p for p in self.parts if len(p) > 0]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.num_tokens = int(self.starts[-1])

    def window(self, offset: int, length: int) -> np.ndarray:
        """`length` tokens from global offset, clamped to stay inside one shard file."""
        i = int(np.searchsorted(self.starts, offset, side="right") - 1)
        part = self.parts[i]
        local = min(offset - int(self.starts[i]), len(part) - length)
        if local < 0:
            raise ValueError(f"shard file {i} holds {len(part)} tokens, fewer than one window of {length}")
        return np.asarray(part[local : local + length], dtype=np.int64)


def batch_offsets(seed: int, step: int, rank: int, micro: int, count: int, high: int) -> np.ndarray:
    """Window start offsets for one micro-batch: a pure function of its coordinates."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, rank, micro])))
    return rng.integers(0, high, size=count)


def get_batch(
    stream: TokenStream, block_size: int, offsets: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of shape (B, T), y shifted by one token."""
    rows = np.stack([stream.window(int(o), block_size + 1) for o in offsets])  # (B, T+1)
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def train_batch(stream: TokenStream, block_size: int, micro_batch: int, seed: int, step: int,
                rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    high = stream.num_tokens - block_size - 1
    if high <= 0:
        raise ValueError(f"the train split has {stream.num_tokens} tokens, fewer than block_size+1")
    return get_batch(stream, block_size, batch_offsets(seed, step, rank, micro, micro_batch, high))


def eval_offsets(num_tokens: int, block_size: int, num_windows: int) -> np.ndarray:
    """Evenly spaced, fixed validation windows (the same for every evaluation)."""
    high = max(num_tokens - block_size - 1, 1)
    return (np.arange(num_windows, dtype=np.int64) * high) // max(num_windows, 1)
