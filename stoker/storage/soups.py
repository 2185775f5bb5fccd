"""Soups: committed checkpoints of runs or branches of one model, averaged (uniform unless
weighted) into the first checkpoint of a new run, which never writes its inputs.

- ``resolve_soup``: every check before any compute, each mistake one line: two inputs at least,
  weights (as many as the inputs, none negative, summing to 1), each input committed and intact
  (every checksum: storage.branches.committed_checkpoint, the branch point's own check), one
  architecture, one tokenizer and one vocabulary, a run's own window (``--last K``, ``--steps
  a..b``) of one phase (never across a decay unless asked), the soup's run name free or this
  soup's. Returns a ``SoupPlan``: the inputs pinned by their commit manifests' sha256, the
  soup's identity and its config (its lead's: the newest input's).
- ``pin_soup_folder``: the soup run's folder (config.json, lineage.json, the tokenizer,
  shards.json, a base's files), as pin_run_folder does for a trained run.
- ``soup_checkpoint``: the soup's committed checkpoint when this very soup was made already.

What a soup carries: the weighted average of each input's model tensors and of its AdamW
moments (exp_avg, exp_avg_sq), in fp32, cast back to the stored dtype; from its lead (the input
with the highest step, the first of them on a tie) the step, tokens seen, the optimizer's step
counters, the scheduler and RNG state. A run continued from it is a branch from its checkpoint
(train.branch_from): it goes on from the lead's step and data position with the averaged state.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field

from pydantic import ValidationError

from stoker.config import ConfigError, RunConfig
from stoker.config.problems import problem_lines
from stoker.storage.branches import LINEAGE_FILE, committed_checkpoint, sha256_of
from stoker.storage.checkpoints import list_checkpoints, validate_checkpoint
from stoker.storage.layout import BASE_DIR, CONFIG_FILE, SHARDS_FILE, TOKENIZER_FILE, run_file_key, run_key
from stoker.storage.store import Store, join

SOUP_FORMAT = 1  # bump when what a soup computes changes: another identity, computed anew
WEIGHT_TOLERANCE = 1e-6
_STEPS = re.compile(r"^(\d+)\.\.(\d+)$")


@dataclass(frozen=True)
class SoupInput:
    """One ingredient: a committed checkpoint, pinned by its commit manifest's sha256."""

    checkpoint: str  # its URI
    key: str  # under the store root
    run: str
    step: int
    sha256: str
    weight: float


@dataclass(frozen=True)
class SoupPlan:
    """A checked soup: where, its inputs and weights, its identity, its run and config."""

    root: str
    storage_options: dict
    run_name: str
    soup_id: str
    inputs: list[SoupInput]
    lead: int  # the input whose step, data position, scheduler and RNG the soup carries
    config: RunConfig = field(repr=False)
    lead_manifest: dict = field(repr=False, default_factory=dict)

    @property
    def step(self) -> int:
        return self.inputs[self.lead].step

    def lineage(self) -> dict:
        """lineage.json of the soup run: its lead as "parent" (where `stoker runs` draws it and
        where its base is found), and every input with its weight under "soup"."""
        lead = self.inputs[self.lead]
        return {
            "parent": lead.run,
            "step": lead.step,
            "checkpoint": lead.checkpoint,
            "sha256": lead.sha256,
            "soup": {"id": self.soup_id, "inputs": [_public(i) for i in self.inputs]},
        }

    def commit_meta(self) -> dict:
        """The soup checkpoint's manifest fields besides files and numerics: the lead's identity
        fields under the soup's run name, and the soup."""
        lead = self.lead_manifest
        kept = ("model_hash", "model_family", "base_sha256", "shard_key", "schedule", "tokens_seen")
        return {
            **{k: lead.get(k) for k in kept},
            "step": self.step,
            "config_hash": self.config.identity_hash(),
            "run_name": self.run_name,
            "soup": {"id": self.soup_id, "inputs": [_public(i) for i in self.inputs]},
        }

    def to_json(self) -> str:
        """What the soup process (training.soup_main) reads."""
        return json.dumps(
            {
                "root": self.root,
                "storage_options": self.storage_options,
                "run_name": self.run_name,
                "soup_id": self.soup_id,
                "inputs": [asdict(i) for i in self.inputs],
                "lead": self.lead,
                "meta": self.commit_meta(),
            }
        )


