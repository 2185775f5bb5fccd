"""What a new process costs before it does anything: the CPU seconds (user + system, from the
child's own rusage) of `python -c "import MODULE"`, with stoker's modules compiled to bytecode
and without, alternated, the median of each. This is the measurement behind
scripts/setup.sh's compile_bytecode: an editable install writes no bytecode, and where
PYTHONDONTWRITEBYTECODE is set (these machines set it) every rank, evaluation and flow-run
process compiled stoker from source again.

Both sides import the same copy of stoker (a temporary folder first on PYTHONPATH): once with
a __pycache__ that compileall wrote, once without one (PYTHONDONTWRITEBYTECODE=1, so it stays
without). Everything else (torch, Prefect) is imported as installed on both sides. Prints the
ratio compiled / from source (< 1: the bytecode saves CPU), and what `import torch` alone
costs, for scale (--reference).

And what the same process costs to end: `import MODULE` then Python's own exit, against
`import MODULE` then `stoker.process.quick_exit` (no teardown of the modules), alternated on the
compiled side; prints the ratio quick / normal of the whole process's CPU-s.

    python -m benchmarks.bench_startup [--module stoker.training.train] [--reps 5]
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import stoker

QUICK = "\nfrom stoker.process.quick_exit import quick_exit\nquick_exit(0)"


def cpu_seconds(module: str, env: dict, cwd: str, then: str = "") -> float:
    """User + system CPU seconds of a fresh `python -c "import MODULE"` (its own rusage), run
    in `cwd` (`-c` puts the working folder first on sys.path: not a checkout's); `then`: code
    run after the import (QUICK: end it with quick_exit)."""
    code = f"import {module}{then}"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"python -c 'import {module}' exited {proc.returncode}")
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="stoker.training.train", help="what the process imports (a rank's)")
    parser.add_argument("--reps", type=int, default=5, help="runs of each side, alternated")
    parser.add_argument("--reference", default="torch", help="a module whose import is printed for scale ('': none)")
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="stoker-bench-startup-")
    try:
        sides = {}
        for side in ("source", "compiled"):
            folder = os.path.join(work, side)
            shutil.copytree(
                os.path.dirname(stoker.__file__),
                os.path.join(folder, "stoker"),
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            if side == "compiled" and not compileall.compile_dir(os.path.join(folder, "stoker"), quiet=1, workers=0):
                raise SystemExit("compileall failed on the benchmark's copy of stoker")
            env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
            sides[side] = env
        # where the module comes from, said once: the copy, not the installed checkout
        where = subprocess.run(
            [sys.executable, "-c", "import stoker; print(stoker.__file__)"],
            env=sides["source"],
            cwd=work,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert where.startswith(work), f"stoker came from {where}, not the benchmark's copy"

        cpu: dict[str, list[float]] = {"source": [], "compiled": [], "reference": []}
        cpu_seconds(args.module, sides["compiled"], work)  # warm the page cache for both sides
        for _ in range(args.reps):
            for side in ("source", "compiled"):
                cpu[side].append(cpu_seconds(args.module, sides[side], work))
            if args.reference:
                cpu["reference"].append(cpu_seconds(args.reference, sides["source"], work))
        source, compiled = statistics.median(cpu["source"]), statistics.median(cpu["compiled"])
        scale = f"import {args.reference} alone {statistics.median(cpu['reference']):.2f}; " if args.reference else ""
        print(
            f"  import {args.module}: {source:.2f} CPU-s with stoker from source, {compiled:.2f} compiled "
            f"({scale}medians of {args.reps})"
        )
        print(f"  RATIO compiled / from source CPU-s = {compiled / source:.2f}")

        ends: dict[str, list[float]] = {"normal": [], "quick": []}
        for _ in range(args.reps):
            ends["normal"].append(cpu_seconds(args.module, sides["compiled"], work))
            ends["quick"].append(cpu_seconds(args.module, sides["compiled"], work, QUICK))
        normal, quick = statistics.median(ends["normal"]), statistics.median(ends["quick"])
        print(
            f"  import {args.module}, then its exit: {normal:.2f} CPU-s with Python's own, {quick:.2f} with "
            f"quick_exit (medians of {args.reps})"
        )
        print(f"  RATIO quick_exit / normal exit CPU-s = {quick / normal:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
