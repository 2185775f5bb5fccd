"""Branches (train.branch_from): a run that starts from a committed, intact checkpoint of
another run, under a config of its own (another schedule, learning rate, mixture, evaluation,
world size), never writing the parent.

- ``resolve_branch``: the preflight's check of the branch point, before any compute: the
  checkpoint exists under the run's storage root, is committed and intact (every checksum), holds
  this model and tokenizer, and leaves room for the run's steps and decay; sets
  ``train.branch_sha256`` (the sha256 of its commit manifest).
- ``branch_point``: (checkpoint key, parent run, step) of a resolved branch, for the resume
  task and the ranks (a branch with no checkpoint of its own starts there).
- ``lineage``: what the run folder, `stoker runs`, the report and every export record of it.
"""

from __future__ import annotations

import hashlib

from pydantic import ValidationError

from stoker.arithmetic.mixture import effective_mix
from stoker.config import ConfigError, RunConfig
from stoker.config.problems import problem_lines
from stoker.storage.checkpoints import COMMIT_FILE, validate_checkpoint
from stoker.storage.layout import CheckpointLocation, parse_checkpoint_url
from stoker.storage.store import Store, join

LINEAGE_FILE = "lineage.json"


def checkpoint_location(store: Store, uri: str, field: str, verb: str) -> CheckpointLocation:
    """Where the checkpoint URI `uri` (named by config field or argument `field`) is, under
    `store`'s root; one ConfigError line otherwise (not a checkpoint URI, another root). `verb`:
    what the user does with it ("branch from", "soup"), for the fix."""
    try:
        where = parse_checkpoint_url(uri)
    except ConfigError:
        raise ConfigError(
            [
                f"{field}: {uri!r} is not a checkpoint URI ({{root}}/runs/{{run}}/checkpoints/step-NNNNNNNN); "
                "copy one from `stoker checkpoints RUN`"
            ]
        ) from None
    if Store(where.root, store.storage_options).root != store.root:
        raise ConfigError(
            [
                f"{field}: {uri!r} is under another storage root than this run's ({store.root}); {verb} a "
                "checkpoint under storage.root, or set storage.root to the parent's"
            ]
        )
    return where


def committed_checkpoint(
    store: Store, uri: str, field: str, verb: str, deep: bool = True
) -> tuple[CheckpointLocation, dict]:
    """(location, commit manifest) of the committed, intact checkpoint `uri` under `store`'s root
    (every file listed there at its recorded size; `deep`: every byte's sha256 too) before any
    compute; one ConfigError line otherwise (no such checkpoint, not committed, damaged). Shared
    by branches (not deep: the ranks verify the bytes as they read them, checkpoints.rehydrate)
    and soups (deep: the soup's process reads them here)."""
    where = checkpoint_location(store, uri, field, verb)
    if not store.exists(join(where.key, COMMIT_FILE)):
        reason = "no such checkpoint" if not store.exists(where.key) else "it is not committed (no commit manifest)"
        raise ConfigError(
            [
                f"{field}: {uri!r}: {reason}; {verb} a committed checkpoint that `stoker checkpoints {where.run_name}` lists"
            ]
        )
    verdict = validate_checkpoint(store, where.key, deep=deep)
    if not verdict:
        raise ConfigError([f"{field}: {uri!r} is not intact ({verdict.reason}); {verb} another of its checkpoints"])
    return where, verdict.manifest


def resolve_branch(cfg: RunConfig) -> RunConfig:
    """`cfg` with train.branch_sha256 set from its branch point; `cfg` itself without one. One
    ConfigError with every problem (a checkpoint missing, not committed, damaged, of another
    model or tokenizer; a run or decay that does not fit after the branch point)."""
    if not cfg.train.branch_from:
        return cfg
    store = Store(cfg.storage.root, cfg.storage.storage_options)
    uri = cfg.train.branch_from
    where = checkpoint_location(store, uri, "train.branch_from", "branch from")
    if where.run_name == cfg.resolved_run_name():
        raise ConfigError(
            [
                f"train.branch_from: {uri!r} is a checkpoint of this run; a branch is a run of its own: give another run_name"
            ]
        )
    # the manifest's sizes here, not every byte's hash on the flow's host (a 70B model's with its
    # optimizer state is ~1 TB): the ranks check each sha256 where they read the bytes
    where, manifest = committed_checkpoint(store, uri, "train.branch_from", "branch from", deep=False)
    problems = []
    if manifest.get("model_hash") != cfg.model_hash():
        problems.append(
            f"train.branch_from: {uri!r} holds another model or tokenizer than this config's (model_hash "
            f"{str(manifest.get('model_hash'))[:12]}, this config {cfg.model_hash()[:12]}); a branch may change the "
            "schedule, the data, the evaluation and the parallelism, not the model or tokenizer"
        )
    step, t = int(manifest["step"]), cfg.train
    if t.max_steps <= step:
        problems.append(
            f"train.max_steps: {t.max_steps} is not past the branch point (step {step} of {where.run_name!r}); "
            f"use more than {step}"
        )
    elif t.lr_schedule == "wsd" and t.decay_steps and t.decay_steps > t.max_steps - step:
        problems.append(
            f"train.decay_steps: {t.decay_steps} is longer than the {t.max_steps - step} steps left after the branch "
            f"point (step {step}, max_steps {t.max_steps}); use at most {t.max_steps - step}, or raise train.max_steps"
        )
    elif t.rewarm:
        room = t.max_steps - step - (t.decay_steps if t.lr_schedule == "wsd" else 0)
        if t.warmup_steps >= room:
            problems.append(
                f"train.warmup_steps: {t.warmup_steps} re-warm steps (train.rewarm) leave nothing after them: the "
                f"branch point is step {step} and {room} steps follow it before "
                f"{'the decay' if t.lr_schedule == 'wsd' else 'max_steps'}; use fewer than {room}, or raise "
                "train.max_steps"
            )
    if t.branch_step not in (None, step):
        problems.append(
            f"train.branch_step: {t.branch_step} is not the branch point's step ({step}); leave it empty: stoker "
            "reads it from train.branch_from"
        )
    before = _parent_config(cfg, where.run_name)
    if before is not None:
        problems += _data_position_problems(before, cfg, where.run_name)
    if t.branch_sha256 not in (None, sha256_of(store, where.key)):
        problems.append(
            f"train.branch_sha256: {uri!r} is no longer the checkpoint this branch was pinned to (its commit manifest "
            "changed); branch again under a new run_name"
        )
    if problems:
        raise ConfigError(problems)
    data = cfg.model_dump()
    data["train"]["branch_sha256"] = sha256_of(store, where.key)
    data["train"]["branch_step"] = step
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(problem_lines(err, RunConfig)) from None


