"""cluster.start on an existing multi-node Ray cluster: three real raylets on this machine
(`ray.cluster_utils.Cluster`), each with its own resources. The learners must land together on
the node that offers `learner_host`, the actors on two different nodes (STRICT_SPREAD), both ingest
shards on the head (the launcher's node); every address the processes announce is the node IP, and
when that is not loopback the run's Redis and ingest authenticate (runbase/net.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from learner import metric_names as M
from runbase.net import is_loopback

START_TIMEOUT_S = 240  # a healthy run takes ~60 s here; three raylets share 2 cores with the job
STEPS = 3


@pytest.fixture
def ray_cluster(monkeypatch):
    from ray.cluster_utils import Cluster

    # this cluster and the job that joins it settle their own authentication: the mode the tests' shared Ray set in
    # this process's environment (tests/ray_shared.py) is not theirs
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)

    # Logical CPUs: the job's processes each claim one CPU of a bundle; the machine has 2 real cores.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    learner_node = cluster.add_node(num_cpus=2, resources={"learner_host": 2})
    other_node = cluster.add_node(num_cpus=2, resources={"actor_host": 1})
    yield cluster, learner_node, other_node
    cluster.shutdown()


def test_start_on_three_node_cluster_places_as_requested(tmp_path, ray_cluster):
    """Also: the launcher runs in the user's directory, the job's processes where the raylets started; a relative
    model.path is the launcher's (it was loaded from the workers' directory: "Repo id must use alphanumeric
    chars ... './model'" after every process had started)."""
    from data.tasks import TaskConfig
    from data.tiny_model import resolve_model_path

    cluster, learner_node, other_node = ray_cluster
    run = tmp_path / "run"
    (tmp_path / "model").symlink_to(resolve_model_path("builtin:tiny-reverse", TaskConfig()))
    cmd = [sys.executable, "-m", "cluster.start", "--run-dir", str(run), "--address", cluster.address,
           "model.path=model", "--actors", "2", "--learners", "2", f"trainer.total_steps={STEPS}",
           "trainer.export_hf=false", "trainer.tensorboard=false", "buffer.ingest_shards=2",
           "cluster.learner_resources={CPU: 1, learner_host: 1}", "cluster.actor_strategy=STRICT_SPREAD"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m[M.STEP] for m in lines] == list(range(STEPS))

    status = json.loads((run / "status.json").read_text())
    where = status["placement"]
    assert set(where) == {"ingest-0", "ingest-1", "learner-0", "learner-1", "actor-0", "actor-1"}, where
    head = cluster.head_node.node_id
    assert {where[r]["node_id"] for r in ("learner-0", "learner-1")} == {learner_node.node_id}
    assert where["actor-0"]["node_id"] != where["actor-1"]["node_id"]   # STRICT_SPREAD
    assert {where[r]["node_id"] for r in ("ingest-0", "ingest-1")} == {head}
    # both shards took groups (actor i -> shard i % 2), all into the one stream the learner read
    assert {"address:0", "address:1"} <= status["ingest"].keys()
    assert int(status["ingest"]["accepted"]) >= STEPS * 8
    # every actor holds the learner's final weights, broadcast through the announced store
    final = status["checksums"][str(STEPS)]
    assert {a: m["version"] for a, m in status["members"].items()} == {"actor-0": STEPS, "actor-1": STEPS}
    assert all(m["checksum"] == final for m in status["members"].values())

    node_ip = where["learner-0"]["ip"]  # the node IP Ray reports is what everything announced
    for field in ("address:0", "address:1"):
        assert status["ingest"][field].startswith(f"tcp://{node_ip}:"), status["ingest"]
    job = json.loads((run / "job.json").read_text())
    assert job["redis_url"].startswith(f"redis://{node_ip}:")
    if not is_loopback(node_ip):  # off loopback: authenticated, and the secrets never written out
        assert "curve_public" in status["ingest"]
        for name in ("job.json", "status.json", "config.yaml", "logs/launcher.log"):
            text = (run / name).read_text()
            assert "ASYNCRL_REDIS_PASSWORD" not in text and "secret" not in text.lower(), name
