"""The run configuration: ``RunConfig``, the tree of every section, with the run's identity
(the hashes that name a run and its model, the resolved run name) and the rules that span
sections.

Rules that span sections run in one wrap validator on ``RunConfig`` that still runs when other
fields failed, so one pass reports every problem.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from stoker.config.checkpoint import CheckpointConfig
from stoker.config.data import DataConfig
from stoker.config.engine import EngineConfig
from stoker.config.eval import EvalConfig
from stoker.config.launch import LaunchConfig, RayConfig
from stoker.config.observe import CostConfig, EventsConfig, MetricsConfig
from stoker.config.problems import problem_lines
from stoker.config.storage import StorageConfig
from stoker.config.tokenizer import TokenizerConfig
from stoker.config.train import END_FIELDS, EXTENSIBLE, TrainConfig
from stoker.failures import ConfigError
from stoker.families import DEFAULT_FAMILY, FAMILIES, ModelConfig
from stoker.fields import _field, _rule, _Section


def base_location(init_from: str) -> str:
    """A base's location as one string: a local folder as its absolute file:// URL."""
    if "://" in init_from:
        return init_from.rstrip("/")
    return "file://" + os.path.abspath(os.path.expanduser(init_from))


BUILTIN_RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@functools.lru_cache(maxsize=None)
def _builtin_recipe(name: str) -> dict | None:
    """The built-in recipe `name` (stoker/recipes/NAME.yaml) as read, or None; shared: never
    changed by its readers."""
    import yaml

    path = BUILTIN_RECIPES / f"{name}.yaml"
    if not name or not path.is_file():
        return None
    data = yaml.safe_load(path.read_text()) or {}
    return data if isinstance(data, dict) else {}


def _builtin_recipe_section(name: str, section: str) -> dict | None:
    """A section of the built-in recipe `name` (a copy; {} where it has none), or None."""
    data = _builtin_recipe(name)
    if data is None:
        return None
    found = data.get(section)
    return dict(found) if isinstance(found, dict) else {}


def _builtin_recipe_model(name: str) -> dict | None:
    """The model section of the built-in recipe `name` (stoker/recipes/NAME.yaml), or None."""
    return _builtin_recipe_section(name, "model")


# what a recipe's model section may say that is the run's own choice, never the base's
_RUN_CHOICES = ("init_from", "block_size", "dropout", "attention")


def recipe_gives_way(data: Any, explicit: frozenset | set = frozenset()) -> Any:
    """`data` (raw config input) with the model fields that only a built-in recipe gave left
    to the base, when model.init_from names a base that recipe was not written for.

    A built-in recipe (the default tiny-cpu, or any of stoker/recipes) sizes its own model; a
    user who adds model.init_from to it (`stoker run --set model.init_from=./base`, a notebook's
    `load_config("tiny-cpu", **{"model.init_from": ...})`, the UI's form or a deployment's
    parameters, which carry the recipe's values and its name in `recipe`) means the base's
    model. So a model field whose value is the recipe's own gives way (model.family too); a
    value the user wrote (`explicit`: the dotted override keys under model, or any value that
    differs from the recipe's) stays and is checked against the base. Not once the base is read
    in (model.base_sha256 set): the config then says what the base is."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return data
    model = data["model"]
    recipe = _builtin_recipe_model(data.get("recipe") or "") if isinstance(data.get("recipe"), str) else None
    if not recipe or not model.get("init_from") or model.get("base_sha256"):
        return data
    if _written_for(recipe, model["init_from"]):
        return data  # the recipe was written for this base: its fields are checked against it
    kept = {k: v for k, v in model.items() if k in _RUN_CHOICES or k in explicit or k not in recipe or recipe[k] != v}
    return {**data, "model": kept} if len(kept) != len(model) else data


def _written_for(recipe_model: dict, init_from: Any) -> bool:
    """Whether a recipe's model section names the base `init_from` names (its values are made for it)."""
    own = recipe_model.get("init_from")
    return bool(own) and base_location(str(own)) == base_location(str(init_from))


