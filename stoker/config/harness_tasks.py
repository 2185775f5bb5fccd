"""The lm-evaluation-harness extra, as the orchestrator's side sees it: where stoker's own
task files are, the environment that keeps the harness offline, and the checks of the names
and folders a user gives, made before anything is exported or computed. No torch: the task
index is built from the YAML files alone (lm_eval's task modules import no torch); the
harness itself runs in a process of its own (``python -m stoker.training.harness_main``).
"""

from __future__ import annotations

import importlib.util
import os

# stoker's own lm-eval task files (stoker_mc: the vendored multiple-choice set)
TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "evalsets", "harness")
INSTALL_HINT = "pip install 'stoker[harness]'"
# nothing may come from the Hugging Face Hub: the model is a local folder, the tasks local files
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def installed() -> bool:
    """Whether lm_eval can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec("lm_eval") is not None
    except (ImportError, ValueError):
        return False


def include_paths(include: list[str]) -> list[str]:
    """The folders the harness indexes: stoker's own, then the user's (absolute)."""
    return [TASKS_DIR, *(os.path.abspath(os.path.expanduser(d)) for d in include)]


def local_tasks(include: list[str]) -> list[str]:
    """The task, group and tag names of the task files in stoker's folder and `include`
    (lm-eval's built-in tasks are left out: they download their data)."""
    from lm_eval.tasks import TaskManager

    return list(TaskManager(include_path=include_paths(include), include_defaults=False).all_tasks)


def harness_problems(
    tasks: list[str],
    include: list[str],
    tasks_field: str = "eval.harness_tasks",
    include_field: str = "eval.harness_include",
) -> list[str]:
    """One line per problem of harness tasks and include folders on this host, each naming
    its field and the fix: lm_eval not installed, a folder that is not there, a task name
    no task file defines. [] when no task is asked for."""
    if not tasks:
        return []
    if not installed():
        return [
            f"{tasks_field}: needs lm-evaluation-harness (the lm_eval package), which is not installed "
            f"here; {INSTALL_HINT}, or ask for no harness task."
        ]
    missing = [d for d in include if not os.path.isdir(os.path.expanduser(d))]
    if missing:
        return [f"{include_field}: {d!r} is not a folder; give a folder of lm-eval task YAML files." for d in missing]
    known = local_tasks(include)
    unknown = [t for t in tasks if t not in known]
    if not unknown:
        return []
    where = " and ".join(include_paths(include))
    return [
        f"{tasks_field}: {', '.join(map(repr, unknown))}: no task file in {where} defines "
        f"{'it' if len(unknown) == 1 else 'them'}; the tasks there: {', '.join(known) or 'none'} "
        f"(add your task's folder to {include_field})."
    ]
