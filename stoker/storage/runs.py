"""A run's folder in the store: pinning its config, tokenizer and shard set before launch,
and reading them back from a checkpoint URL."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

from stoker.arithmetic import schedule
from stoker.config import RunConfig
from stoker.config.train import END_FIELDS
from stoker.contracts.results import DataShards
from stoker.failures import CheckpointUnavailable, ConfigError, ExportError
from stoker.storage.layout import (
    BASE_DIR,
    CONFIG_FILE,
    SHARDS_FILE,
    TOKENIZER_FILE,
    CheckpointLocation,
    parse_checkpoint_url,
    run_file_key,
    run_key,
)
from stoker.storage.store import Store, join


def read_config(url: str) -> RunConfig:
    """Read config.json from any URL the store can reach (storage options from env)."""
    store_root, _, name = url.rpartition("/")
    options = json.loads(os.environ.get("STOKER_STORAGE_OPTIONS", "{}"))
    return RunConfig.model_validate_json(Store(store_root, options).read_bytes(name))


def store_problem(store: Store) -> str:
    """'' when the store root can be written (a tiny probe object, written and removed), else
    one line naming storage.root and the fix. Permanent failures only (a missing bucket,
    access denied); a store that is merely unreachable raises, to be retried. A local root
    that does not exist yet is probed in the nearest folder that does, where it would be
    made: the probe leaves no folder behind (a config refused for another reason writes
    nothing)."""
    from stoker.failures import describe, is_transient

    probe = f".stoker-probe-{uuid.uuid4().hex[:12]}"
    where = Store("file://" + _nearest_folder(store.local_path())) if store.is_local else store
    try:
        where.write_bytes(probe, b"")
        where.rm(probe)
    except Exception as err:
        if is_transient(err):
            raise
        return (
            f"storage.root: {store.root} cannot be written ({describe(err)}); create the "
            "bucket or folder, fix its name, or give credentials that may write there."
        )
    return ""


def _nearest_folder(root: str) -> str:
    """Where the probe of a local root goes: the root when it exists, else the nearest folder
    above it (where it would be made). A file in the way: the root, whose making fails."""
    path = root
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path if os.path.isdir(path) else root


def pin_run_folder(store: Store, config: RunConfig, shards: DataShards) -> str:
    """Write config.json, the tokenizer and shards.json into the run folder; return the
    config URL. A run folder that already holds another model is refused: resuming from it
    could not load, and overwriting it would lose work."""
    run = config.resolved_run_name()
    key = run_file_key(run, CONFIG_FILE)
    seen: dict[str, str] = {}  # every source the run has trained on: its shard set
    if store.exists(key):
        old = RunConfig.model_validate_json(store.read_bytes(key))
        was, now = getattr(old.model, "base_sha256", None), getattr(config.model, "base_sha256", None)
        if was != now:
            raise ConfigError(
                [
                    f"model.init_from: run {run!r} started from base {_base_name(old)} and this config names "
                    f"{_base_name(config)}; a run keeps the base it started from: choose a new run_name."
                ]
            )
        if old.model_hash() != config.model_hash():
            raise ConfigError(
                [
                    f"run_name: run {run!r} already holds a different model "
                    "(model or tokenizer.vocab_size changed); choose a new run_name."
                ]
            )
        problem = schedule_change_problem(store, config, old)  # never a stretched schedule, never a restart
        if problem:
            raise ConfigError([problem])
        pinned = run_file_key(run, SHARDS_FILE)
        if store.exists(pinned):
            seen = _same_data_per_source(run, store.read_json(pinned), shards)
    _pin_lineage(store, run, config)
    store.write_bytes(key, config.to_json().encode())
    store.copy(join(shards.sets[0].key, TOKENIZER_FILE), run_file_key(run, TOKENIZER_FILE))
    seen.update({s.name: s.cache_key for s in shards.sets})
    store.write_json(run_file_key(run, SHARDS_FILE), {**shards.as_dict(), "seen": seen})
    if getattr(config.model, "init_from", None):  # what an export needs of the base, kept with the run
        pin_base_files(store, run, config.model.init_from, config.storage.storage_options)
    return store.url(key)


def schedule_change_problem(store: Store, config: RunConfig, old: RunConfig | None = None) -> str:
    """'' when the run `config` names may train under its schedule: a new run, the schedule it
    was trained under, or a 'wsd'/'constant' one of the same stable part (trained longer, or
    another decay) with a committed checkpoint to go on from (one before the new decay, inside the
    stable part it was trained under: find_latest_valid); else the one line refusing it, naming
    the fields and the fixes (schedule.change_problem's, or: no checkpoint to go on from, which
    would start the run over). `old`: the run's config.json, read here when not given. Reads
    config.json and the checkpoints' manifests; writes nothing (the preflight asks it before any
    work, pin_run_folder again before config.json is rewritten)."""
    from stoker.storage.checkpoints import find_latest_valid, identity_problem, list_checkpoints, validate_checkpoint

    run = config.resolved_run_name()
    if old is None:
        key = run_file_key(run, CONFIG_FILE)
        if not store.exists(key):
            return ""
        old = RunConfig.model_validate_json(store.read_bytes(key))
    problem = schedule.change_problem(old.train, config.train, run)
    if problem or schedule.signature(old.train)["hash"] == schedule.signature(config.train)["hash"]:
        return problem
    expected = {"run_name": run, "model_hash": config.model_hash()}
    if find_latest_valid(store, run, expected, config.train).checkpoint is not None:
        return ""  # it goes on from there
    trained = []  # (step, the schedule it was trained under) of each committed checkpoint of the run
    for ref in list_checkpoints(store, run):
        verdict = validate_checkpoint(store, ref.key)
        if verdict and not identity_problem(verdict.manifest, expected):
            trained.append((ref.step, verdict.manifest.get("schedule") or {}))
    if not trained:
        return ""  # nothing trained yet: nothing to start over from
    changed = [f for f in END_FIELDS if getattr(old.train, f, None) != getattr(config.train, f, None)]
    settings = ", ".join(f"{f}={getattr(config.train, f)!r}" for f in changed)
    wsd, start = config.train.lr_schedule == "wsd", schedule.stable_until(config.train)
    stable = [step for step, saved in trained if step <= int(saved.get("stable_until", step))]
    fix = "branch from one of its checkpoints under a new run name (train.branch_from, or stoker run --branch-from URI)"
    if stable:  # past the new start (else it would have been found): a start there or later finds it
        what = "start its decay" if wsd else "end it"
        fix = f"{what} at step {max(stable)} or later (its newest checkpoint before a decay), or {fix}"
    steps = ", ".join(str(step) for step, _ in trained)
    return (
        f"train.{changed[0]}: run {run!r} {'decays from' if wsd else 'ends at'} step {start} under this config "
        f"({settings}), and no checkpoint it kept (steps {steps}) lies at or before that step outside a decay, "
        f"so it would start over: {fix}"
    )


def _same_data_per_source(run: str, before: dict, shards: DataShards) -> dict[str, str]:
    """A run's mixture may change between its flow runs (sources added, removed or reweighted),
    but a source it trained on keeps its shard set: the same name with other shards (its data,
    the tokenizer or the sharding changed) would change the data under the run. Returns the
    shard set of every source the run has trained on."""
    was = dict(before.get("seen") or {})
    if not was and before.get("cache_key"):  # pinned before mixtures: one source
        was = {"main": before["cache_key"]}
    for now in shards.sets:
        if was.get(now.name, now.cache_key) != now.cache_key:
            what = "run_name" if now.name == "main" else f"data.sources[{now.name}]"
            raise ConfigError(
                [
                    f"{what}: run {run!r} was trained on shard set {was[now.name]}"
                    f"{'' if now.name == 'main' else f' for source {now.name!r}'}, and this config makes "
                    f"{now.cache_key} (the data, tokenizer or sharding changed); resuming would change "
                    "the data under the run: choose a new run_name"
                    f"{'' if now.name == 'main' else ', or give the changed source a new name'}."
                ]
            )
    return was


def pin_base_files(store: Store, run: str, init_from: str, options: dict) -> None:
    """Copy the base's config.json and tokenizer configs into the run folder's base/: the
    run's export writes the base's own tokenizer files and ids even after the base is gone."""
    from stoker.storage.bases import SIDE_FILES, base_store

    base = base_store(init_from, options)
    for name in SIDE_FILES:
        if name.endswith(".json") and name != "model.safetensors.index.json" and base.exists(name):
            store.write_bytes(run_file_key(run, f"{BASE_DIR}/{name}"), base.read_bytes(name))


def _base_name(config: RunConfig) -> str:
    model = config.model
    if not getattr(model, "init_from", None):
        return "none (random weights)"
    return f"{model.init_from} (sha256 {(model.base_sha256 or '?')[:12]})"


def checkpoint_inputs(checkpoint_url: str, storage_options: dict) -> tuple[RunConfig, str, str, str]:
    """From a checkpoint URL: the run's config (pointed at that store), its URL, the
    checkpoint key and the shard-set key."""
    where = parse_checkpoint_url(checkpoint_url)  # ConfigError naming checkpoint_uri
    store = Store(where.root, storage_options)
    config_key = run_file_key(where.run_name, CONFIG_FILE)
    config = RunConfig.model_validate_json(store.read_bytes(config_key))
    config = config.model_copy(
        update={
            "storage": config.storage.model_copy(
                update={"root": where.root, "storage_options": storage_options or config.storage.storage_options}
            )
        }
    )
    shard_key = store.read_json(run_file_key(where.run_name, SHARDS_FILE))["key"]
    from stoker.storage.checkpoints import COMMIT_FILE, unavailable_message

    if not store.exists(join(where.key, COMMIT_FILE)):  # deleted or never committed: said once
        raise CheckpointUnavailable(unavailable_message(store, where.key, "no commit manifest"))
    return config, store.url(config_key), where.key, shard_key


@dataclass(frozen=True)
class NamedCheckpoint:
    """A checkpoint a user named by URL, with its run's config and shards.json and its manifest."""

    store: Store
    where: CheckpointLocation
    config: RunConfig
    shards: dict
    manifest: dict


