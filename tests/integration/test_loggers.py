"""trainer.logger on a real job: the same step metrics reach the console lines, TensorBoard and wandb."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.test_cluster import metrics, start
from learner import metric_names as M

READER_TIMEOUT_S = 60  # wandb's reader starts its Go core: about a second on an idle machine


def wandb_records(run_dir) -> list[dict]:
    """The records of the job's offline wandb run, read by wandb's own reader of its .wandb log."""
    (path,) = (run_dir / "wandb").glob("offline-run-*")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=READER_TIMEOUT_S, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def tensorboard_scalars(run_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_console_wandb_offline_and_tensorboard_get_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: the run stays in <run_dir>/wandb
    run = tmp_path / "run"
    # the default task: any other task.* setting warms up and caches a built-in model of its own (600 SFT steps)
    start(run, "--actors", "1", "trainer.total_steps=2", "trainer.logger=[console,wandb,tensorboard]",
          "trainer.project_name=logtest", "trainer.export_hf=false", "trainer.val_samples=1")
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == [0, 1]

    records = wandb_records(run)
    (header,) = [r["run"] for r in records if r["type"] == "run"]
    assert header["project"] == "logtest" and header["config"]["update"]["trainer"]["total_steps"] == 2
    history = {r["history"]["item"]["_step"]: r["history"]["item"] for r in records if r["type"] == "history"}
    tb = tensorboard_scalars(run)
    console = [x for x in (run / "logs" / "learner-0.log").read_text().splitlines() if " metrics: step:" in x]
    assert len(console) == 2, console
    for m in lines:
        step = m[M.STEP]
        for key in (M.REWARD_MEAN, M.LOSS, M.STALENESS_MEAN, M.SAMPLES_PER_S):
            assert history[step][key] == m[key], (key, step)
            assert abs(tb[key][step] - m[key]) <= 1e-6 * max(1.0, abs(m[key])), (key, step)  # float32 events
        assert f"step:{step} - " in console[step] and f"{M.REWARD_MEAN}:{m[M.REWARD_MEAN]:.6g}" in console[step]
