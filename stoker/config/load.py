"""Building a checked RunConfig: from a recipe (the YAML files of ``stoker/recipes``), a
YAML/JSON file, a dict or a model, with ``--set``-style dotted overrides; what only this host
can check of it (the local files it names, the optional packages it needs); and the table of
every field (`stoker config --list`).
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from stoker.config.data import DataConfig
from stoker.config.launch import LaunchConfig
from stoker.config.observe import MetricsConfig
from stoker.config.problems import field_range, problem_line
from stoker.config.run import BUILTIN_RECIPES, RunConfig, _overlaps, _read
from stoker.config.tokenizer import TokenizerConfig
from stoker.failures import ConfigError

RECIPES_DIR = BUILTIN_RECIPES


def field_table() -> list[dict]:
    """Every key of the config: dotted name, type, default and description (`stoker config
    --list`, the README)."""
    import typing

    def type_name(ann: Any) -> str:
        if typing.get_origin(ann) is Literal:
            return " | ".join(repr(a) for a in typing.get_args(ann))
        text = getattr(ann, "__name__", None) or str(ann)
        return text.replace("typing.", "").replace(f"{DataConfig.__module__}.", "")  # the sections' module

    from stoker.config.problems import _models_in

    rows = []
    for section, sfield in RunConfig.model_fields.items():
        models = _models_in(sfield.annotation)
        if not models:
            rows.append(
                {
                    "key": section,
                    "type": type_name(sfield.annotation),
                    "default": sfield.get_default(call_default_factory=True),
                    "description": sfield.description or "",
                }
            )
            continue
        seen: dict[str, dict] = {}
        for model in models:  # a union of sections (model: one per family): each field once
            family = model.model_fields["family"].default if len(models) > 1 else None
            for name, f in model.model_fields.items():
                if name in seen:
                    if family and seen[name].get("families") is not None:
                        seen[name]["families"].append(family)
                    continue
                bounds = field_range(f)
                seen[name] = {
                    "key": f"{section}.{name}",
                    "type": type_name(f.annotation) + (f" ({bounds})" if bounds else ""),
                    "default": f.get_default(call_default_factory=True),
                    "description": f.description or "",
                    "families": [family] if family and name != "family" else None,
                    "annotation": f.annotation,
                }
        if "family" in seen and len(models) > 1:  # the union's tag first, with every family
            seen["family"]["type"] = " | ".join(repr(m.model_fields["family"].default) for m in models)
            seen = {"family": seen.pop("family"), **seen}
        for row in seen.values():
            families = row.pop("families")
            if families and len(families) < len(models):
                row["description"] = f"[{', '.join(families)}] " + row["description"]
            rows.append(row)
            rows += _item_rows(row["key"], row.pop("annotation"), type_name)
    return rows


def _item_rows(key: str, annotation: Any, type_name) -> list[dict]:
    """The fields of a list of sections (data.sources[].weight, data.schedule[].at_step)."""
    import typing

    args = typing.get_args(annotation) if typing.get_origin(annotation) is list else ()
    if not args or not (isinstance(args[0], type) and issubclass(args[0], BaseModel)):
        return []
    out = []
    for name, f in args[0].model_fields.items():
        bounds = field_range(f)
        out.append(
            {
                "key": f"{key}[].{name}",
                "type": type_name(f.annotation) + (f" ({bounds})" if bounds else ""),
                "default": "(required)" if f.is_required() else f.get_default(call_default_factory=True),
                "description": f.description or "",
            }
        )
    return out


# ---- what only this host can check ---------------------------------------------------------
def _holds_a_file(pattern: str) -> bool:
    """Whether a local glob matches a file, or a folder holding one; stops at the first."""
    for match in glob.iglob(pattern):
        if os.path.isfile(match):
            return True
        for _, _, files in os.walk(match):
            if files:
                return True
    return False


# the module each metric sink needs (the 'metrics' extra), by the field that asks for it
_SINK_MODULES = {"tensorboard_enabled": "tensorboard", "mlflow_tracking_uri": "mlflow"}


def _installed(module: str) -> bool:
    """Whether `module` can be imported here (found, not imported: no cost)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or an import blocked
        return False


def missing_sink_packages(metrics: MetricsConfig) -> list[str]:
    """A problem line for each metric sink asked for whose package this host lacks."""
    return [
        f"metrics.{field}: needs the {module!r} package, which is not installed here; pip "
        "install 'stoker[metrics]', or turn the sink off."
        for field, module in _SINK_MODULES.items()
        if getattr(metrics, field, None) and not _installed(module)
    ]


def local_resource_problems(cfg: RunConfig) -> list[str]:
    """Problems with the local files the config names (the data source and the tokenizer), and
    metric sinks whose packages (the 'metrics' extra) are not installed on this host.

    Kept out of the model on purpose: every rank re-validates config.json on its own host,
    where these paths need not exist (and re-globbing the source on each would be waste).
    ``load_config`` and the flow's validate task call it on the host that reads the data.
    """
    out = []
    # every source of a mixture, before any of them is downloaded
    sources = [(f"data.sources[{s.name}].source", s.source) for s in cfg.data.sources or []]
    for field, given in sources or [("data.source", cfg.data.source)]:
        out += _source_problems(field, given)
    path = cfg.tokenizer.path
    if path and "://" not in path and not Path(path).expanduser().is_file():
        out.append(f"tokenizer.path: {path!r} is not a file; give a tokenizer.json or leave it empty to train one.")
    return out + missing_sink_packages(cfg.metrics) + missing_ray(cfg)