def sha256_of(store: Store, key: str) -> str:
    """The sha256 of a checkpoint's commit manifest (it lists every file's checksum)."""
    return hashlib.sha256(store.read_bytes(join(key, COMMIT_FILE))).hexdigest()


def branch_point(cfg: RunConfig) -> tuple[str, str, int] | None:
    """(checkpoint key, parent run, step) of the config's branch point, or None."""
    if not cfg.train.branch_from:
        return None
    where = parse_checkpoint_url(cfg.train.branch_from)
    store = Store(cfg.storage.root, cfg.storage.storage_options)
    return where.key, where.run_name, int(store.read_json(join(where.key, COMMIT_FILE))["step"])


def lineage(cfg: RunConfig) -> dict | None:
    """{"parent", "step", "checkpoint", "sha256", "mixture"} of a branch, or None. "mixture":
    the parent's weights and schedule before the branch point (None for one source), with
    which the branch's data order goes on from its parent's data position."""
    point = branch_point(cfg)
    if point is None:
        return None
    key, parent, step = point
    out = {"parent": parent, "step": step, "checkpoint": cfg.train.branch_from, "sha256": cfg.train.branch_sha256}
    before = _parent_config(cfg, parent)
    if before is not None and before.data.is_mixture():
        store = Store(cfg.storage.root, cfg.storage.storage_options)
        # the parent's own mixture over its steps (itself perhaps a branch: its parent's before)
        weights, schedule = effective_mix(
            {s.name: s.weight for s in before.data.sources},
            [(e.at_step, e.weights) for e in before.data.schedule],
            mixture_history(store, parent),
        )
        out["mixture"] = {"step": step, "weights": weights, "schedule": [[s, w] for s, w in schedule if s < step]}
    return out


def _parent_config(cfg: RunConfig, parent: str) -> RunConfig | None:
    from stoker.storage.layout import CONFIG_FILE, run_file_key

    store = Store(cfg.storage.root, cfg.storage.storage_options)
    key = run_file_key(parent, CONFIG_FILE)
    return RunConfig.model_validate_json(store.read_bytes(key)) if store.exists(key) else None


def mixture_history(store: Store, run: str) -> dict | None:
    """A branch's mixture before its branch point (its lineage.json), or None."""
    from stoker.storage.layout import run_file_key

    key = run_file_key(run, LINEAGE_FILE)
    return store.read_json(key).get("mixture") if store.exists(key) else None


def lineage_chain(store: Store, run: str, limit: int = 64) -> list[dict]:
    """The run's ancestry from its lineage.json files, nearest first: [{"run", "parent", "step",
    "checkpoint", "sha256"}, ...]; [] for a run that is no branch."""
    from stoker.storage.layout import run_file_key

    chain: list[dict] = []
    seen = {run}
    while len(chain) < limit:
        key = run_file_key(run, LINEAGE_FILE)
        if not store.exists(key):
            break
        link = store.read_json(key)
        chain.append({"run": run, **link})
        run = link.get("parent")
        if not run or run in seen:
            break
        seen.add(run)
    return chain


def _data_position_problems(parent: RunConfig, cfg: RunConfig, name: str) -> list[str]:
    """A branch goes on from its parent's data position, a function of the seed, the global
    batch and the sources' weights over the steps: the seed and the global batch stay, the
    sources stay (reweighted as the branch likes)."""
    out = []
    for field in ("seed", "global_batch_size"):
        was, now = getattr(parent.train, field), getattr(cfg.train, field)
        if was != now:
            out.append(
                f"train.{field}: {now} is not the parent's ({was}); a branch goes on from run {name!r}'s data "
                f"position, which its {field} counts: keep {was}"
            )
    was_names = [s.name for s in parent.data.sources] if parent.data.is_mixture() else None
    now_names = [s.name for s in cfg.data.sources] if cfg.data.is_mixture() else None
    if sorted(was_names or []) != sorted(now_names or []) or (was_names is None) != (now_names is None):
        out.append(
            f"data.sources: a branch goes on from run {name!r}'s data position, so it keeps its sources "
            f"({', '.join(was_names) if was_names else 'data.source'}), reweighted as it likes; to add or drop one, "
            "start a run from the checkpoint's export as a base"
        )
    return out