_NOT_GIVEN = object()


def _train_fields_written(data: dict, explicit: frozenset | set) -> set[str]:
    """The train fields of raw config input (with a base) that are the user's: every one given,
    except, under a built-in recipe not written for this base, those equal to the recipe's value
    (or, where the recipe has none, to the field's default: a deployment's parameters carry every
    field) that the user did not write (`explicit`: the override keys, a recipe file of their own)."""
    train = data.get("train") or {}
    name = data.get("recipe")
    recipe = _builtin_recipe_model(name) if isinstance(name, str) else None
    if recipe is None or _written_for(recipe, data["model"]["init_from"]):
        return set(train)
    theirs = _builtin_recipe_section(name, "train") or {}
    defaults = {n: f.get_default(call_default_factory=True) for n, f in TrainConfig.model_fields.items()}
    return {k for k, v in train.items() if k in explicit or v != theirs.get(k, defaults.get(k, _NOT_GIVEN))}


def base_lr_default(data: Any, explicit: frozenset | set = frozenset()) -> Any:
    """`data` (raw config input) with train.lr_from_base decided, for a run from a base not yet
    read in (model.base_sha256 empty) that has not decided it: false where the config writes
    train.lr (``_train_fields_written``: a rate the user wrote always wins, and so does the rate of
    a built-in recipe written for this base); else true, with the continued-pretraining schedule
    where the config writes none of its own: lr_schedule 'wsd' (a re-warm and hold: trained longer
    as the same run, or annealed by a branch), decay_steps a fifth of max_steps (Hagele et al.
    2024: about 20% of the steps matches cosine) and min_lr 0 (a decay to zero). train.lr itself is
    set when the base's width is known (``arithmetic.learning_rate``, from
    ``storage.bases.resolve_base``); until then it holds the config's value, which the run's
    identity leaves out."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return data
    model, train = data["model"], data.get("train", {})
    if not isinstance(train, dict) or not model.get("init_from") or model.get("base_sha256"):
        return data
    if train.get("lr_from_base") is not None:
        return data
    written = _train_fields_written(data, explicit)
    if "lr" in written:
        return {**data, "train": {**train, "lr_from_base": False}}
    try:
        max_steps, warmup = _read(data, ("train", "max_steps")), _read(data, ("train", "warmup_steps"))
    except ValidationError:
        return data  # told as those fields' own problems
    chosen: dict[str, Any] = {"lr_from_base": True}
    if "lr_schedule" not in written:
        chosen["lr_schedule"] = "wsd"
    if "min_lr" not in written:
        chosen["min_lr"] = 0.0
    if "decay_steps" not in written and chosen.get("lr_schedule", train.get("lr_schedule")) == "wsd":
        chosen["decay_steps"] = max(1, min(max_steps // 5, max_steps - warmup))
    return {**data, "train": {**train, **chosen}}


# ---- rules that span sections --------------------------------------------------------------
def _batch_divides(
    global_batch_size: int, micro_batch_size: int, num_nodes: int, nproc_per_node: int, tp_degree: int = 1
) -> PydanticCustomError | None:
    world, size = num_nodes * nproc_per_node, "world_size"
    if tp_degree > 1 and world % tp_degree == 0:  # fsdp+tp: a group of tp_degree ranks takes one share
        world, size = world // tp_degree, f"world_size / engine.tp_degree ({world} / {tp_degree})"
    if micro_batch_size == "auto":  # some divisor of the per-rank share is picked at start-up
        if global_batch_size % world:
            return _rule(
                f"is not divisible by {size} = {world}, so the ranks cannot share it evenly",
                f"use a multiple of {world} (e.g. {world * max(1, global_batch_size // world)})",
            )
        return None
    per_pass = world * micro_batch_size
    if global_batch_size % per_pass:
        return _rule(
            f"is not divisible by {size} x micro_batch_size = {world} x {micro_batch_size} = {per_pass}",
            f"use a multiple of {per_pass} (e.g. {per_pass * max(1, global_batch_size // per_pass)})",
        )
    return None


def _tp_groups_within_a_node(parallelism: str, tp_degree: int, nproc_per_node: int) -> PydanticCustomError | None:
    if parallelism == "fsdp+tp" and tp_degree > 1 and nproc_per_node % tp_degree:
        fits = max(d for d in range(1, min(tp_degree, nproc_per_node) + 1) if nproc_per_node % d == 0)
        return _rule(
            f"does not divide launch.nproc_per_node={nproc_per_node}: the ranks of a tensor-parallel "
            "group must be on one node, and the groups must fill the world",
            f"use a divisor of {nproc_per_node}" + (f", e.g. {fits}" if fits > 1 else " above 1, or more ranks a node"),
        )
    return None


def _tp_family(parallelism: str, family: str | None) -> PydanticCustomError | None:
    section = FAMILIES.get(family) if isinstance(family, str) else None
    if parallelism == "fsdp+tp" and section is not None and not section.TENSOR_PARALLEL:
        planned = ", ".join(name for name, cls in FAMILIES.items() if cls.TENSOR_PARALLEL)
        return _rule(
            f"'fsdp+tp' has a tensor-parallel plan for the {planned} families only, and model.family is {family!r}",
            f"use 'fsdp' or 'ddp', or a model of the {planned} families",
        )
    return None


def _tp_splits_the_model(parallelism: str, tp_degree: int, model: Any) -> PydanticCustomError | None:
    """Each rank of a group holds 1/tp_degree of the sizes the family's plan splits
    (``tp_split_sizes``: the heads, the MLP, the sequence for the llama family)."""
    if parallelism != "fsdp+tp" or tp_degree < 2 or model is None:
        return None
    bad = [f"model.{n}={v}" for n, v in model.tp_split_sizes() if v is not None and v % tp_degree]
    if bad:
        return _rule(
            f"does not divide {', '.join(bad)}: each rank of a tensor-parallel group holds 1/tp_degree "
            "of the heads, of the MLP and of the sequence",
            "use a common divisor of those sizes (e.g. 2), or sizes that tp_degree divides",
        )
    return None


def _ep_fits(
    ep_degree: int, parallelism: str, model: Any, num_nodes: int, nproc_per_node: int
) -> PydanticCustomError | None:
    """Expert parallel splits a mixture's experts over groups of ep_degree ranks of the world."""
    if ep_degree < 2 or model is None:
        return None
    experts = getattr(model, "num_experts", None)
    if not getattr(type(model), "MOE", False):
        return _rule(
            f"is {ep_degree}, and model.family {model.family!r} has no experts to split (a dense model)",
            "set engine.ep_degree to 1, or start from a mixture-of-experts base (qwen3_moe, mixtral)",
        )
    if parallelism != "fsdp":
        return _rule(
            f"splits the experts under engine.parallelism 'fsdp' only, not {parallelism!r}",
            "set engine.parallelism to 'fsdp', or engine.ep_degree to 1",
        )
    world = num_nodes * nproc_per_node
    if world % ep_degree:
        return _rule(
            f"does not divide the world size {world} (launch.num_nodes x launch.nproc_per_node)",
            "use a divisor of the world size, or more ranks",
        )
    if experts and experts % ep_degree:
        return _rule(
            f"does not divide model.num_experts={experts}: each rank of a group holds num_experts / ep_degree experts",
            "use a divisor of model.num_experts",
        )
    return None


