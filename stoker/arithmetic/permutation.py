"""A keyed bijection on [0, n), computed, never stored: the order of a data source's windows
over trillions of tokens costs a few round keys, not 4-8 bytes per window (Grain's
``index_shuffle``).

The domain is widened to 2**bits, bits the smallest even number >= log2(n) (at least 2), and
split in two halves of bits/2. A balanced Feistel network of ROUNDS rounds permutes
[0, 2**bits): each round sets (L, R) to (R, L ^ F(R)), where F is the splitmix64 finalizer of
``R ^ round key`` masked to the half width. Whatever F is, each round is invertible (L is
recovered as the new R ^ F(old R)), so the network is a bijection of [0, 2**bits); the keys,
from ``np.random.SeedSequence(key)``, choose which one.

Cycle walking makes it a bijection of [0, n): an index x < n is encrypted, and the result
re-encrypted while it is >= n. This terminates because the network is a permutation of a
finite set: x's cycle returns to x, which is < n, so the walk stops at the latest there. It
is a bijection because it maps x to the next element of [0, n) on x's cycle, and each such
element follows exactly one x. The walks from the n indices partition (part of) the cycles,
so they total at most 2**bits steps: a mean of at most 2**bits / n encryptions per index,
below 4 for every n > 1 (4 at n = 1; below 2 where log2(n) rounds up to an even number). Only
the indices still >= n are re-encrypted, and a batch takes as many passes as its longest walk.

Pure uint64 numpy arithmetic, wrapping mod 2**64, vectorised over index arrays.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6  # 4 suffice for a pseudorandom permutation (Luby-Rackoff); 2 more of margin
MAX_N = 1 << 63  # indices and results are int64
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


class Bijection:
    """The keyed bijection of [0, n) (see the module doc); `key`: a tuple of non-negative ints
    (a seed, a name's hash, an epoch). Call it on an array of indices in [0, n)."""

    def __init__(self, n: int, key: tuple[int, ...], rounds: int = ROUNDS):
        n = int(n)
        if not 1 <= n <= MAX_N:
            raise ValueError(f"a bijection's domain size must be in [1, 2**63], not {n}")
        if rounds < 4:
            raise ValueError(f"a Feistel bijection needs at least 4 rounds, not {rounds}")
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self.n, self.half = n, np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = [np.uint64(k) for k in np.random.SeedSequence(list(key)).generate_state(rounds, np.uint64)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over x, uint64 values in [0, 2**bits)."""
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            f = right ^ k  # (the whole 64-bit key: its high bits feed the mixer too)
            f ^= f >> _S30
            f *= _C1
            f ^= f >> _S27
            f *= _C2
            f ^= f >> _S31
            f &= self.mask
            f ^= left
            left, right = right, f
        return (left << self.half) | right

    def __call__(self, index) -> np.ndarray:
        """The images of `index` (an int or an array of ints in [0, n)), as int64."""
        x = np.asarray(index)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"indices must be in [0, {self.n})")
        x = x.astype(np.uint64)
        with np.errstate(over="ignore"):  # uint64 arrays wrap silently; scalars would warn
            y = self._encrypt(x.ravel())
            out = np.nonzero(y >= self.n)[0]
            while out.size:  # walk on, only the ones still outside [0, n)
                z = self._encrypt(y[out])
                y[out] = z
                out = out[z >= self.n]
        return y.astype(np.int64).reshape(x.shape)


def bijection(index, n: int, key: tuple[int, ...], rounds: int = ROUNDS) -> np.ndarray:
    """The keyed bijection of [0, n) applied to `index` (see Bijection)."""
    return Bijection(n, key, rounds)(index)
