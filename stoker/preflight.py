"""One preflight: every problem of a run config on the host that is to run it, found at once
before any compute starts, each as one line naming the field and the fix.

``problems(config)`` is what `stoker run` and `stoker validate` check before anything starts,
and what the pipeline's first task (``validate_config``, so every deployment of it) checks
before any work. It gathers:

- the model's own rules (``RunConfig.check``: a config built in code was never validated);
- the local files the config names and the optional packages it needs: the data source and
  tokenizer, TensorBoard and MLflow (the 'metrics' extra), Ray (``local_resource_problems``);
- eval.harness_tasks: lm-evaluation-harness installed (the 'harness' extra), the
  eval.harness_include folders there, every task name defined in them (``config.harness_tasks``);
- the accelerators: NCCL without GPUs, more ranks here than GPUs, engine settings that CPU
  ranks or the installed torch cannot honour, torch's version read from its metadata
  (``launch.devices.device_problems``);
- the credentials block named in ``storage.credentials_block``, when a loader is given (it
  needs a Prefect server: the flow's task passes one, the CLI does when a server is up);
- whether the store root can be written (a probe object, written and removed);
- a run the config's name goes on (its config.json in the store): a schedule change it cannot
  take, one that would stretch a cosine run or leave it no checkpoint to go on from (so that it
  would start over: ``storage.runs.schedule_change_problem``), refused before anything is written;
- whether the MLflow tracking URI can be used (its experiment found or created);
- the base model of ``model.init_from``: there, complete, of an architecture a family expresses
  exactly, not contradicted by an explicit field (``storage.bases.resolve_base``; ``check``
  returns the config with the base's architecture, tokenizer and content hash filled in);
- the run's memory plan on its devices (``arithmetic.plan``; launch.accelerator, else this host's
  GPU): a run that cannot fit is refused with the cheapest fix that makes it fit.

A check that needs what another found broken is left out (a store with bad storage fields, a
sink whose package is missing), so each problem is told once. A store or tracking server that
is merely unreachable raises its error (to be retried) when nothing else is wrong.

No torch and no Prefect here: the flow's process never imports torch, and the CLI answers
before Prefect's server starts.
"""

from __future__ import annotations

from typing import Callable

from pydantic import BaseModel, ValidationError

from stoker.config import RunConfig, StorageConfig, local_resource_problems, missing_sink_packages
from stoker.config.harness_tasks import harness_problems
from stoker.failures import ConfigError, is_transient
from stoker.launch.devices import device_problems
from stoker.observe.sinks import sink_problems
from stoker.storage.bases import resolve_base
from stoker.storage.branches import resolve_branch
from stoker.storage.runs import schedule_change_problem, store_problem
from stoker.storage.store import Store

# loads the credentials block a StorageConfig names and puts them in use in this process
# (orchestration.credentials.use_store_credentials); ConfigError naming the field when it cannot
LoadCredentials = Callable[[StorageConfig], None]


def filter_problems(config: RunConfig) -> list[str]:
    """data.filters (and each source's) as the data stage would read them: names and parameters."""
    from stoker.data.filters import make_filters

    found = []
    for name, _, cfg in config.data.source_configs():
        try:
            make_filters(cfg.filters)
        except ConfigError as err:
            found += [p if name == "main" else f"{p} (source {name!r})" for p in err.problems]
    return list(dict.fromkeys(found))


def problems(config: RunConfig, load_credentials: LoadCredentials | None = None) -> list[str]:
    """Every problem of `config` on this host, one line each; [] when it may run here.

    `load_credentials`: loads storage.credentials_block (and uses it for the store probe);
    without it a named block is not loaded and the store is not probed (its keys are the
    block's), which the flow's first task then does.
    """
    return _checked(config, load_credentials)[0]


def check(config: RunConfig, load_credentials: LoadCredentials | None = None) -> RunConfig:
    """`config` when ``problems`` finds none (with its base read in: ``resolve_base``), else
    one ConfigError listing them all."""
    found, resolved = _checked(config, load_credentials)
    if found:
        raise ConfigError(found)
    return resolved