def _public(i: SoupInput) -> dict:
    return {"run": i.run, "step": i.step, "checkpoint": i.checkpoint, "sha256": i.sha256, "weight": i.weight}


def soup_identity(inputs: list[SoupInput]) -> str:
    """A pure function of each input's (run, step, commit-manifest sha256) and its weight."""
    payload = {"format": SOUP_FORMAT, "inputs": [[i.run, i.step, i.sha256, repr(float(i.weight))] for i in inputs]}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def weight_problems(weights: list[float] | None, count: int) -> list[str]:
    """One line per problem of --weights against `count` inputs."""
    if weights is None:
        return []
    if len(weights) != count:
        return [f"--weights: {len(weights)} weight(s) for {count} checkpoints; give one weight per checkpoint"]
    out = []
    bad = [w for w in weights if not math.isfinite(w) or w < 0]
    if bad:
        out.append(f"--weights: {', '.join(map(str, bad))} is negative or not a number; give weights >= 0")
    elif abs(sum(weights) - 1.0) > WEIGHT_TOLERANCE:
        out.append(f"--weights: they sum to {sum(weights):g}, not 1; e.g. {', '.join(_normalized(weights))}")
    return out


def _normalized(weights: list[float]) -> list[str]:
    total = sum(weights) or 1.0
    return [f"{w / total:.4g}" for w in weights]


def run_window(store: Store, run: str, last: int | None, steps: str | None, across_decay: bool = False) -> list[str]:
    """The URIs of a run's own committed checkpoints to average, oldest first: its newest `last`,
    or those whose step lies in `steps` ('a..b'). One ConfigError line when the window is bad:
    no such run, fewer than two checkpoints, or one that spans a decay (a checkpoint in it lies
    past the stable part of the schedule it was trained under) unless `across_decay`."""
    if (last is None) == (steps is None):
        raise ConfigError([f"{run}: give --last K or --steps a..b to soup a run's own checkpoints, or checkpoint URIs"])
    if not store.exists(run_key(run)):
        raise ConfigError([f"{run}: no run of that name under {store.root}; see `stoker runs`"])
    committed = [
        (ref, v.manifest) for ref in list_checkpoints(store, run) if (v := validate_checkpoint(store, ref.key))
    ]
    if last is not None:
        if last < 2:
            raise ConfigError([f"--last: {last}; a soup averages two checkpoints at least"])
        window = committed[:last]
        what = f"its newest {last}"
    else:
        m = _STEPS.match(steps.strip())
        if not m or int(m.group(1)) > int(m.group(2)):
            raise ConfigError([f"--steps: {steps!r} is not a range a..b of steps (a <= b), e.g. --steps 200..400"])
        lo, hi = int(m.group(1)), int(m.group(2))
        window = [(r, man) for r, man in committed if lo <= r.step <= hi]
        what = f"steps {lo}..{hi}"
    window = sorted(window, key=lambda x: (x[0].step, x[0].attempt))
    if len(window) < 2:
        have = ", ".join(str(r.step) for r, _ in committed) or "none"
        raise ConfigError(
            [f"{run}: {what} hold(s) {len(window)} committed checkpoint(s) (committed: steps {have}); a soup needs two"]
        )
    decayed = [r.step for r, man in window if r.step > int((man.get("schedule") or {}).get("stable_until", r.step))]
    if decayed and not across_decay:
        stable = int((window[-1][1].get("schedule") or {}).get("stable_until", 0))
        raise ConfigError(
            [
                f"{run}: the window (steps {window[0][0].step}..{window[-1][0].step}) spans a decay: step(s) "
                f"{', '.join(map(str, decayed))} lie past the stable part (to step {stable}), where averaging mixes "
                f"weights of different learning rates; take steps up to {stable} (--steps a..{stable}), or pass "
                "--across-decay"
            ]
        )
    return [r.url for r, _ in window]


