"""The rooms and who may enter (DESIGN.md): no upward import, no import cycle, no torch in
the orchestrator's rooms, no Prefect in the ranks'. Every room is a subpackage of stoker; the
command line (stoker/cli/, stoker/__main__.py) is the top, and stoker/__init__.py imports nothing."""

import ast
import os

import pytest

from tests.conftest import ROOT

# what every room shares, lowest first: each imports only those before it
SHARED = (
    "failures",  # stoker/failures.py: one failure taxonomy and one retry helper
    "fields",  # how a config field is declared and a broken rule told
    "families",  # the model families, one folder each, and their registry
    "config",  # the run configuration: sections, RunConfig, loading
    "contracts",  # what the rooms hand each other: the rank records and their wire format, results
    "arithmetic",  # a run's arithmetic from its config: plan, learning-rate schedule, data order, bytes per token, gains
    "process",  # how a stoker process lives, ends and connects: lifeline, quick exit, Ray
)
ROOMS = (
    *SHARED,
    "storage",
    "data",
    "launch",
    "training",
    "observe",
    "preflight",
    "orchestration",
    "tasks",
    "flows",
    "cli",
)
BELOW = set(SHARED)
MAY_IMPORT = {
    **{room: set(SHARED[: i + 1]) for i, room in enumerate(SHARED)},
    # observe: how results read; launch: the export and harness children
    "cli": BELOW | {"preflight", "launch", "observe", "orchestration", "tasks", "flows", "cli"},
    "storage": BELOW | {"storage"},
    "data": BELOW | {"storage", "data"},
    "launch": BELOW | {"storage", "launch"},
    "training": BELOW | {"storage", "training"},
    "observe": BELOW | {"storage", "observe"},
    # the one preflight (stoker/preflight.py): every check of the host, gathered from the rooms below
    "preflight": BELOW | {"storage", "data", "launch", "observe", "preflight"},
    # the Prefect integration: result cache policy and its locks, events, publisher, credentials blocks
    "orchestration": BELOW | {"storage", "observe", "orchestration"},
    "tasks": BELOW | {"data", "launch", "observe", "storage", "preflight", "orchestration", "tasks"},
    "flows": BELOW | {"preflight", "orchestration", "tasks", "flows"},
}
NEVER = {
    "cli": {"torch"},
    "observe": {"torch", "prefect"},
    "preflight": {"torch", "prefect"},
    "orchestration": {"torch"},
    "launch": {"torch"},
    "tasks": {"torch"},
    "flows": {"torch"},
    **{room: {"torch", "prefect"} for room in SHARED},
    "families": {"prefect"},  # and no torch in the configs and the registry: the test below
    "storage": {"torch", "prefect"},
    "data": {"torch", "prefect"},
    "training": {"prefect"},
}