def _schedule_within_the_run(schedule: list, max_steps: int) -> PydanticCustomError | None:
    late = [e.at_step for e in schedule if (e.at_step if hasattr(e, "at_step") else e.get("at_step", 0)) >= max_steps]
    if late:
        return _rule(
            f"changes the weights at step {late[0]}, but the run ends at train.max_steps={max_steps}",
            f"use at_step below {max_steps}, or raise train.max_steps",
        )
    return None


def _lr_from_a_base(lr_from_base: bool | None, init_from: str | None) -> PydanticCustomError | None:
    if lr_from_base and not init_from:
        return _rule(
            "is true, and the run starts from no base (model.init_from is empty)",
            "leave it empty, and write train.lr to choose the rate",
        )
    return None


def _ids_fit_dtype(token_dtype: str, vocab_size: int) -> PydanticCustomError | None:
    if token_dtype == "uint16" and vocab_size > 65536:
        return _rule(
            f"uint16 holds token ids below 65536, and tokenizer.vocab_size is {vocab_size}",
            "use 'uint32' or 'auto', or a vocabulary of at most 65536",
        )
    return None


def _something_to_decontaminate_against(
    decontaminate: bool, sources: list, sets: list, harness_tasks: list
) -> PydanticCustomError | None:
    """Decontamination asked for (true, not left empty) with nothing to check against."""
    per_source = [
        s.decontaminate if hasattr(s, "decontaminate") else (s or {}).get("decontaminate") for s in sources or []
    ]
    asked = any((decontaminate if d is None else d) is True for d in per_source) or decontaminate is True
    if asked and "multiple_choice" not in (sets or []) and not harness_tasks:
        return _rule(
            "is true, and the run scores no evaluation set to check the training data against "
            "(eval.sets has no 'multiple_choice', eval.harness_tasks is empty)",
            "set data.decontaminate false, or add an evaluation set",
        )
    return None


