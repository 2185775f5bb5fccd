"""The data order's memory and speed (arithmetic.mixture over arithmetic.permutation): a
mixture of 3 sources (weights 0.5/0.3/0.2) computes the picks of every position of a global
batch for a run of steps deep into training, as the ranks do.

1. Peak RSS (VmHWM) of a fresh interpreter doing so with 1e6 windows per source and with 1e10
   windows per source, each in a child process of its own: the order is computed, not stored,
   so the two are equal.                                                goal: within 1 MB
2. Picks per second against the order it replaced (a numpy permutation per source and epoch,
   stored: ``StoredPermutations`` below, a copy of it), at 1e6 windows, measured in the same
   run, interleaved rounds.                                             goal >= 1

    python -m benchmarks.bench_data_order [--steps 200 --batch 512 --start-step 100000000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import zlib
from collections import OrderedDict

import numpy as np

from stoker.arithmetic.mixture import Mixture

NAMES, WEIGHTS, SEED = ["web", "code", "books"], [0.5, 0.3, 0.2], 1234


class StoredPermutations(Mixture):
    """The baseline: the data order before arithmetic.permutation, a stored numpy permutation
    of each source's windows per epoch (4-8 bytes per window), read position by position."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._perms: OrderedDict = OrderedDict()

    def _permutation(self, i: int, epoch: int) -> np.ndarray:
        key = (i, epoch)
        got = self._perms.get(key)
        if got is None:
            ss = np.random.SeedSequence([self.seed, zlib.crc32(self.names[i].encode()), epoch])
            dtype = np.uint32 if self.windows[i] < 2**32 else np.int64
            got = self._perms[key] = np.random.Generator(np.random.PCG64(ss)).permutation(self.windows[i]).astype(dtype)
            if len(self._perms) > 2 * len(self.names) + 2:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(key)
        return got

    def _whole_step(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.sources_of_step(step)
        base = self.draws_before(step)
        order = np.argsort(ids, kind="stable")
        occurrence = np.empty(len(ids), dtype=np.int64)
        sorted_ids = ids[order]
        first = np.searchsorted(sorted_ids, sorted_ids, side="left")
        occurrence[order] = np.arange(len(ids)) - first
        n = base[ids] + occurrence
        out = np.empty(len(ids), dtype=np.int64)
        for k, (i, draw) in enumerate(zip(ids.tolist(), n.tolist())):
            epoch, within = divmod(draw, int(self.windows[i]))
            out[k] = int(self._permutation(i, epoch)[within])
        return ids.astype(np.int64), out


KINDS = {"computed": Mixture, "stored": StoredPermutations}


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):  # not Linux: ru_maxrss (KB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1 << 20 if sys.platform == "darwin" else 1024)


def _picks(kind: str, windows: int, batch: int, start: int, steps: int) -> tuple[float, int]:
    """(seconds, windows picked) of `steps` steps' whole global batches from step `start`."""
    m = KINDS[kind](NAMES, WEIGHTS, [], batch, SEED, [windows] * len(NAMES))
    t = time.perf_counter()
    picked = 0
    for step in range(start, start + steps):
        _, win = m.picks(step)
        assert win.min() >= 0 and win.max() < windows
        picked += len(win)
    return time.perf_counter() - t, picked


def child(kind: str, windows: int, batch: int, start: int, steps: int) -> dict:
    """One fresh interpreter's figures: its peak RSS after the imports, and after the picks."""
    before = _peak_rss_mb()
    seconds, picked = _picks(kind, windows, batch, start, steps)
    return {"kind": kind, "windows": windows, "imports_mb": before, "peak_mb": _peak_rss_mb(), "seconds": seconds}


def _run_child(kind: str, windows: int, batch: int, start: int, steps: int) -> dict:
    from benchmarks._child import run_child

    args = [kind, str(windows), "--batch", str(batch), "--start-step", str(start), "--steps", str(steps)]
    return run_child("benchmarks.bench_data_order", args, f"{kind} {windows}")


def run(batch: int, start: int, steps: int, rounds: int) -> dict:
    small, large = 10**6, 10**10
    rss = {
        "computed_1e6": _run_child("computed", small, batch, start, steps),
        "computed_1e10": _run_child("computed", large, batch, start, steps),
        "stored_1e6": _run_child("stored", small, batch, start, steps),
    }
    speed: dict[str, list[float]] = {"computed": [], "stored": []}
    for _ in range(rounds):  # interleaved, so drift of the machine hits both alike
        for kind in speed:
            seconds, picked = _picks(kind, small, batch, start, steps)
            speed[kind].append(picked / seconds)
    rate = {k: statistics.median(v) for k, v in speed.items()}
    return {
        "sources": len(NAMES),
        "global_batch": batch,
        "steps": f"{start}..{start + steps - 1}",
        "rss": rss,
        "peak_rss_difference_mb": round(rss["computed_1e10"]["peak_mb"] - rss["computed_1e6"]["peak_mb"], 3),
        "picks_per_s": {k: round(v) for k, v in rate.items()},
        "ratio_computed_over_stored": round(rate["computed"] / rate["stored"], 3),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=512, help="global batch, in sequences")
    p.add_argument("--start-step", type=int, default=100_000_000, help="the first step whose picks are computed")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the speed comparison")
    p.add_argument("--smoke", action="store_true", help="a tiny run that checks the benchmark works")
    p.add_argument("--child", nargs=2, metavar=("KIND", "WINDOWS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = child(args.child[0], int(args.child[1]), args.batch, args.start_step, args.steps)
        print(json.dumps(result))
        return result
    if args.smoke:
        args.batch, args.steps, args.rounds = 64, 5, 1
    result = run(args.batch, args.start_step, args.steps, args.rounds)
    print(json.dumps(result, indent=2))
    rss = result["rss"]
    small, large = rss["computed_1e6"]["peak_mb"], rss["computed_1e10"]["peak_mb"]
    diff = result["peak_rss_difference_mb"]
    print(
        f"peak RSS, {result['sources']} sources, {args.steps} steps of {args.batch} from step {args.start_step}: "
        f"1e6 windows/source {small:.1f} MB, 1e10 windows/source {large:.1f} MB, difference {diff:+.2f} MB "
        f"(goal within 1 MB: {'MET' if abs(diff) <= 1 else 'NOT MET'}); "
        f"stored permutations at 1e6: {rss['stored_1e6']['peak_mb']:.1f} MB"
    )
    rate = result["picks_per_s"]
    print(
        f"RATIO computed / stored order, picks per second at 1e6 windows: {result['ratio_computed_over_stored']:.3f} "
        f"({rate['computed']:,} vs {rate['stored']:,}; goal >= 1)"
    )
    return result


if __name__ == "__main__":
    main()