def resolve_soup(
    checkpoints: list[str],
    weights: list[float] | None = None,
    run_name: str | None = None,
    *,
    root: str | None = None,
    storage_options: dict | None = None,
    last: int | None = None,
    steps: str | None = None,
    across_decay: bool = False,
) -> SoupPlan:
    """Every check of a soup before any compute (see the module docstring); ConfigError with
    one line per problem. `checkpoints`: checkpoint URIs, or one run's name with `last` or
    `steps` (its store: `root`)."""
    options = dict(storage_options or {})
    if last is not None or steps is not None:
        if len(checkpoints) != 1 or "/checkpoints/" in checkpoints[0]:
            raise ConfigError(["--last/--steps: name one run (stoker soup RUN --last K), not checkpoint URIs"])
        if root is None:
            from stoker.config import default_root

            root = default_root()
        checkpoints = run_window(Store(root, options), checkpoints[0], last, steps, across_decay)
    if len(checkpoints) < 2:
        raise ConfigError(
            [f"checkpoints: {len(checkpoints)} given; a soup averages two checkpoints at least (or RUN --last K)"]
        )
    problems = weight_problems(weights, len(checkpoints))
    if problems:
        raise ConfigError(problems)
    from stoker.storage.layout import parse_checkpoint_url

    try:
        store = Store(parse_checkpoint_url(checkpoints[0]).root, options)
    except ConfigError:
        raise ConfigError([f"checkpoints[0]: {checkpoints[0]!r} is not a checkpoint URI"]) from None
    weights = list(weights) if weights is not None else [1.0 / len(checkpoints)] * len(checkpoints)
    inputs, manifests, configs = [], [], []
    for i, (uri, weight) in enumerate(zip(checkpoints, weights)):
        try:
            where, manifest = committed_checkpoint(store, uri, f"checkpoints[{i}]", "soup")
            config = RunConfig.model_validate_json(store.read_bytes(run_file_key(where.run_name, CONFIG_FILE)))
        except ConfigError as err:
            problems += err.problems
            continue
        except FileNotFoundError:
            problems.append(f"checkpoints[{i}]: {uri!r} is in no run folder (no {CONFIG_FILE}); check the URI")
            continue
        inputs.append(
            SoupInput(
                store.url(where.key),
                where.key,
                where.run_name,
                int(manifest["step"]),
                sha256_of(store, where.key),
                weight,
            )
        )
        manifests.append(manifest)
        configs.append(config)
    if problems:
        raise ConfigError(problems)
    problems = _same_model_problems(store, inputs, manifests)
    if problems:
        raise ConfigError(problems)
    lead = max(range(len(inputs)), key=lambda i: (inputs[i].step, -i))
    soup_id = soup_identity(inputs)
    name = run_name or f"soup-{soup_id[:12]}"
    config = _soup_config(configs[lead], name, store, options)
    plan = SoupPlan(store.root, options, name, soup_id, inputs, lead, config, manifests[lead])
    problem = _run_name_problem(store, plan)
    if problem:
        raise ConfigError([problem])
    return plan


