"""Shared fixtures: a real Redis server (started once per session) and per-test run ids."""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Built-in model cache for tests: shared across the session, inside the checkout unless set.
os.environ.setdefault("ASYNCRL_CACHE", str(ROOT / ".venv" / "cache"))


def pytest_collection_modifyitems(items):
    for item in items:  # the tier follows the folder, so `-m unit` etc. select whole tiers
        for tier in ("unit", "integration", "chaos"):
            if f"tests/{tier}/" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from cluster.redis_local import LocalRedis

    server = LocalRedis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture
def run_id():
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def r(redis_url):
    from runbase.keys import connect

    client = connect(redis_url)
    yield client
    client.close()