_Loc = tuple[str, str]
# (the field a rule reports on, the fields it reads in order of its arguments, the rule)
_CROSS_SECTION_RULES: list[tuple[_Loc, tuple[_Loc, ...], Callable[..., Any]]] = [
    (
        ("train", "global_batch_size"),
        (
            ("train", "global_batch_size"),
            ("train", "micro_batch_size"),
            ("launch", "num_nodes"),
            ("launch", "nproc_per_node"),
            ("engine", "tp_degree"),
        ),
        _batch_divides,
    ),
    (
        ("engine", "tp_degree"),
        (("engine", "parallelism"), ("engine", "tp_degree"), ("launch", "nproc_per_node")),
        _tp_groups_within_a_node,
    ),
    (("engine", "parallelism"), (("engine", "parallelism"), ("model", "family")), _tp_family),
    (
        ("engine", "tp_degree"),
        (
            ("engine", "parallelism"),
            ("engine", "tp_degree"),
            ("model", ""),  # the whole section: its family says which sizes the split divides
        ),
        _tp_splits_the_model,
    ),
    (
        ("engine", "ep_degree"),
        (
            ("engine", "ep_degree"),
            ("engine", "parallelism"),
            ("model", ""),
            ("launch", "num_nodes"),
            ("launch", "nproc_per_node"),
        ),
        _ep_fits,
    ),
    (("train", "lr_from_base"), (("train", "lr_from_base"), ("model", "init_from")), _lr_from_a_base),
    (("data", "token_dtype"), (("data", "token_dtype"), ("tokenizer", "vocab_size")), _ids_fit_dtype),
    (("data", "schedule"), (("data", "schedule"), ("train", "max_steps")), _schedule_within_the_run),
    (
        ("data", "decontaminate"),
        (("data", "decontaminate"), ("data", "sources"), ("eval", "sets"), ("eval", "harness_tasks")),
        _something_to_decontaminate_against,
    ),
]


def _overlaps(loc: tuple, path: tuple) -> bool:
    """Whether an error at ``loc`` (a field, a section, or the whole input) touches ``path``."""
    n = min(len(loc), len(path))
    return tuple(loc[:n]) == tuple(path[:n])


