"""The rooms and who may enter (DESIGN.md): no upward import, no import cycle, no torch in
the orchestrator's rooms, no Prefect in the ranks'."""

import ast
import os

import pytest

from tests.conftest import ROOT

ROOMS = ("core", "storage", "data", "launch", "training", "tasks", "flows")
MAY_IMPORT = {
    "core": {"core"},
    "storage": {"core", "storage"},
    "data": {"core", "storage", "data"},
    "launch": {"core", "storage", "launch"},
    "training": {"core", "storage", "training"},
    "tasks": {"core", "data", "launch", "storage", "tasks"},
    "flows": {"core", "tasks", "flows"},
}
NEVER = {"launch": {"torch"}, "tasks": {"torch"}, "flows": {"torch"}, "core": {"torch", "prefect"},
         "storage": {"torch", "prefect"}, "data": {"torch", "prefect"}, "training": {"prefect"}}


def _modules() -> dict[str, set[str]]:
    """Every project module and the modules it imports (at any depth of the file)."""
    out = {}
    for room in ROOMS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, room)):
            for name in files:
                if not name.endswith(".py"):
                    continue
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


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_room_imports_only_the_rooms_below_it(module):
    room = module.split(".")[0]
    for name in MODULES[module]:
        top = name.split(".")[0]
        if top in ROOMS:
            assert top in MAY_IMPORT[room], f"{module} imports {name}: {room}/ may not import {top}/"
        assert top not in NEVER[room], f"{module} imports {name}: {room}/ never imports {top}"


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
