"""The data order of a run: which source each training window comes from, and which window of
that source, as a pure function of (seed, step, position in the global batch).

Torch-free, so the flow (the plan it logs, the report) and every rank compute the same thing.

- **Which source**: a deterministic quota schedule. The steps of each schedule segment (the
  weights between two data.schedule entries) are cut into blocks of K steps; a block holds
  K x G windows (G: the global batch, in sequences), of which source i gets exactly
  ``w_i / sum(w) x K x G``. K is the smallest number of steps for which every such share is a
  whole number of windows (weights read as the decimals they are written as: 0.7 is 7/10).
  So the proportions are exact over every block of K global batches, not only in expectation.
  Where that K would exceed MAX_BLOCK_STEPS (weights like 0.1234567), K is MAX_BLOCK_STEPS and
  the shares are rounded to whole windows by largest remainder (each source within one window
  of its share per block; ``Segment.exact`` says which). Inside a block the windows' sources
  are shuffled by a generator seeded with (seed, segment, block).
- **Which window**: each source's training windows (non-overlapping, ``block_size + 1`` tokens,
  never across a shard file) are taken in the order of a keyed bijection of [0, windows)
  (``permutation``: a Feistel network with cycle walking), keyed by (seed, source name, epoch):
  computed, never stored, so a rank's memory does not grow with a source's windows. A source
  that runs out starts its next epoch in a new order. The n-th window drawn from a source is a
  function of n alone, and n of (step, position): a count of the quotas of the blocks before
  plus those of the block so far. (This order replaced a stored ``numpy`` permutation per
  source and epoch: the same seed gives other windows than before it.)

A resumed run (any world size, launcher or restart) computes the same windows: nothing here
depends on anything but the seed, the step, the position and the config.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from stoker.arithmetic.permutation import Bijection

MAX_BLOCK_STEPS = 1000
MAX_BLOCK_WINDOWS = 1 << 22  # a block's assignment array stays a few MB
# the picks computed at once, for the steps ahead (a step's global batch at the least): 64 KB
CHUNK_POSITIONS = 1 << 12
_MIX_TAG = 0x6D6978  # "mix": the block shuffles' stream, apart from the windows' permutations


@dataclass(frozen=True)
class Segment:
    """The steps [start, end) under one set of weights (end None: to the end of the run)."""

    start: int
    end: int | None
    weights: tuple[float, ...]  # as configured, per source
    quotas: tuple[int, ...]  # windows per source in each block of block_steps steps
    block_steps: int
    exact: bool  # every quota is exactly its share

    def shares(self) -> tuple[float, ...]:
        total = sum(self.quotas)
        return tuple(q / total for q in self.quotas)


def _fraction(w: float) -> Fraction:
    return Fraction(repr(float(w)))  # 0.7 as 7/10, not the binary float's 3152519739159347/2**52


def quotas(weights: list[float], global_batch: int) -> tuple[tuple[int, ...], int, bool]:
    """(windows per source in a block, the block's steps K, exact) for these weights."""
    fractions = [_fraction(w) for w in weights]
    total = sum(fractions)
    shares = [f / total * global_batch for f in fractions]  # windows per step, maybe fractional
    k = 1
    for s in shares:
        k = math.lcm(k, s.denominator)
    exact = k <= MAX_BLOCK_STEPS and k * global_batch <= MAX_BLOCK_WINDOWS
    if not exact:
        k = max(1, min(MAX_BLOCK_STEPS, MAX_BLOCK_WINDOWS // global_batch))
    want = [s * k for s in shares]
    got = [math.floor(x) for x in want]
    short = k * global_batch - sum(got)
    # largest remainder, ties to the earlier source: deterministic
    for i in sorted(range(len(want)), key=lambda i: (-(want[i] - got[i]), i))[:short]:
        got[i] += 1
    return tuple(got), k, exact


def segments(
    names: list[str], weights: list[float], schedule: list[tuple[int, dict]], global_batch: int
) -> list[Segment]:
    """The run's segments: the configured weights from step 0, each schedule entry's from its
    at_step on (a source it leaves out keeps its weight)."""
    current = list(weights)
    starts = [(0, list(current))]
    for at_step, changes in sorted(schedule, key=lambda e: e[0]):
        current = [float(changes.get(n, w)) for n, w in zip(names, current)]
        if at_step == 0:
            starts[0] = (0, list(current))
        else:
            starts.append((at_step, list(current)))
    out = []
    for j, (start, w) in enumerate(starts):
        q, k, exact = quotas(w, global_batch)
        end = starts[j + 1][0] if j + 1 < len(starts) else None
        out.append(Segment(start, end, tuple(w), q, k, exact))
    return out


def effective_mix(weights: dict, schedule: list, history: dict | None) -> tuple[dict, list]:
    """(initial weights, [(at_step, weights)]) of a run whose mixture before `history["step"]` is
    `history`'s (a branch: its parent's, storage.branches.lineage) and its own from there."""
    if not history or not history.get("weights"):
        return dict(weights), list(schedule)
    at = int(history["step"])
    before = [(int(s), dict(w)) for s, w in history.get("schedule", []) if int(s) < at]
    return dict(history["weights"]), before + [(at, dict(weights))] + [(s, w) for s, w in schedule if s > at]


def windows_of(part_tokens: list[int], block_size: int) -> int:
    """Training windows of a split whose shard files hold these token counts: non-overlapping
    windows of block_size + 1 tokens (input and shifted target), never across two files."""
    return sum(max(0, (n - 1) // block_size) for n in part_tokens)


def _name_seed(name: str) -> int:
    return zlib.crc32(name.encode())


class Mixture:
    """The data order of one run (see the module doc). `windows`: each source's training
    windows (windows_of its train split)."""

    def __init__(
        self,
        names: list[str],
        weights: list[float],
        schedule: list[tuple[int, dict]],
        global_batch: int,
        seed: int,
        windows: list[int],
    ):
        if not names:
            raise ValueError("a mixture needs a source")
        for name, n in zip(names, windows):
            if n <= 0:
                raise ValueError(f"source {name!r} has no training window")
        self.names, self.windows = list(names), np.asarray(windows, dtype=np.int64)
        self.global_batch, self.seed = global_batch, seed
        self.segments = segments(self.names, weights, schedule, global_batch)
        self._blocks: OrderedDict = OrderedDict()
        self._orders: OrderedDict = OrderedDict()  # a few round keys each, not windows
        # the picks of the steps ahead (first step, sources, windows): a step's micro-batches
        # read it in turn, and the next steps' come from the same bijection calls
        self._steps: tuple = (0, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))

    @classmethod
    def of_config(
        cls, data, seed: int, global_batch: int, windows: dict[str, int], history: dict | None = None
    ) -> "Mixture":
        """The mixture of a DataConfig (its data.sources and data.schedule, or its one source).
        `history`: a branch's (storage.branches.lineage: its parent's weights and schedule
        before the branch point, and that step), so that the branch goes on from its parent's
        data position: the parent's weights up to the branch point, its own from there."""
        named = [(name, weight) for name, weight, _ in data.source_configs()]
        weights, schedule = effective_mix(dict(named), [(e.at_step, e.weights) for e in data.schedule], history)
        names = [n for n, _ in named]
        return cls(names, [float(weights[n]) for n in names], schedule, global_batch, seed, [windows[n] for n in names])

    # ---- which source ------------------------------------------------------------------
    def _segment_of(self, step: int) -> tuple[int, Segment]:
        for j in range(len(self.segments) - 1, -1, -1):
            if self.segments[j].start <= step:
                return j, self.segments[j]
        raise ValueError(f"step {step} is before the run's start")

    def _block(self, j: int, b: int) -> np.ndarray:
        """The sources of block b of segment j, position by position (K x G of them)."""
        key = (j, b)
        got = self._blocks.get(key)
        if got is None:
            seg = self.segments[j]
            ids = np.repeat(np.arange(len(self.names), dtype=np.int32), seg.quotas)
            if len(self.names) > 1:
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, _MIX_TAG, j, b])))
                ids = rng.permutation(ids)
            got = self._blocks[key] = ids
            if len(self._blocks) > 4:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(key)
        return got

    def sources_of_step(self, step: int) -> np.ndarray:
        """The source index of each position of step's global batch (step: the steps done
        before it, 0 for the first)."""
        j, seg = self._segment_of(step)
        b, r = divmod(step - seg.start, seg.block_steps)
        G = self.global_batch
        return self._block(j, b)[r * G : (r + 1) * G]

    def draws_before(self, step: int) -> np.ndarray:
        """Windows taken from each source by the steps before `step`."""
        counts = np.zeros(len(self.names), dtype=np.int64)
        for j, seg in enumerate(self.segments):
            end = step if seg.end is None else min(step, seg.end)
            m = end - seg.start
            if m <= 0:
                break
            full, rem = divmod(m, seg.block_steps)
            counts += full * np.asarray(seg.quotas, dtype=np.int64)
            if rem:
                counts += np.bincount(self._block(j, full)[: rem * self.global_batch], minlength=len(self.names))
        return counts

    def epochs_after(self, steps: int) -> np.ndarray:
        """Epochs of each source (windows taken / its windows) after `steps` steps."""
        return self.draws_before(steps) / self.windows

    # ---- which window ------------------------------------------------------------------
    def _order(self, i: int, epoch: int) -> Bijection:
        """Source i's order of its windows in this epoch."""
        key = (i, epoch)
        got = self._orders.get(key)
        if got is None:
            got = self._orders[key] = Bijection(int(self.windows[i]), (self.seed, _name_seed(self.names[i]), epoch))
            if len(self._orders) > 2 * len(self.names) + 2:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return got

    def picks(self, step: int, start: int = 0, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window index in that source) of positions [start, start+count) of
        step's global batch."""
        first, src, windows = self._steps
        if not first <= step < first + len(src) // self.global_batch:  # computed for the steps ahead
            steps = max(1, CHUNK_POSITIONS // self.global_batch)
            self._steps = (step, *self._whole_steps(step, steps))
            first, src, windows = self._steps
        at = (step - first) * self.global_batch
        end = self.global_batch if count is None else start + count
        return src[at + start : at + end], windows[at + start : at + end]

    def _whole_steps(self, step: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The picks of `steps` steps from `step`, position by position, step after step: the
        same as one step at a time (a step's draws go on from the steps before it), with one
        bijection call per (source, epoch) for them all; each call costs its passes of numpy
        arithmetic (cycle walking: up to ~10 on a small batch) whatever its size, so a chunk
        of steps pays that once."""
        ids = np.concatenate([self.sources_of_step(s) for s in range(step, step + steps)])
        base = self.draws_before(step)
        # the n-th window of a source in these steps: how many positions before hold that source
        order = np.argsort(ids, kind="stable")
        occurrence = np.empty(len(ids), dtype=np.int64)
        sorted_ids = ids[order]
        first = np.searchsorted(sorted_ids, sorted_ids, side="left")
        occurrence[order] = np.arange(len(ids)) - first
        src = ids.astype(np.int64)
        draw = base[src] + occurrence  # the draw's number in its source, over all epochs
        epoch, within = np.divmod(draw, self.windows[src])
        out = np.empty(len(src), dtype=np.int64)
        # one bijection call per (source, epoch) of the steps: they span few of them
        for i in np.unique(src).tolist():
            of_i = np.flatnonzero(src == i)
            for e in np.unique(epoch[of_i]).tolist():
                at = of_i[epoch[of_i] == e]
                out[at] = self._order(i, e)(within[at])
        return src, out

    # ---- limits ------------------------------------------------------------------------
    def last_step_within(self, i: int, max_epochs: float, max_steps: int) -> int:
        """The most steps (<= max_steps) after which source i has given at most max_epochs of
        its windows."""
        limit = math.floor(max_epochs * int(self.windows[i]) + 1e-9)
        if self.draws_before(max_steps)[i] <= limit:
            return max_steps
        lo, hi = 0, max_steps  # draws_before(lo) <= limit < draws_before(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.draws_before(mid)[i] <= limit:
                lo = mid
            else:
                hi = mid
        return lo

    def describe(self) -> list[str]:
        """One line per segment: its steps, each source's share, K and whether it is exact."""
        lines = []
        for seg in self.segments:
            end = "end" if seg.end is None else seg.end
            shares = ", ".join(f"{n} {q}/{sum(seg.quotas)}" for n, q in zip(self.names, seg.quotas))
            how = "exact" if seg.exact else "rounded to whole windows"
            lines.append(
                f"steps {seg.start + 1}..{end}: {shares} windows per block of K={seg.block_steps} step(s) ({how})"
            )
        return lines
