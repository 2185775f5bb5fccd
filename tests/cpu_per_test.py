"""CPU seconds per test, whatever runs beside it: ``make test PYTEST_ARGS="-p tests.cpu_per_test"``.

Each pytest process (each xdist worker) moves itself into a cpuacct cgroup of its own as it
starts. Every process a test starts inherits that group (servers, ranks, Ray workers, processes
in network namespaces), so the group's CPU time across a test's setup, call and teardown is the
test's CPU seconds, with its share of the session's servers. A test's wall time grows on a
loaded machine; its CPU seconds do not, so they say where the suite's time goes.

Rows: one JSON line per test in $CPU_PER_TEST_OUT (default ``.cpu-per-test.jsonl`` in the
working folder, appended to). The terminal summary lists the costliest files and tests. Needs
cgroup v1's cpuacct hierarchy and the right to make a group (root); without them it says so
and records nothing."""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

CGROUP_ROOT = "/sys/fs/cgroup/cpuacct"
_state: dict = {"group": None, "why_not": ""}


def _out_path() -> str:
    return os.environ.get("CPU_PER_TEST_OUT") or os.path.abspath(".cpu-per-test.jsonl")


def _usage() -> float:
    with open(os.path.join(_state["group"], "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def pytest_configure(config):
    if not os.path.isdir(CGROUP_ROOT):
        _state["why_not"] = f"no cgroup v1 cpuacct hierarchy at {CGROUP_ROOT}"
        return
    group = os.path.join(CGROUP_ROOT, f"stoker-cpu-per-test-{os.getpid()}")
    try:
        os.makedirs(group, exist_ok=True)
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as err:
        _state["why_not"] = f"cannot make or join a cpuacct group ({err})"
        return
    _state["group"] = group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _state["group"] is None:
        yield
        return
    cpu0, wall0 = _usage(), time.monotonic()
    yield
    row = {
        "test": item.nodeid,
        "cpu": round(_usage() - cpu0, 2),
        "wall": round(time.monotonic() - wall0, 2),
        "worker": getattr(item.config, "workerinput", {}).get("workerid", "main"),
        "end": round(time.time(), 2),
    }
    with open(_out_path(), "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter):
    if hasattr(terminalreporter.config, "workerinput"):  # an xdist worker: the controller sums up
        return
    if _state["why_not"]:
        terminalreporter.write_line(f"cpu_per_test: nothing recorded: {_state['why_not']}")
        return
    try:
        with open(_out_path()) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError:
        return
    by_file = collections.defaultdict(lambda: [0.0, 0])
    for r in rows:
        entry = by_file[r["test"].split("::")[0]]
        entry[0] += r["cpu"]
        entry[1] += 1
    write = terminalreporter.write_line
    write(f"cpu_per_test: {sum(r['cpu'] for r in rows):.0f} CPU-s in {len(rows)} tests ({_out_path()})")
    for name, (cpu, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:15]:
        write(f"  {cpu:7.1f} CPU-s  {n:3d} tests  {name}")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:15]:
        write(f"  {r['cpu']:7.1f} CPU-s  {r['wall']:7.1f} s  {r['test']}")


def pytest_unconfigure(config):
    group = _state["group"]
    if group is None:
        return
    try:  # back to the root group; the group goes when nothing of this session is left in it
        with open(os.path.join(CGROUP_ROOT, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(group)
    except OSError:
        pass
