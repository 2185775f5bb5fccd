"""Units of work of the data stage, run where data.engine says: processes on this host or Ray
tasks on a cluster, with the same results.

A unit is a plain function ``fn(store, **args) -> dict`` named by ``"module:function"``, with
JSON-able arguments. It reads its input from the store and writes its output there (cached by
content: a unit whose output is committed returns at once), so it may run on any host, fail
and run again alone; what it returns is a small summary (counts), never documents. The caller
holds nothing per document: memory is the unit's, bounded by its input.

- Local: up to `workers` fresh interpreters (``python -m stoker.data.units``, never a fork of
  the orchestrator), each taking the next unit as it finishes one; the store's root and options
  reach them on stdin, never on a command line. ``in_process`` runs the units here instead (a
  small stage, where a process would cost more than it gives).
- Ray: one task per unit on the cluster of ``ray`` (data.engine 'ray'), spread over its nodes.

A unit that fails with a transient error (a lost worker or node, an OSError, a 503) runs again,
up to UNIT_RETRIES times, while the others go on; so does a local unit that runs past
UNIT_TIMEOUT_S (its worker is killed: a hung read ends there, whatever blocked it); a DataError (the user's data) fails the stage
at once. ``on_progress`` sees every finished unit (units done of total, documents so far).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import selectors
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from stoker.config import RayConfig
from stoker.data import ray_engine
from stoker.failures import DataError, is_transient
from stoker.storage.credentials import options_for
from stoker.storage.store import Store

log = logging.getLogger("stoker.data")
UNIT_RETRIES = 2
# a unit's deadline in a worker process: its input is one partition or bucket (seconds to
# minutes of work), so a unit past this is hung (a read that never returns), not slow
UNIT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Unit:
    fn: str  # "module:function"
    args: dict
    label: str  # what it does, for errors ("features of partition 3 of source 'web'")


@dataclass
class Progress:
    """Where a stage stands: units done of total, documents processed, seconds since it began."""

    stage: str
    done: int
    total: int
    docs: int
    elapsed_s: float
    nodes: set[str] = field(default_factory=set)

    @property
    def docs_per_s(self) -> float:
        return self.docs / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left, at the rate so far (None before the first unit)."""
        if not self.done:
            return None
        return self.elapsed_s / self.done * (self.total - self.done)


ProgressFn = Callable[[Progress], None]


class Tracker:
    """A stage's Progress, told to `on_progress` as each of its `total` units finishes."""

    def __init__(self, stage: str, total: int, on_progress: ProgressFn | None):
        self.progress = Progress(stage, 0, total, 0, 0.0)
        self.on_progress = on_progress
        self.started = time.monotonic()

    def step(self, docs: int = 0, node: str | None = None) -> None:
        p = self.progress
        p.done += 1
        p.docs += int(docs)
        p.elapsed_s = time.monotonic() - self.started
        if node:
            p.nodes.add(node)
        if self.on_progress is not None:
            self.on_progress(p)


def call(fn: str, store: Store, args: dict) -> dict:
    module, name = fn.split(":")
    return getattr(importlib.import_module(module), name)(store, **args)


def run_units(
    stage: str,
    units: list[Unit],
    store: Store,
    *,
    engine: str = "local",
    workers: int = 1,
    ray=None,
    in_process: bool = False,
    on_progress: ProgressFn | None = None,
) -> list[dict]:
    """Every unit's result, in the order of `units` (see the module doc)."""
    tracker = Tracker(stage, len(units), on_progress)

    def done(result: dict, node: str | None = None) -> None:
        tracker.step(result.get("docs", 0), node)

    if not units:
        return []
    if engine == "ray":
        return run_units_on_ray(stage, units, store, ray, done)
    if in_process:
        out = []
        for unit in units:
            out.append(_here(unit, store))
            done(out[-1])
        return out
    spec = {"root": store.root, "options": store.storage_options}
    with _Pool(max(1, min(workers, len(units))), spec) as pool:
        return pool.run(units, done)


