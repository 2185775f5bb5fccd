"""`make test` runs the suite on 2 pytest-xdist workers with `--dist loadgroup`, and every test
on the session's Ray cluster or on a Ray instance of its own must run on one worker: one Ray on
the machine at a time (`ray.address: auto` finds a cluster by its processes, and with two it
picks either). pytest 9.2 silently broke loadgroup (pytest-xdist#1386: the group no longer
reaches the scheduler, and grouped tests are dealt out like the others); on this machine the Ray
driver-on-a-node tests then joined the other worker's cluster and timed out. pyproject.toml pins
pytest below 9.2 for it. This runs a small suite through the same hook and the same options."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFTEST = """
import os
import pytest
from tests.conftest import pytest_collection_modifyitems, pytest_sessionfinish  # the suite's hook

def pytest_configure(config):
    config.addinivalue_line("markers", "ray_instance: starts a Ray instance of its own")

@pytest.fixture(scope="session")
def ray_cluster():
    return None

@pytest.fixture
def seen(request):
    yield
    with open(os.path.join(os.environ["SEEN_DIR"], request.node.name), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
"""

TESTS = """
import time
import pytest

@pytest.mark.parametrize("i", range(3))
def test_on_the_cluster_{m}(ray_cluster, seen, i):
    time.sleep(0.2)

@pytest.mark.ray_instance
def test_own_ray_{m}(seen):
    time.sleep(0.2)

@pytest.mark.parametrize("i", range(4))
def test_plain_{m}(seen, i):
    time.sleep(0.2)

@pytest.fixture(scope="module")
def built():
    return object()

@pytest.mark.parametrize("i", range(3))
def test_module_run_{m}(built, seen, i):
    time.sleep(0.2)
"""


def test_the_ray_tests_run_on_one_xdist_worker_under_loadgroup(tmp_path):
    pytest.importorskip("xdist")
    suite, seen = tmp_path / "suite", tmp_path / "seen"
    suite.mkdir()
    seen.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    for m in ("a", "b"):
        (suite / f"test_{m}.py").write_text(TESTS.format(m=m))
    env = {**os.environ, "PYTHONPATH": ROOT, "SEEN_DIR": str(seen)}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", str(suite)],
        cwd=str(suite),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    workers = {name: (seen / name).read_text() for name in os.listdir(seen)}
    assert len(workers) == 22, sorted(workers)
    ray = {w for name, w in workers.items() if name.startswith(("test_on_the_cluster", "test_own_ray"))}
    assert len(ray) == 1, (
        f"the Ray tests ran on workers {sorted(ray)}: pytest-xdist's --dist loadgroup lost the "
        f"xdist_group marks (pytest-xdist#1386, pytest 9.2); install the pinned pytest "
        f"(pip install -e '.[test]')"
    )
    assert len(set(workers.values())) == 2  # and the other tests were dealt to both workers
    for m in ("a", "b"):  # a module's run is built once: its tests on one worker
        module = {w for name, w in workers.items() if name.startswith(f"test_module_run_{m}")}
        assert len(module) == 1, (m, module)