def _source_problems(field: str, given: str | None) -> list[str]:
    """A local source (a file, folder or glob) that holds no file, or a local dataset folder
    that is not there: known on this host before anything is downloaded."""
    source = (given or "").strip()
    if source.startswith("hf:"):
        name = source[3:].strip()
        if name.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(name)):
            return [
                f"{field}: no local dataset folder {name!r}; give an existing folder "
                "or a Hub name such as 'hf:wikitext'."
            ]
    elif source and not source.startswith("builtin:") and ("://" not in source or source.startswith("file://")):
        if not _holds_a_file(os.path.expanduser(source.removeprefix("file://"))):
            return [
                f"{field}: no file matches {given!r}; give an existing file, folder or glob "
                "holding text, or use 'builtin:stdlib'."
            ]
    return []


def missing_ray(cfg: RunConfig) -> list[str]:
    """The fields that choose Ray, when Ray is not installed on this host."""
    import importlib.util

    chosen = [
        name
        for name, value in (
            ("launch.launcher", getattr(cfg.launch, "launcher", "local")),
            ("data.engine", getattr(cfg.data, "engine", "local")),
        )
        if value == "ray"
    ]
    if not chosen or importlib.util.find_spec("ray") is not None:
        return []
    return [
        f"{name}: 'ray' needs Ray, which is not installed here; pip install 'stoker[ray]', or use 'local'."
        for name in chosen
    ]


def _resources_of(data: Any, errors: list[Any]) -> RunConfig:
    """The fields local_resource_problems reads, from input that failed validation elsewhere,
    so its problems are reported with the others (a field that failed itself is left out)."""
    found: dict[str, dict[str, Any]] = {"data": {}, "tokenizer": {}, "metrics": {}, "launch": {}}
    for path in (
        ("data", "source"),
        ("data", "engine"),
        ("tokenizer", "path"),
        ("launch", "launcher"),
        *(("metrics", f) for f in _SINK_MODULES),
    ):
        if isinstance(data, dict) and not any(_overlaps(e["loc"], path) for e in errors):
            found[path[0]][path[1]] = _read(data, path)
    return RunConfig.model_construct(
        data=DataConfig.model_construct(**found["data"]),
        tokenizer=TokenizerConfig.model_construct(**found["tokenizer"]),
        metrics=MetricsConfig.model_construct(**found["metrics"]),
        launch=LaunchConfig.model_construct(**found["launch"]),
    )


def load_config(source: "RunConfig | dict | str | Path | None" = None, **overrides: Any) -> RunConfig:
    """Build a checked RunConfig from a model, a dict, a YAML/JSON file or a recipe name.

    ``overrides`` are dotted keys (``train__max_steps=10`` or ``{"train.max_steps": 10}``).
    Type, bound and cross-field problems and missing local files are reported together in
    one ConfigError.
    """
    cfg = build_config(source, **overrides)
    problems = local_resource_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _written(section: str, overrides: dict, user_file: dict) -> frozenset:
    """The fields of `section` the user wrote: the override keys under it (``train.lr=...``, or
    ``train={"lr": ...}``), and every one of a YAML/JSON file of their own (`user_file`, else {})."""
    found: set[str] = set()
    for key, value in overrides.items():
        parts = key.replace("__", ".").split(".")
        if parts[0] == section and len(parts) > 1:
            found.add(parts[1])
        elif parts == [section] and isinstance(value, dict):
            found |= set(value)
    given = user_file.get(section)
    return frozenset(found | set(given if isinstance(given, dict) else ()))


def build_config(source: "RunConfig | dict | str | Path | None" = None, **overrides: Any) -> RunConfig:
    """load_config without the check of the local files once the model holds: for a caller
    that checks them with the rest of this host (``stoker.preflight.problems``), so every
    problem comes at once. When the model fails, its problems come with those of the files,
    as load_config's do."""
    user_file = False  # a YAML/JSON file of the user's: every model field in it is theirs
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, RunConfig):
        data = source.model_dump(mode="json")
    elif isinstance(source, dict):
        data = json.loads(json.dumps(source))
    else:
        path = Path(source)
        if not path.exists() and (RECIPES_DIR / f"{source}.yaml").exists():
            path = RECIPES_DIR / f"{source}.yaml"
        if not path.exists():
            recipes = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
            raise ConfigError([f"config: {str(source)!r} is neither a file nor a recipe ({recipes})."])
        data = yaml.safe_load(path.read_text()) or {}
        user_file = path.resolve().parent != RECIPES_DIR.resolve()
        if isinstance(data, dict) and re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", path.stem):
            data.setdefault("recipe", path.stem)
    if not isinstance(data, dict):
        raise ConfigError(
            [
                f"config: {str(source)!r} holds {type(data).__name__}, not a mapping of "
                "sections; start from a recipe such as 'tiny-cpu'"
            ]
        )
    for key, value in overrides.items():
        parts = key.replace("__", ".").split(".")
        node = data
        for depth, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    [
                        f"{'.'.join(parts[: depth + 1])}: is a value, not a section, so "
                        f"{key!r} cannot be set; e.g. train.max_steps=100"
                    ]
                )
        if not parts[-1]:
            raise ConfigError([f"{key!r}: names no field; e.g. train.max_steps=100"])
        node[parts[-1]] = value
    # the model and train fields the user wrote: checked against a base even where they equal
    # the recipe's (run.recipe_gives_way), and their learning rate kept (run.base_lr_default)
    explicit = {section: _written(section, overrides, data if user_file else {}) for section in ("model", "train")}
    try:
        cfg = RunConfig.model_validate(
            data,
            context={"explicit_model_fields": explicit["model"], "explicit_train_fields": explicit["train"]},
        )
    except ValidationError as err:
        errors = err.errors()
        problems = [problem_line(e, RunConfig) for e in errors] + local_resource_problems(_resources_of(data, errors))
        raise ConfigError(problems) from None
    return cfg
