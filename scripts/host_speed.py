"""How fast this host runs one core of plain Python right now: a flag for a slowed host.

    python3 scripts/host_speed.py [--reps 5] [--count 10000000]

Times a fixed loop (`--count` additions) `--reps` times and prints the medians of its CPU and
wall seconds on one line. `.ci/run` prints it before and after `make test`, so a slow suite can
be told from a slow host: in a virtual machine the host's speed moves (the same loop took 0.21
to 0.96 CPU-s within two hours here, nothing else running), and a process's CPU time then
counts the time the host gave its core away too. It is a flag, not a yardstick: one core's
Python speed does not predict the suite's time, which is process start-ups on two cores.
"""

from __future__ import annotations

import argparse
import statistics
import time


def loop_seconds(count: int) -> tuple[float, float]:
    """(CPU, wall) seconds of `count` additions in a plain Python loop."""
    cpu, wall = time.process_time(), time.perf_counter()
    total = 0
    for i in range(count):
        total += i
    return time.process_time() - cpu, time.perf_counter() - wall


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=positive, default=5, help="times the loop runs (the medians are printed)")
    parser.add_argument("--count", type=positive, default=10_000_000, help="additions in one loop")
    args = parser.parse_args(argv)
    runs = [loop_seconds(args.count) for _ in range(args.reps)]
    cpu = statistics.median(c for c, _ in runs)
    wall = statistics.median(w for _, w in runs)
    print(f"host speed: {cpu:.2f} CPU-s and {wall:.2f} s for {args.count:,} additions (median of {args.reps})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
