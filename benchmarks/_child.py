"""A benchmark's measured child: ``python -m benchmarks.NAME --child ...`` in a fresh interpreter
from the repository root, its last stdout line read as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(module: str, args: list[str], what: str, **env: str) -> dict:
    """The child's result; `what` names it when it fails (with its stderr's tail)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", module, "--child", *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=path, **env),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {what} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