def one_line(text: str, limit: int = 500) -> str:
    """An error's text on one line (a store client's message may hold newlines), cut at `limit`."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _here(unit: Unit, store: Store) -> dict:
    for attempt in range(UNIT_RETRIES + 1):
        try:
            return call(unit.fn, store, unit.args)
        except DataError:
            raise
        except Exception as err:
            if not (isinstance(err, OSError) or is_transient(err)):
                raise
            why = f"{type(err).__name__}: {one_line(err)}"
            if attempt == UNIT_RETRIES:
                raise ChildProcessError(f"{unit.label} failed {attempt + 1} times; the last: {why}") from err
            log.warning("%s failed (%s); it runs again", unit.label, why)
    raise AssertionError("unreachable")


class _Worker:
    def __init__(self, spec: dict, log_path: str):
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        self.log_path = log_path
        with open(log_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stoker.data.units"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
        self.send(spec)
        self.job: int | None = None
        self.since = 0.0  # when it was given its job

    def send(self, msg: dict) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-2000:].decode("utf-8", "replace").strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class _Pool:
    """Up to n worker processes, each given the next unit as it finishes one; a worker lost
    mid-unit is replaced and its unit runs again (UNIT_RETRIES)."""

    def __init__(self, n: int, spec: dict):
        import tempfile

        self.n, self.spec = n, spec
        self.dir = tempfile.TemporaryDirectory(prefix="stoker-units-")
        self.workers: list[_Worker] = []
        self.sel = selectors.DefaultSelector()

    def __enter__(self) -> "_Pool":
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            w.close()
        self.sel.close()
        self.dir.cleanup()

    def _start(self) -> _Worker:
        w = _Worker(self.spec, os.path.join(self.dir.name, f"worker-{len(self.workers)}.log"))
        self.workers.append(w)
        self.sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        return w

    def _drop(self, w: _Worker) -> None:
        self.sel.unregister(w.proc.stdout)
        w.close()
        self.workers.remove(w)

    def run(self, units: list[Unit], done: Callable[[dict], None]) -> list[dict]:
        return list(self.stream(units, done))

    def stream(self, units: Sequence[Unit], done: Callable[[dict], None], ahead: int | None = None) -> Iterator[Any]:
        """The units' results in their order, each yielded once it and those before it are
        done; with `ahead`, no unit starts more than `ahead` places past the next to yield
        (what the units leave on this host's disk stays bounded while the caller reads)."""
        results: dict[int, Any] = {}
        attempts = [0] * len(units)
        todo = deque(range(len(units)))  # ascending: a unit run again goes back to the front
        idle = [self._start() for _ in range(self.n)]
        following = 0  # the next result to yield
        while following < len(units):
            if following in results:
                yield results.pop(following)
                following += 1
                continue
            limit = len(units) if ahead is None else following + ahead
            while todo and idle and todo[0] < limit:
                w = idle.pop()
                w.job, w.since = todo.popleft(), time.monotonic()
                unit = units[w.job]
                w.send({"fn": unit.fn, "args": unit.args})
            busy = [w for w in self.workers if w.job is not None]
            wait = max(0.0, min(w.since for w in busy) + UNIT_TIMEOUT_S - time.monotonic())
            ready = self.sel.select(timeout=wait)
            late = [w for w in busy if time.monotonic() - w.since >= UNIT_TIMEOUT_S]
            for key, w in [(None, w) for w in late] + [(key, key.data) for key, _ in ready if key.data not in late]:
                k = w.job
                if key is None:  # past its deadline: the worker goes, the unit runs again
                    line, timed_out = b"", True
                else:
                    line, timed_out = w.proc.stdout.readline(), False
                msg = json.loads(line) if line else None
                if msg is not None and "result" in msg:
                    results[k], w.job = msg["result"], None
                    idle.append(w)
                    done(results[k])
                    continue
                err = (msg or {}).get("error")
                if err is not None and err["type"] == "DataError":
                    raise DataError(err["message"])
                if err is not None and not err["transient"]:
                    raise RuntimeError(f"{units[k].label}: {err['type']}: {err['message']}")
                if timed_out:
                    why = f"it ran past its deadline of {UNIT_TIMEOUT_S:.0f} s (a hung read?)"
                elif err:
                    why = f"{err['type']}: {one_line(err['message'])}"
                else:
                    why = f"its worker exited ({one_line(w.tail()[-500:])})"
                attempts[k] += 1
                if attempts[k] > UNIT_RETRIES:
                    raise ChildProcessError(f"{units[k].label} failed {attempts[k]} times; the last: {why}")
                log.warning("%s failed (%s); it runs again", units[k].label, why)
                self._drop(w)
                todo.appendleft(k)
                idle.append(self._start())


def stream_units(units: Sequence[Unit], store: Store, workers: int, ahead: int) -> Iterator[dict]:
    """The units' results in order, as they are done, on up to `workers` processes of this
    host, none more than `ahead` units past the result the caller is reading (see _Pool.stream);
    the workers end when the caller stops reading."""
    if not units:
        return
    spec = {"root": store.root, "options": store.storage_options}
    with _Pool(max(1, min(workers, len(units))), spec) as pool:
        yield from pool.stream(units, lambda result: None, ahead)


@contextlib.contextmanager
def engine_session(engine: str, ray_cfg: RayConfig | None):
    """One Ray connection for the stages inside (data.engine 'ray'): a local instance is
    started once, not once per stage, and stopped at the end. Nothing for the local engine."""
    if engine != "ray":
        yield
        return
    ray_cfg = ray_cfg or RayConfig()
    ray, owned = ray_engine.connect(ray_cfg, ray_cfg.cpus_per_data_task)
    try:
        yield
    finally:
        if owned:
            ray_engine.shutdown(ray)


# ---- units of the data stage (stoker.data.units) as Ray tasks -------------------------------
def unit_task(spec, fn: str, args: dict) -> tuple[dict, str]:
    """One unit of the data stage (stoker.data.units.call) on a node of the cluster."""
    return call(fn, spec.open(), args), ray_engine.node_id()


def run_units_on_ray(stage: str, units: list, store: Store, ray_cfg: RayConfig | None, done) -> list[dict]:
    """Every unit as a Ray task, spread over the cluster; results in the order of `units`,
    `done(result, node)` called as each finishes. A task lost with its worker or node runs
    again (Ray's max_retries); an error is raised as the local engine raises it."""
    ray_cfg = ray_cfg or RayConfig()
    spec = ray_engine.StoreSpec(store.root, options_for(store.root, store.storage_options))
    cpus = ray_cfg.cpus_per_data_task
    with ray_engine.ray_tasks(ray_cfg, cpus) as (ray, refs):
        task = ray.remote(unit_task).options(
            num_cpus=cpus, name="stoker-data-unit", scheduling_strategy="SPREAD", max_retries=UNIT_RETRIES
        )
        refs += [task.remote(spec, u.fn, u.args) for u in units]
        where = {ref: k for k, ref in enumerate(refs)}
        results: list = [None] * len(units)
        pending, nodes = list(refs), set()
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                k = where[ref]
                results[k], node = ray_engine.result_of(ray, ref, units[k].label)
                nodes.add(node)
                done(results[k], node)
        log.info(
            "data.engine ray: %d unit(s) of %s on %d node(s)",
            len(units),
            stage,
            len(nodes),
            extra={"ray_nodes": sorted(nodes), "ray_stage": stage},
        )
        return results


def _worker_main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the log, never into the protocol
    spec = json.loads(sys.stdin.readline())
    store = Store(spec["root"], spec["options"])
    for line in sys.stdin:
        job = json.loads(line)
        try:
            result = call(job["fn"], store, job["args"])
        except Exception as err:
            transient = isinstance(err, OSError) or is_transient(err)
            error = {"type": type(err).__name__, "message": str(err), "transient": transient}
            proto.write(json.dumps({"error": error}) + "\n")
            if not transient:
                return 1
            continue
        proto.write(json.dumps({"result": result}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
