"""cluster.dashboard: off by default, on loopback when on, only for a Ray of the job's own."""
from __future__ import annotations

import logging
import sys

import pytest

from cluster.config import load_config
from cluster.preflight import dashboard_missing, local_ray_kwargs
from runbase.configload import ConfigError

pytestmark = pytest.mark.unit


def test_no_dashboard_by_default():
    kwargs = local_ray_kwargs(load_config(overrides=["cluster.num_cpus=2"]).cluster)
    assert kwargs == {"address": "local", "num_cpus": 2, "include_dashboard": False, "log_to_driver": False,
                      "logging_level": logging.WARNING, "_temp_dir": None, "_node_ip_address": "127.0.0.1",
                      "_system_config": {"prestart_worker_first_driver": False}}


@pytest.mark.parametrize("overrides,port", [(["cluster.dashboard=true"], 8265),
                                            (["cluster.dashboard=true", "cluster.dashboard_port=9000"], 9000)])
def test_dashboard_on_loopback(overrides, port):
    kwargs = local_ray_kwargs(load_config(overrides=overrides).cluster)
    assert kwargs["include_dashboard"] is True and kwargs["address"] == "local"
    assert (kwargs["dashboard_host"], kwargs["dashboard_port"]) == ("127.0.0.1", port)


@pytest.mark.parametrize("overrides,key", [
    (["cluster.dashboard=true", "cluster.address=auto"], "cluster.dashboard"),  # a joined cluster has its own
    (["cluster.dashboard_port=0"], "cluster.dashboard_port"),
    (["cluster.dashboard_port=70000"], "cluster.dashboard_port"),
])
def test_bad_dashboard_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert e.value.key == key


def test_missing_dashboard_packages_are_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.dashboard.optional_deps", None)  # as without ray[default]
    assert "ray.dashboard.optional_deps" in dashboard_missing()


def test_ray_on_loopback_keeps_loopback_only_while_it_lasts():
    """Ray turns a node address of 127.0.0.1 into the machine's reachable IP; inside ray_on_loopback 127.0.0.1
    stays (its daemons then listen on loopback: tests/integration/test_cluster.py lists them), any other address
    resolves as Ray resolves it, and Ray's own resolution is back afterwards."""
    from ray._private import services

    from cluster.preflight import ray_on_loopback

    before = services.resolve_ip_for_localhost
    with ray_on_loopback():
        assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
        assert services.resolve_ip_for_localhost("localhost") == before("localhost")
        assert services.resolve_ip_for_localhost("10.1.2.3") == "10.1.2.3"
    assert services.resolve_ip_for_localhost is before


def test_a_ray_on_loopback_is_joined_on_loopback():
    """A job joining a Ray on 127.0.0.1 (another job's own, the tests' shared one) joins it as this node on
    loopback; any other address is joined as given."""
    from cluster.preflight import join_ray_kwargs

    assert join_ray_kwargs("127.0.0.1:6379")["_node_ip_address"] == "127.0.0.1"
    other = join_ray_kwargs("10.0.0.5:6379")
    assert other["address"] == "10.0.0.5:6379" and "_node_ip_address" not in other
