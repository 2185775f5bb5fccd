"""Run every benchmarks/bench_*.py; each prints its ratios against a baseline measured in
the same run (never an absolute time: these machines are shared and noisy)."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import benchmarks


def main() -> int:
    names = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))
    only = sys.argv[1:]
    for name in names:
        if only and name not in only:
            continue
        print(f"=== {name}", flush=True)
        sys.argv = [name]  # each benchmark parses its own (default) arguments
        importlib.import_module(f"benchmarks.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