def _read(source: Any, path: _Loc) -> Any:
    """A field's value from a RunConfig, or from raw input (a field that failed nowhere
    validates alone to the same value; one that is absent is its default)."""
    section_name, name = path
    section = source.get(section_name) if isinstance(source, dict) else getattr(source, section_name, None)
    if section_name == "model":  # a union on model.family: None for a field of another family
        if not isinstance(section, BaseModel):
            try:  # validated whole; a section that fails is reported on its own
                section = TypeAdapter(RunConfig.model_fields["model"].annotation).validate_python(
                    section if section is not None else {}
                )
            except ValidationError:
                return None
        return getattr(section, name, None) if name else section
    if isinstance(section, BaseModel):
        return getattr(section, name)
    field = RunConfig.model_fields[section_name].annotation.model_fields[name]
    if not isinstance(section, dict) or name not in section:
        return field.get_default(call_default_factory=True)
    return TypeAdapter(field.annotation).validate_python(section[name])


class RunConfig(_Section):
    """Everything a pretraining run needs, in one tree."""

    run_name: str | None = _field(
        None,
        "Name of the run folder. Empty: derived from the config, so the same config resumes the same run.",
        fix="use letters, digits, '.', '_' or '-' (max 128), starting with a letter or digit",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
    )
    recipe: str | None = _field(
        None,
        "The recipe this config started from (load_config sets it from the recipe's name or "
        "file). Informational: it tags the run's flow runs and is no part of the run's identity.",
        fix="use letters, digits, '.', '_' or '-'",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Raw data source and split.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer.")
    model: ModelConfig = Field(
        default_factory=lambda: FAMILIES[DEFAULT_FAMILY](),
        description="The model: its family, its size, and the base it starts from.",
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimization.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation during training.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="How ranks are started.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="Precision, compilation and parallelism of the ranks."
    )
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Object store.")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="TensorBoard and MLflow sinks of the run's metrics."
    )
    ray: RayConfig = Field(
        default_factory=RayConfig, description="The Ray cluster of launch.launcher 'ray' and data.engine 'ray'."
    )
    cost: CostConfig = Field(
        default_factory=CostConfig, description="The accelerators' price, for the goodput and cost ledger."
    )
    events: EventsConfig = Field(
        default_factory=EventsConfig,
        description="Prefect events of the run (checkpoints, heartbeats, stalls, failures) and the stalled-run automation.",
    )

    # ---- derived facts -------------------------------------------------------------
    @property
    def grad_accum_steps(self) -> int:
        if self.train.micro_batch_size == "auto":
            raise ValueError("train.micro_batch_size 'auto' has no accumulation until a rank picks its value")
        return self.train.global_batch_size // (self.data_parallel_size * self.train.micro_batch_size)

    @property
    def data_parallel_size(self) -> int:
        """The replicas the global batch is split over: the world, or under engine.parallelism
        'fsdp+tp' its groups of engine.tp_degree ranks (each group reads the same batches)."""
        return self.launch.world_size // self.engine.tp_degree

    def identity_hash(self) -> str:
        """Hash of what determines the run's trajectory: not where it is stored, how it is
        launched or computed, nor how the global batch is split (world size, micro-batch),
        since every step trains on the same sequences at any split. A run may resume with
        any of those changed. With a base (model.init_from), what its files fix (the
        architecture, the tokenizer, their hash) is named by the base's location alone, so a
        config names the same run before and after its base is read in; another base's bytes
        at that location are refused by the run folder (storage.runs.pin_run_folder)."""
        payload = self.model_dump(
            mode="json",
            exclude={
                "run_name": True,
                "recipe": True,
                "storage": True,
                "launch": True,
                "engine": True,
                "metrics": True,
                "ray": True,
                "cost": True,
                "events": True,
                "data": {"num_workers", "engine"},
                "train": {"micro_batch_size"},
                "eval": {"sets", "multiple_choice_items"},  # what a checkpoint's evaluation measures
            },
        )
        # a schedule whose past does not depend on its end (wsd, constant): trained longer, or
        # with another decay, it is the same run going on (config.train, arithmetic.schedule)
        if self.train.lr_schedule in EXTENSIBLE:
            for name in END_FIELDS:
                payload["train"].pop(name, None)
        # fields added since runs were first named: at their old behaviour they name no new run
        payload["train"].pop("branch_sha256", None)  # a branch is named by its URI (runs.pin_run_folder pins its bytes)
        payload["train"].pop("branch_step", None)  # and its step is the URI's checkpoint's
        if payload["train"].get("lr_from_base") and getattr(self.model, "init_from", None):
            # the rate is the base's (arithmetic.learning_rate, of its width): named by the base's
            # location, as its architecture is, so a config names one run before and after it is read
            payload["train"].pop("lr", None)
        else:
            payload["train"].pop("lr_from_base", None)
        for name, old in (
            ("lr_schedule", "cosine"),
            ("decay_steps", None),
            ("decay_shape", "linear"),
            ("warmup_from", 0.0),
            ("branch_from", None),
            ("rewarm", False),
        ):
            if name in payload["train"] and payload["train"][name] == old:
                payload["train"].pop(name)
        if payload["model"].get("attention") == "causal":
            payload["model"].pop("attention")
        if payload["tokenizer"].get("document_end") is None:
            payload["tokenizer"].pop("document_end", None)
        if getattr(self.model, "init_from", None):
            model = payload["model"]
            for name in (*type(self.model).FROM_BASE, "base_sha256", "family", "vocab_pad_multiple"):
                model.pop(name, None)
            model["init_from"] = base_location(model["init_from"])
            for name in ("path", "eot_token", "vocab_size"):
                payload["tokenizer"].pop(name, None)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def model_hash(self) -> str:
        """Hash of what must match for a checkpoint to load into this model."""
        # not the attention: the same weights load under either masking
        payload = {
            "model": self.model.model_dump(mode="json", exclude={"attention"}),
            "vocab": self.tokenizer.vocab_size,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def resolved_run_name(self) -> str:
        return self.run_name or f"run-{self.identity_hash()[:10]}"

    # ---- validation ----------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _recipe_gives_way_to_a_base(cls, data: Any, info: ValidationInfo) -> Any:
        context = info.context or {}
        data = recipe_gives_way(data, context.get("explicit_model_fields", frozenset()))
        return base_lr_default(data, context.get("explicit_train_fields", frozenset()))

    @model_validator(mode="wrap")
    @classmethod
    def _cross_section_rules(cls, data: Any, handler: Callable[[Any], RunConfig]) -> RunConfig:
        """Run the rules that span sections even when other fields failed, and raise their
        problems together with the others: an after-validator would be skipped whenever any
        field failed. A rule is skipped only when a field it reads failed itself."""
        failed: ValidationError | None = None
        try:
            cfg = handler(data)
            errors: list[Any] = []
        except ValidationError as err:
            failed, errors = err, err.errors()
        source = data if failed else cfg
        found = []
        for target, reads, check in _CROSS_SECTION_RULES:
            if any(_overlaps(e["loc"], path) for e in errors for path in reads):
                continue
            problem = check(*(_read(source, path) for path in reads))
            if problem is not None:
                found.append({"type": problem, "loc": target, "input": _read(source, target)})
        if not found:
            if failed:
                raise failed
            return cfg
        line_errors = [
            {"type": PydanticCustomError(e["type"], e["msg"], e.get("ctx")), "loc": e["loc"], "input": e["input"]}
            for e in errors
        ]
        raise ValidationError.from_exception_data(cls.__name__, line_errors + found)

    def check(self) -> "RunConfig":
        """Re-validate every rule of the model (not the local files: see
        local_resource_problems); raise one ConfigError listing every problem, else return self."""
        try:
            type(self).model_validate(self.model_dump())
        except ValidationError as err:
            raise ConfigError(problem_lines(err, type(self))) from None
        return self

    # ---- (de)serialization ---------------------------------------------------------
    def to_json(self) -> str:
        return self.model_dump_json(indent=2)