def _modules() -> dict[str, set[str]]:
    """Every project module and the modules it imports (at any depth of the file)."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "stoker")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                imported = set()
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.Import):
                        imported |= {a.name for a in node.names}
                    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                        imported.add(node.module)
                        imported |= {f"{node.module}.{a.name}" for a in node.names}
                out[rel] = imported
    return out


MODULES = _modules()


def _room(module: str) -> str | None:
    """The room of a stoker module ('stoker.launch.gang' -> 'launch', 'stoker.__main__' -> 'cli')."""
    parts = module.split(".")
    if parts[0] != "stoker" or len(parts) == 1:
        return None
    return "cli" if parts[1] in ("cli", "__main__") else parts[1]


ROOMED = {m: _room(m) for m in MODULES if _room(m) != "recipes"}


def test_every_module_is_in_a_room_and_the_package_root_imports_nothing():
    assert MODULES["stoker"] == set(), "stoker/__init__.py imports nothing (the ranks never load Prefect)"
    assert {r for r in ROOMED.values() if r} <= set(ROOMS), sorted(ROOMED.items())


@pytest.mark.parametrize("module", sorted(m for m, r in ROOMED.items() if r))
def test_each_room_imports_only_the_rooms_below_it(module):
    room = ROOMED[module]
    for name in MODULES[module]:
        top = name.split(".")[0]
        other = _room(name)
        if other:
            assert other in MAY_IMPORT[room], f"{module} imports {name}: {room}/ may not import {other}/"
        assert top not in NEVER[room], f"{module} imports {name}: {room}/ never imports {top}"
        assert top not in ROOMS or top == "stoker", f"{module} imports {name}: the rooms are stoker.{top}"


def test_no_import_cycle_between_project_modules():
    graph = {m: {n for n in deps if n in MODULES and n != m} for m, deps in MODULES.items()}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [m, n]))
            if not state.get(n):
                visit(n, path + [m])
        state[m] = 2

    for m in graph:
        if not state.get(m):
            visit(m, [])


def test_nothing_outside_the_families_names_a_model_family():
    """The configuration asks the registry (stoker.families: FAMILIES), the engine, evaluation,
    export, the harness and the CLI ask the family's spec (spec_of); a family's folder, class or
    name appears only in stoker/families/."""
    import re

    from stoker.families import FAMILIES

    names = "|".join(FAMILIES)
    classes = "|".join(cls.__name__ for cls in FAMILIES.values())
    pattern = re.compile(
        rf"stoker\.families\.({names})\b|\b(GPT|Llama|Qwen3|{classes})\(|(==|!=|in) ?\(?[\"']({names})[\"']|family == "
    )
    allowed = (os.path.join("stoker", "families") + os.sep,)
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "stoker")):
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), ROOT)
            if name.endswith(".py") and not path.startswith(allowed):
                for i, line in enumerate(open(os.path.join(ROOT, path)), 1):
                    if pattern.search(line):
                        found.append(f"{path}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_family_is_one_folder_and_one_registry_line_and_its_config_needs_no_torch():
    """Each registered family is a folder with its torch-free config section and its module;
    the registry names each once; the configuration (every family's section) loads without
    torch, as the flow process does."""
    import subprocess
    import sys

    from stoker.families import FAMILIES, NAMES

    registry = open(os.path.join(ROOT, "stoker", "families", "__init__.py")).read()
    for name in FAMILIES:
        folder = os.path.join(ROOT, "stoker", "families", name)
        assert {"__init__.py", "config.py", "model.py"} <= set(os.listdir(folder)), name
        assert registry.count(f'"{name}",') == 1 and NAMES.count(name) == 1, name
    code = (
        "import sys, stoker.config, stoker.families as f\n"
        "[f.FAMILIES[n].model_validate({'family': n}) for n in f.NAMES]\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize(
    "module", sorted(m for m, r in ROOMED.items() if r == "tasks" and m not in ("stoker.tasks", "stoker.tasks.policy"))
)
def test_every_module_of_tasks_defines_a_prefect_task(module):
    """tasks/ holds Prefect tasks, each with its policy (tasks.policy: the one decorator); what
    is not a task lives in the room named for it (orchestration, launch, observe)."""
    path = os.path.join(ROOT, *module.split(".")) + ".py"
    decorated = [
        node.name
        for node in ast.walk(ast.parse(open(path).read()))
        if isinstance(node, ast.FunctionDef)
        and any(
            isinstance(d, ast.Call) and getattr(d.func, "id", getattr(d.func, "attr", "")) == "stoker_task"
            for d in node.decorator_list
        )
    ]
    assert decorated, f"{module} defines no @stoker_task: move it to the room its job belongs to"


def test_the_cli_is_a_table_of_commands_with_recipe_and_set_declared_once():
    """Each command owns its arguments and its handler (stoker.cli.commands.COMMANDS); the
    parser is made from the table, --recipe/--set added in one place for the commands that take
    a config."""
    import argparse

    from stoker.cli.commands import COMMANDS, add_commands

    source = "".join(
        open(os.path.join(ROOT, "stoker", "cli", n)).read()
        for n in os.listdir(os.path.join(ROOT, "stoker", "cli"))
        if n.endswith(".py")
    )
    assert source.count('"--recipe"') == 1 and source.count('"--set"') == 1
    parser = argparse.ArgumentParser(prog="stoker")
    add_commands(parser)
    for command in COMMANDS:
        args = parser.parse_args([command.name, *(["x"] * _positionals(parser, command.name))])
        assert args.command == command.name and callable(command.handler)
        assert hasattr(args, "recipe") == hasattr(args, "set") == bool(command.config), command.name


def _positionals(parser, name: str) -> int:
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    return sum(1 for a in sub._actions if not a.option_strings and a.dest != "help")