def named_checkpoint(checkpoint_url: str, storage_options: dict | None = None) -> NamedCheckpoint:
    """A checkpoint named by URL, checked without reading a tensor: the URL's form, its run
    folder's config.json and shards.json, its commit manifest with every listed file present
    at its size, and its identity (the manifest names this run and the run's model).
    ConfigError naming checkpoint_uri otherwise. The full checksum check is rehydrate's,
    where the bytes are read."""
    from pydantic import ValidationError

    from stoker.storage.checkpoints import identity_problem, validate_checkpoint

    where = parse_checkpoint_url(checkpoint_url)  # ConfigError naming checkpoint_uri
    store = Store(where.root, storage_options)
    url, run = store.url(where.key), where.run_name
    try:
        config = RunConfig.model_validate_json(store.read_bytes(run_file_key(run, CONFIG_FILE)))
        shards = store.read_json(run_file_key(run, SHARDS_FILE))
    except FileNotFoundError:
        raise ConfigError(
            [
                f"checkpoint_uri: {url} is in no run folder ({store.url(run_key(run))} "
                f"holds no {CONFIG_FILE} and {SHARDS_FILE}); check the store root and "
                "the run name"
            ]
        ) from None
    except (ValidationError, ValueError) as err:
        raise ConfigError(
            [
                f"checkpoint_uri: the run folder of {url} holds a {CONFIG_FILE} or "
                f"{SHARDS_FILE} stoker cannot read ({str(err).splitlines()[0]})"
            ]
        ) from None
    verdict = validate_checkpoint(store, where.key)
    if not verdict:
        raise ConfigError(
            [
                f"checkpoint_uri: {url} is not a committed, intact checkpoint "
                f"({verdict.reason}); name one whose commit.json exists"
            ]
        )
    mismatch = identity_problem(verdict.manifest, {"run_name": run, "model_hash": config.model_hash()})
    if mismatch:
        raise ConfigError([f"checkpoint_uri: {url} {mismatch}: its run folder's {CONFIG_FILE} does not describe it"])
    return NamedCheckpoint(store, where, config, shards, verdict.manifest)