def _checked(config: RunConfig, load_credentials: LoadCredentials | None) -> tuple[list[str], RunConfig]:
    """(every problem, `config` with its base read in): a base's files are read once, for its
    own checks, the plan's shape and the config returned."""
    try:
        config.check()
        found = []
    except ConfigError as err:
        found = list(err.problems)
    found += local_resource_problems(config) + device_problems(config) + filter_problems(config)
    if _valid(config.eval):  # lm-eval installed, its folders there, its task names known
        found += harness_problems(config.eval.harness_tasks, config.eval.harness_include)
    unreachable: list[Exception] = []
    probed = False  # the store opened and written: the run folder there can be read
    if _valid(config.storage) and _credentials_in_use(config.storage, load_credentials, found):
        store_found = _store_problems(config.storage, unreachable)
        found += store_found
        probed = not store_found and not unreachable
    if _valid(config.metrics) and not missing_sink_packages(config.metrics):
        found += _unreachable_as(lambda: sink_problems(config), unreachable)
    resolved = config
    if getattr(config.model, "init_from", None) and not found:  # the base's files, read once the rest holds
        try:
            resolved = resolve_base(config)
        except ConfigError as err:
            found += list(err.problems)
        except Exception as err:
            if not is_transient(err):
                raise
            unreachable.append(err)
    if (
        getattr(config.train, "branch_from", None) and not found and not unreachable
    ):  # the branch point, read once the rest holds
        try:
            resolved = resolve_branch(resolved)
        except ConfigError as err:
            found += list(err.problems)
    if probed and not found and not unreachable:  # the run it goes on: a schedule change that would start it over
        store = Store.of(resolved.storage)
        found += _unreachable_as(lambda: [p for p in [schedule_change_problem(store, resolved)] if p], unreachable)
    if not found and not unreachable:  # the memory plan, on the model's shape (a base's, read in)
        found += _unreachable_as(lambda: plan_problems(resolved), unreachable)
    if unreachable and not found:
        raise unreachable[0]  # transient: a retry may find it back
    return found, resolved


def shaped(config: RunConfig) -> RunConfig:
    """`config` with the model's shape known: a base's architecture read in where the config
    leaves it to the base (ConfigError when the base cannot be read)."""
    if getattr(config.model, "init_from", None) and config.model.unresolved():
        return resolve_base(config)
    return config


def plan_problems(config: RunConfig) -> list[str]:
    """The run's plan on its devices (launch.accelerator, else this host's GPU): one line
    naming the cheapest fix when it cannot fit (``arithmetic.plan.fit_problem``); nothing when no
    device is known (CPU ranks)."""
    from stoker.arithmetic.plan import fit_problem, hardware_of

    try:
        hardware = hardware_of(config)
    except ValueError as err:
        return [str(err)]
    config = shaped(config)
    problem = fit_problem(config, hardware)
    return [problem] if problem else []


def _valid(section: BaseModel) -> bool:
    """Whether a section passes its own rules (a check that reads it is skipped otherwise)."""
    try:
        type(section).model_validate(section.model_dump())
    except ValidationError:
        return False
    return True


def _credentials_in_use(storage: StorageConfig, load: LoadCredentials | None, found: list[str]) -> bool:
    """Load the credentials the store is opened with; False when the store cannot be probed
    with them (the block could not be loaded: its problem is added to `found`; or it is named
    and there is no loader here)."""
    if load is None:
        return not storage.credentials_block
    try:
        load(storage)
    except ConfigError as err:
        found += err.problems
        return False
    return True


def _store_problems(storage: StorageConfig, unreachable: list[Exception]) -> list[str]:
    store = Store.of(storage)
    return _unreachable_as(lambda: [p for p in [store_problem(store)] if p], unreachable)


def _unreachable_as(check: Callable[[], list[str]], unreachable: list[Exception]) -> list[str]:
    """The problems `check` finds; a transient error is kept in `unreachable` (raised later,
    when nothing else refuses the config) so the other checks still run."""
    try:
        return check()
    except Exception as err:
        if not is_transient(err):
            raise
        unreachable.append(err)
        return []
