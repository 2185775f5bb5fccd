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
- model.attention 'document' on CUDA ranks: a head size or a torch that flex attention's fused
  kernel cannot take (``flex_attention_problem``);
- the run's memory plan on its devices (``arithmetic.plan``; launch.accelerator, else this host's
  GPU): a run that cannot fit is refused with the cheapest fix that makes it fit.

A check that needs what another found broken is left out (a store with bad storage fields, a
sink whose package is missing), so each problem is told once. A store or tracking server that
is merely unreachable raises its error (to be retried) when nothing else is wrong.

No torch and no Prefect here: the flow's process never imports torch, and the CLI answers
before Prefect's server starts.
"""

from __future__ import annotations

import re
from typing import Callable

from pydantic import BaseModel, ValidationError

from stoker.config import RunConfig, StorageConfig, local_resource_problems, missing_sink_packages
from stoker.config.harness_tasks import harness_problems
from stoker.failures import ConfigError, is_transient
from stoker.launch.devices import device_problems, installed_torch
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
    found += attention_problems(resolved)  # the head size flex attention takes, once the shape is known
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


# torch's flex attention (model.attention 'document' on CUDA), as its sources raise:
# torch.nn.attention.flex_attention is public from torch 2.5 (2.4 has only a private
# _flex_attention); torch 2.5 and 2.6 refuse a head size that is not a power of two
# (nn/attention/flex_attention.py, _validate_embed_dim: "NYI: Currently non power of 2 embedding
# dimension are not supported"), 2.7 rounds it up inside the kernel (QK_HEAD_DIM_ROUNDED); the
# Triton lowering refuses heads under 16 wide ("tl.dot does not support embedding size less than
# 16": _inductor/kernel/flex/flex_attention.py in 2.13); and before 2.11 a query shorter than 128
# goes to the decoding kernel, whose template reshapes to the unrounded head size and fails to
# compile for one that is not a power of two (flex_decode.py.jinja, fixed in 2.11).
FLEX_TORCH = (2, 5)
FLEX_ANY_HEAD_TORCH = (2, 7)
FLEX_SHORT_ANY_HEAD_TORCH = (2, 11)
FLEX_MIN_HEAD = 16
FLEX_DECODE_BELOW = 128


def flex_attention_problem(head_dim: int, torch_version: str, device: str, block_size: int, field: str) -> str | None:
    """What torch's flex attention cannot take of a run whose document attention it serves
    (model.attention 'document' on `device` 'cuda'; the CPU's path is exact eager SDPA and takes
    anything): a torch without it, or a head size (`head_dim`, given by `field`) its kernel
    refuses; one line naming the field and the fix, else None. torch_version: the ranks' torch
    (e.g. '2.6.0+cu124'; one that cannot be read is not judged)."""
    if device != "cuda":
        return None
    found = re.match(r"(\d+)\.(\d+)", torch_version)
    release = (int(found[1]), int(found[2])) if found else None
    other = "or set model.attention=causal (SDPA's fused causal kernels, attending across documents)"
    if release is not None and release < FLEX_TORCH:
        return (
            f"model.attention: 'document' on CUDA runs torch's flex attention (torch.nn.attention.flex_attention, "
            f"torch {FLEX_TORCH[0]}.{FLEX_TORCH[1]} or newer) and the ranks have torch {torch_version}; upgrade torch, "
            f"{other}."
        )
    if head_dim < FLEX_MIN_HEAD:
        return (
            f"{field}: a head size of {head_dim} is narrower than flex attention's fused kernel takes under "
            f"model.attention 'document' on CUDA (heads of {FLEX_MIN_HEAD} or more: its Triton matmuls); give heads of "
            f"{FLEX_MIN_HEAD} or more (a base with them), {other}."
        )
    if head_dim & (head_dim - 1) == 0 or release is None:
        return None
    if release < FLEX_ANY_HEAD_TORCH:
        return (
            f"{field}: a head size of {head_dim} is not a power of two, which the ranks' torch {torch_version} flex "
            f"attention refuses (model.attention 'document' on CUDA; any size of {FLEX_MIN_HEAD} or more from torch "
            f"{FLEX_ANY_HEAD_TORCH[0]}.{FLEX_ANY_HEAD_TORCH[1]}); upgrade torch, {other}."
        )
    if release < FLEX_SHORT_ANY_HEAD_TORCH and block_size < FLEX_DECODE_BELOW:
        return (
            f"{field}: a head size of {head_dim} (not a power of two) with model.block_size {block_size} (under "
            f"{FLEX_DECODE_BELOW}) sends torch {torch_version}'s flex attention to its decoding kernel, which fails to "
            f"compile for it (fixed in torch {FLEX_SHORT_ANY_HEAD_TORCH[0]}.{FLEX_SHORT_ANY_HEAD_TORCH[1]}); set "
            f"model.block_size to {FLEX_DECODE_BELOW} or more, upgrade torch, {other}."
        )
    return None


def attention_problems(config: RunConfig) -> list[str]:
    """model.attention 'document' where the ranks run on CUDA (launch.backend 'nccl', or 'auto'
    with launch.accelerator a GPU or a GPU on this host): what the ranks' torch (this host's,
    from its metadata) cannot serve of the model's head size (``flex_attention_problem``). Told
    once the model's shape is known (a base's, read in)."""
    from stoker.arithmetic.plan import local_gpu_name

    m, lc = config.model, config.launch
    if getattr(m, "attention", None) != "document" or not _valid(m) or not _valid(lc) or m.unresolved():
        return []
    gpu_named = bool(lc.accelerator) and lc.accelerator.lower() != "cpu"
    on_cuda = lc.backend == "nccl" or (lc.backend == "auto" and (gpu_named or local_gpu_name() is not None))
    field = "model.head_dim" if getattr(m, "head_dim", None) else "model.n_embd / model.n_head"
    problem = flex_attention_problem(
        m.resolved_head_dim, installed_torch(), "cuda" if on_cuda else "cpu", m.block_size, field
    )
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
