"""Prefect result caching whose truth is the object store.

A cached task's key is the store's own content key of its output, from the task's inputs (a
source fingerprint, a tokenizer recipe, a shard-set key, a checkpoint's commit manifest). A
record at that key counts only while the store holds the output it names with a valid
manifest; one whose output is gone is dropped before Prefect looks, so the task builds again:
a deleted or replaced output never meets a stale cache entry. The records live in the same
store, at ``{root}/prefect-results/{task name}/{key}``: deleting the store deletes its cache
too, and every host that reaches the store shares it.

Three Prefect parts, each small:
- `StoreCache`, the cache policy: ``compute_key`` asks a content-key function, and drops a
  record whose output the store no longer holds.
- `StoreResults`, the result storage block: reads and writes go through `storage.store.Store`
  (the task run's own store, named by its StorageConfig parameter), with the credentials of
  this process. Prefect's Task refuses an unsaved block at construction ("must be persisted
  server-side") but resolves one at run time (results.resolve_result_storage takes a Block
  instance as is). The store is a run-time value (each call's config) and one task object
  serves every store (training submits evaluate_checkpoint as is), so no saved block could
  name it: `attach_results` sets the block on the task after construction. Its records carry no block id:
  another process finds them by key through its own task (as the cache does), while
  ``state.result()`` of a state read back from the API cannot (Prefect then looks in its
  local default storage).
- `StoreResultSerializer`: JSON, never pickle (a record in the store cannot run code here),
  and only stoker's result types. A record read back is by definition a cache hit, so its
  ``cache_hit`` says True; a record that no longer fits its type cannot be read, which
  Prefect takes as "no record": the task runs again.

A policy made with ``isolation_level="SERIALIZABLE"`` (evaluate_checkpoint's) also gets a lock
manager whose locks are leases in the same store (`orchestration.cache_lock.StoreLockManager`): two
task runs of one key at once, in any processes or hosts, compute it once; the second waits for
the first one's lock and reads its record.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.filesystems import WritableFileSystem
from prefect.serializers import Serializer
from pydantic import BaseModel, Field

from stoker.contracts.results import DatasetInfo, EvalResult, ShardInfo, TokenizerInfo
from stoker.orchestration.cache_lock import StoreLockManager
from stoker.orchestration.run_logger import run_logger
from stoker.storage.store import Store, join

RESULTS_DIR = "prefect-results"
log = logging.getLogger("stoker.result_cache")

# the types a record may hold: nothing else is ever constructed from the store's bytes
RESULT_TYPES: dict[str, type] = {t.__name__: t for t in (DatasetInfo, TokenizerInfo, ShardInfo, EvalResult)}


def digest(*parts: Any) -> str:
    """A short sha256 of JSON-able parts (sorted keys): a cache key component."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def result_shape(result_type: type) -> list[str]:
    """The field names of a result type: in a key, a changed type invalidates the old records."""
    if dataclasses.is_dataclass(result_type):
        return [f.name for f in dataclasses.fields(result_type)]
    return sorted(result_type.model_fields)


def parameter(parameters: dict, path: str) -> Any:
    """A task parameter by dotted path: 'storage', 'config.storage'."""
    first, *rest = path.split(".")
    value = parameters[first]
    for name in rest:
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    return value


def store_of(parameters: dict, path: str) -> Store:
    storage = parameter(parameters, path)
    return Store.of(storage)


def task_store(storage_parameter: str) -> Store:
    """The store of the task run in progress (its StorageConfig parameter)."""
    ctx = TaskRunContext.get()
    if ctx is None:
        raise RuntimeError("stoker's result storage and cache locks are used inside a stoker task run only")
    return store_of(ctx.parameters, storage_parameter)


def _logger():
    return run_logger(log.name)


def record_key(task_name: str, key: str) -> str:
    """Where the record of a task's cache key lives, relative to the store root."""
    return join(RESULTS_DIR, task_name, key)