def export_source(checkpoint_url: str, folder: str, storage_options: dict | None = None) -> NamedCheckpoint:
    """The checks of `stoker export` that read no tensor: the output folder is new or empty,
    and the checkpoint is named_checkpoint's. ExportError (one line) otherwise."""
    import os

    folder = os.path.abspath(folder)
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise ExportError(f"folder: {folder} exists and is not an empty folder; give a new one")
    try:
        return named_checkpoint(checkpoint_url, storage_options)
    except ConfigError as err:
        raise ExportError("; ".join(err.problems)) from None


def _pin_lineage(store: Store, run: str, config: RunConfig) -> None:
    """A branch's lineage.json (its parent, step, checkpoint and the sha256 of its commit
    manifest), written once; the same run name from another branch point is refused."""
    from stoker.storage.branches import LINEAGE_FILE, lineage

    mine = lineage(config)
    key = run_file_key(run, LINEAGE_FILE)
    was = store.read_json(key) if store.exists(key) else None
    if was is not None and was != mine:
        raise ConfigError(
            [
                f"train.branch_from: run {run!r} was branched from {was.get('checkpoint')} (sha256 "
                f"{str(was.get('sha256'))[:12]}), not {config.train.branch_from}; a branch keeps its branch point: "
                "choose a new run_name"
            ]
        )
    if mine is not None and was is None:
        store.write_json(key, mine)
