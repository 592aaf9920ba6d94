"""`make test`'s grouping: the tests of a module that share a module-scoped fixture run on one pytest-xdist worker,
which builds the fixture once (tests/conftest.py), under the pytest and pytest-xdist that `make test` installs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]
RUN_S = 120  # two workers' start on a loaded 2-core machine

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("repo_conftest", {str(TESTS / "conftest.py")!r})
repo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repo)
pytest_collection_modifyitems, pytest_configure = repo.pytest_collection_modifyitems, repo.pytest_configure
"""
MODULE = """
import os
import pytest
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    with open(os.environ["BUILDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
@pytest.mark.parametrize("i", range(6))
def test_shared(built, i):
    pass
@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass
"""


def test_tests_sharing_a_module_fixture_run_on_one_worker_which_builds_it_once(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(MODULE)
    builds = tmp_path / "builds.txt"
    res = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                          "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=RUN_S, env={**os.environ, "BUILDS": str(builds)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    workers = {line.split("]")[0] for line in res.stdout.splitlines() if "PASSED" in line and "test_shared" in line}
    assert len(workers) == 1, res.stdout
    assert len(builds.read_text().split()) == 1, res.stdout
    assert "12 passed" in res.stdout