# ---- the cache policy -----------------------------------------------------------------------
@dataclass
class StoreCache(CachePolicy):
    """Key: `content_key(store, task parameters)`, the store's own content key of the task's
    output, computed from the task's inputs (None: no caching, the task runs). A record at
    that key counts only while `holds(store, result)` says the store still holds the output it
    names, with a valid manifest; a record whose output is gone (a store deleted, a shard set
    marked invalid) is removed before Prefect looks, so the task builds again and records
    anew. Any error here is the task's to meet and report: no key, and it runs.
    `on_hit(parameters)` runs when a record holds (before Prefect reads it).
    ``isolation_level="SERIALIZABLE"``: callers of one key at once compute it once; the others
    wait for its lock (orchestration.cache_lock, in the store) and read its record (Cached)."""

    content_key: Callable[[Store, dict], str | None] | None = None
    holds: Callable[[Store, Any], bool] | None = None
    on_hit: Callable[[dict], None] | None = None
    storage_parameter: str = "storage"  # the task parameter holding the StorageConfig

    def __post_init__(self) -> None:
        # SERIALIZABLE (one computation per key, the others wait and read its record): the
        # locks are leases in the same store, so they hold across processes and hosts
        if self.isolation_level is not None and str(self.isolation_level).endswith("SERIALIZABLE"):
            if self.lock_manager is None:
                self.lock_manager = StoreLockManager(functools.partial(task_store, self.storage_parameter))

    def compute_key(self, task_ctx, inputs: dict, flow_parameters: dict, **kwargs) -> str | None:
        name = task_ctx.task.name if task_ctx else "?"
        try:
            store = store_of(inputs, self.storage_parameter)
            key = self.content_key(store, inputs)
            if key is None:
                return None
            where = record_key(name, key)
            if store.exists(where, refresh=True):
                if self.holds is not None and not self._holds(store, where):
                    _logger().info("the store no longer holds the output cached at %s: dropped, built again", where)
                    store.rm(where)
                else:
                    _logger().info("cached at %s, and the store still holds its output: no work", store.url(where))
                    if self.on_hit is not None:
                        self.on_hit(inputs)
        except Exception as err:  # the task meets the same problem and reports it
            log.debug("no cache key for %s (%s): it runs", name, err)
            return None
        return f"{name}/{key}"

    def _holds(self, store: Store, where: str) -> bool:
        from prefect.results import ResultRecord

        try:
            result = ResultRecord.deserialize(store.read_bytes(where)).result
        except Exception:  # unreadable: Prefect takes it as absent too, and writes anew
            return True
        return self.holds(store, result)


# ---- result storage in the store ------------------------------------------------------------
class StoreResults(WritableFileSystem):
    """Prefect results of stoker's cached tasks, in the object store of the task run:
    ``{root}/prefect-results/{task}/{key}`` (cache records only). The store is the one in the task's StorageConfig
    parameter (`storage_parameter`), opened with this process's credentials."""

    _block_type_name = "Stoker Store Results"
    _block_type_slug = "stoker-store-results"
    _description = "Results of stoker's cached tasks, kept in the run's own object store."

    storage_parameter: str = Field("storage", description="The task parameter that holds the StorageConfig.")

    def _store(self) -> Store:
        return task_store(self.storage_parameter)

    def _resolve_path(self, path: str) -> None:
        return None  # keys are used as given (Prefect would otherwise make them absolute)

    def read_path(self, path: str, _sync: bool | None = None) -> bytes:
        return self._store().read_bytes(join(RESULTS_DIR, path))

    def write_path(self, path: str, content: bytes, _sync: bool | None = None) -> None:
        if "/" not in path:
            # not a cache record ({task}/{key}) but the exception record Prefect persists for
            # each failed run, under a random name: nothing here reads it (records carry no
            # block id), so it is not left in the store
            return
        self._store().write_bytes(join(RESULTS_DIR, path), content)

    async def aread_path(self, path: str) -> bytes:
        return self.read_path(path)

    async def awrite_path(self, path: str, content: bytes) -> None:
        self.write_path(path, content)


class StoreResultSerializer(Serializer):
    """JSON records of stoker's result types only (RESULT_TYPES); a record read back says
    cache_hit=True. Exceptions (Prefect persists a failed run's) are kept as their type and
    message."""

    type: str = Field(default="stoker-result", frozen=True)

    def dumps(self, obj: Any) -> bytes:
        if isinstance(obj, BaseException):
            payload = {"exception": type(obj).__name__, "message": str(obj)}
        elif type(obj).__name__ in RESULT_TYPES and isinstance(obj, RESULT_TYPES[type(obj).__name__]):
            data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else dataclasses.asdict(obj)
            payload = {"type": type(obj).__name__, "data": data}
        else:
            raise TypeError(f"stoker's result store keeps {', '.join(RESULT_TYPES)}, not {type(obj).__name__}")
        return json.dumps(payload).encode()

    def loads(self, blob: bytes) -> Any:
        payload = json.loads(blob)
        if "exception" in payload:
            return RuntimeError(f"{payload['exception']}: {payload['message']}")
        result_type = RESULT_TYPES[payload["type"]]  # KeyError: not ours, not read
        data = payload["data"]
        if "cache_hit" in result_shape(result_type):
            data = {**data, "cache_hit": True}  # read back from the cache: a hit
        if issubclass(result_type, BaseModel):
            return result_type.model_validate(data)
        return result_type(**data)  # TypeError when the type changed: no record, the task runs


def attach_results(made_task, cache: StoreCache):
    """Give a task made with `cache` its result storage in the store (see the module doc)."""
    made_task.result_storage = StoreResults(storage_parameter=cache.storage_parameter)
    return made_task