def _same_model_problems(store: Store, inputs: list[SoupInput], manifests: list[dict]) -> list[str]:
    """One line per input whose architecture, tokenizer or vocabulary is not the first's."""
    first, out = inputs[0], []

    def tokenizer_hash(run: str) -> str | None:
        key = run_file_key(run, TOKENIZER_FILE)
        return hashlib.sha256(store.read_bytes(key)).hexdigest() if store.exists(key) else None

    def vocab(run: str):
        key = run_file_key(run, SHARDS_FILE)
        return store.read_json(key).get("vocab_size") if store.exists(key) else None

    tok0, vocab0 = tokenizer_hash(first.run), vocab(first.run)
    for i, (one, manifest) in enumerate(zip(inputs[1:], manifests[1:]), start=1):
        if manifest.get("model_hash") != manifests[0].get("model_hash"):
            out.append(
                f"checkpoints[{i}]: {one.checkpoint!r} holds another architecture than checkpoints[0] (model_hash "
                f"{str(manifest.get('model_hash'))[:12]}, not {str(manifests[0].get('model_hash'))[:12]}); a soup "
                "averages checkpoints of one model: soup branches of one run"
            )
        elif vocab(one.run) != vocab0:
            out.append(
                f"checkpoints[{i}]: run {one.run!r} has a vocabulary of {vocab(one.run)} ids, not {vocab0} as "
                f"run {first.run!r}; soup runs of one tokenizer"
            )
        elif tokenizer_hash(one.run) != tok0:
            out.append(
                f"checkpoints[{i}]: run {one.run!r} has another tokenizer than run {first.run!r} (its tokenizer.json "
                "differs); the same token ids would mean other text: soup runs of one tokenizer"
            )
    return out


def _soup_config(lead: RunConfig, name: str, store: Store, options: dict) -> RunConfig:
    """The lead's config under the soup's run name and store, no branch point of its own."""
    data = lead.model_dump()
    data["run_name"] = name
    data["train"].update(branch_from=None, branch_sha256=None, branch_step=None, rewarm=False)
    data["storage"].update(root=store.root, storage_options=options)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(problem_lines(err, RunConfig)) from None


def _run_name_problem(store: Store, plan: SoupPlan) -> str:
    """'' when the soup's run folder is new or holds this very soup."""
    run = plan.run_name
    if run in {i.run for i in plan.inputs}:
        return f"--run-name: {run!r} is one of the soup's inputs; a soup is a run of its own: give another name"
    key = run_file_key(run, LINEAGE_FILE)
    if store.exists(key):
        was = (store.read_json(key).get("soup") or {}).get("id")
        if was == plan.soup_id:
            return ""
        what = f"soup {was[:12]} of other inputs or weights" if was else "a branch"
        return f"--run-name: run {run!r} is {what}; a soup keeps its inputs: choose a new run name"
    if store.exists(run_file_key(run, CONFIG_FILE)):
        return f"--run-name: run {run!r} exists and is no soup; choose a new run name"
    return ""


def pin_soup_folder(store: Store, plan: SoupPlan) -> str:
    """Write the soup run's folder: lineage.json (its identity) first, then the lead's
    tokenizer, shards.json and base files, and config.json; return the config URL."""
    run, lead = plan.run_name, plan.inputs[plan.lead].run
    lineage_key = run_file_key(run, LINEAGE_FILE)
    if not store.exists(lineage_key):
        store.write_json(lineage_key, plan.lineage())
    for name in (TOKENIZER_FILE, SHARDS_FILE):
        if store.exists(run_file_key(lead, name)):
            store.copy(run_file_key(lead, name), run_file_key(run, name))
    base = run_file_key(lead, BASE_DIR)
    if store.exists(base):
        for name in store.listdir(base):
            store.copy(join(base, name), run_file_key(run, f"{BASE_DIR}/{name}"))
    key = run_file_key(run, CONFIG_FILE)
    store.write_bytes(key, plan.config.to_json().encode())
    return store.url(key)


def soup_checkpoint(store: Store, plan: SoupPlan) -> str | None:
    """The key of the soup run's committed checkpoint of this soup (its manifest names the
    soup's identity), or None: the same soup twice is computed once."""
    for ref in list_checkpoints(store, plan.run_name):
        verdict = validate_checkpoint(store, ref.key)
        if verdict and (verdict.manifest.get("soup") or {}).get("id") == plan.soup_id:
            return ref.key
    return None


def soup_of(lineage: dict) -> str | None:
    """`stoker runs`' words for a soup's inputs: 'a@8 x0.5 + b@8 x0.5'; None for no soup."""
    soup = lineage.get("soup") if isinstance(lineage, dict) else None
    if not soup:
        return None
    return " + ".join(f"{i['run']}@{i['step']} x{i['weight']:.3g}" for i in soup.get("inputs", []))
