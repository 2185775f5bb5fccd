"""The run configuration: one typed model tree, the single source of truth.

The same ``RunConfig`` is the Prefect flow parameter (it renders as a form in the UI),
is written to ``{root}/runs/{run_name}/config.json``, and is what every torch rank reads.

- the sections, one pydantic model per component, each field with its description, bounds and
  fix, a section's cross-field rules validators on it, one module per section or group: ``data``
  (its sources and schedule of weights), ``tokenizer``, ``train`` (and the names of the fields
  the learning-rate schedule reads), ``checkpoint``, ``eval``, ``launch`` (its nodes, and the Ray
  cluster), ``engine``, ``storage``, ``observe`` (metrics, cost, events); ``checks``, the string
  checks several share (no credentials in options, a URL's form). The model section is the
  families' (``stoker.families``).
- ``run``: ``RunConfig``, the run's identity (its hashes and resolved name) and the rules that
  span sections, in one wrap validator that still runs when other fields failed, so one pass
  reports every problem.
- ``problems``: a validation error told as one line per field with its fix (and the closest
  name for an unknown key).
- ``load``: ``load_config`` from a recipe, a YAML/JSON file, a dict or a model, with dotted
  overrides (``build_config``: the same, leaving the local files to the caller);
  ``local_resource_problems``, what only this host can check (the local data and tokenizer
  files, the optional packages); ``field_table``.

The model never touches the filesystem (every rank re-validates config.json on its own host);
``load_config`` reports both kinds in one ``ConfigError``. Every other check of the host that
is to run a config (GPUs, torch, the store, the credentials block, the metric sinks) is with
these in ``stoker.preflight.problems``.
"""

from stoker.config.checkpoint import CheckpointConfig
from stoker.config.checks import CREDENTIALS_FIX
from stoker.config.data import BUILTIN_SOURCE, DataConfig
from stoker.config.engine import FSDP2_TORCH, EngineConfig
from stoker.config.eval import EvalConfig
from stoker.config.launch import LaunchConfig, NodeConfig, RayConfig
from stoker.config.load import (
    RECIPES_DIR,
    build_config,
    field_table,
    load_config,
    local_resource_problems,
    missing_ray,
    missing_sink_packages,
)
from stoker.config.observe import CostConfig, EventsConfig, MetricsConfig
from stoker.config.run import RunConfig
from stoker.config.storage import StorageConfig, default_root
from stoker.config.tokenizer import TokenizerConfig
from stoker.config.train import TrainConfig
from stoker.failures import ConfigError
from stoker.fields import NonBlank

__all__ = [
    "BUILTIN_SOURCE",
    "CREDENTIALS_FIX",
    "FSDP2_TORCH",
    "RECIPES_DIR",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "CostConfig",
    "EventsConfig",
    "LaunchConfig",
    "MetricsConfig",
    "NodeConfig",
    "NonBlank",
    "RayConfig",
    "RunConfig",
    "StorageConfig",
    "TokenizerConfig",
    "TrainConfig",
    "build_config",
    "default_root",
    "field_table",
    "load_config",
    "local_resource_problems",
    "missing_ray",
    "missing_sink_packages",
]
