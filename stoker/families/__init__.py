"""The model families, one folder each (torchtitan's ``models/<name>/``; nanoGPT's one readable
model file), and their registry: one line per family in ``NAMES``.

A family's folder holds everything that differs between families:

- ``__init__.py`` (torch-free): ``Config``, its section of the run configuration;
- ``config.py`` (torch-free): the fields, the checks against a base's Hugging Face config.json
  (``from_hf_config``, ``hf_limits``, ``to_hf_config``), the parameter count and plan shape
  (``plan_shape``, which the plan and the FLOPs per token read), the sizes a tensor-parallel
  split divides (``tp_split_sizes``);
- ``model.py`` (torch): the module, its seeded init, its Hugging Face name map, its ``SPEC``
  (``families.spec.ModelSpec``);
- ``parallel.py`` (torch, where the family has one): its tensor-parallel plan (the spec's
  ``parallelize``).

What the families share is beside them: ``section.py`` (the section base), ``spec.py``,
``attention.py`` (document masks, flex attention, SDPA), ``layers.py`` (activation checkpointing,
the chunked loss) and ``common.py`` (torch). Nothing outside this room names a family
(tests/test_architecture.py): the configuration asks ``FAMILIES``, the trainer ``spec_of``.
This module imports no torch: the flow process reads the configs, only ``spec_of`` loads a
family's module.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag

from stoker.families.section import UnsupportedArchitecture, _ModelSection

# the registry: one line per family, the first the default of a config that leaves model.family out
NAMES = (
    "gpt2",
    "llama",
    "qwen3",
    "mixtral",
    "qwen3_moe",
)

FAMILIES: dict[str, type[_ModelSection]] = {
    name: importlib.import_module(f"stoker.families.{name}").Config for name in NAMES
}
DEFAULT_FAMILY = NAMES[0]


def family_of_model_type(model_type: Any) -> str | None:
    """The family that reads a Hugging Face config.json of this model_type, or None."""
    return next((name for name, cls in FAMILIES.items() if model_type in cls.HF_MODEL_TYPES), None)


def spec_of(model_cfg: Any):
    """The spec of a model section's family (``cfg.model``, or a family's name): imports the
    family's module, hence torch."""
    family = getattr(model_cfg, "family", model_cfg)
    if family not in FAMILIES:
        raise ValueError(f"model.family: {family!r} is not a model family")
    return importlib.import_module(f"stoker.families.{family}.model").SPEC


def build_model(model_cfg: Any, vocab_size: int, seed: int | None):
    """The model of a config for a tokenizer of ``vocab_size`` ids (rows as the family pads)."""
    return spec_of(model_cfg).build(model_cfg, vocab_size, seed)


def _family_of(value: Any) -> str:
    """The union's tag: model.family, the default family when left out (configs older than the
    families)."""
    if isinstance(value, dict):
        return value.get("family") or DEFAULT_FAMILY
    return getattr(value, "family", DEFAULT_FAMILY)


class _AnyFamily:
    """The union's JSON schema as anyOf, not oneOf: a section that leaves model.family out (a
    config older than the families) fits several members' schemas, and the Prefect server
    validates a deployment's parameters with that schema (oneOf would refuse it; pydantic's
    discriminator still picks exactly one family)."""

    def __get_pydantic_json_schema__(self, core_schema, handler):
        schema = handler(core_schema)
        if "oneOf" in schema:
            schema["anyOf"] = schema.pop("oneOf")
        return schema


# the model section: a union on model.family (the UI form and `config --list` show each
# family's fields)
ModelConfig = Annotated[
    Union[tuple(Annotated[cls, Tag(name)] for name, cls in FAMILIES.items())],  # noqa: UP007
    Discriminator(_family_of),
    _AnyFamily(),
]

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "ModelConfig",
    "NAMES",
    "UnsupportedArchitecture",
    "build_model",
    "family_of_model_type",
    "spec_of",
]
