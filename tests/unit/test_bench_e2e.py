"""bench/e2e.py's driver: a row that fails is reported and the rows around it are kept; --config reaches
every row (our subprocesses' command lines, the TRL rows' load_config)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import e2e
from cluster.config import load_config
from learner import metric_names as M

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def fake_row(name: str) -> dict:
    return {"name": name, "wall_s": 2.0, "train_wall_s": 2.0, "samples": 64, "rewards": [0.1, 0.7, 0.7, 0.7, 0.7, 0.7],
            "times": [0.2, 0.4, 0.6, 0.8, 1.0, 1.2], "val_start": 0.4, "val_end": 0.7,
            "lines": [{M.TIME: 0.0, M.WAIT_S: 0.1, M.TRAIN_S: 0.1, M.WS_PUBLISH_S: 0.01},
                      {M.TIME: 0.5, M.WAIT_S: 0.2, M.TRAIN_S: 0.2, M.WS_PUBLISH_S: 0.05}]}


def test_a_failed_row_keeps_the_others(tmp_path, monkeypatch, capsys):
    def run_ours(name, out, steps, overrides, config=None):
        if name == "ours_s0":
            raise RuntimeError("ours_s0 failed: learner died")
        return fake_row(name)

    def run_trl(out, steps, overrides, vllm=False, config=None):
        if vllm:
            return fake_row("trl_vllm")
        raise ValueError("cannot pickle MonthDayNano")

    monkeypatch.setattr(e2e, "run_ours", run_ours)
    monkeypatch.setattr(e2e, "run_trl", run_trl)
    rc = e2e.main(["--steps", "6", "--only", "sync,ours_s0,trl,trl_vllm,ours_async", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    # the rows before and after the failures were measured, saved one by one and tabled
    assert json.loads((tmp_path / "sync.json").read_text())["samples"] == 64
    assert [r["name"] for r in json.loads((tmp_path / "e2e.json").read_text())] == ["sync", "trl_vllm", "ours_async"]
    # the 5-step mean first reaches 0.6 over steps 2-6 (0.58 over steps 1-5), at t=1.2 s
    assert "| sync | 64 | 2.0 s | 32.0 | 1.2 s |" in out
    assert "| trl | failed |" in out and "| ours_s0 | failed |" in out
    # each failure leaves its whole traceback, named in the output
    assert "cannot pickle MonthDayNano" in (tmp_path / "trl.error.txt").read_text()
    assert "Traceback" in (tmp_path / "ours_s0.error.txt").read_text()
    assert not (tmp_path / "trl.json").exists()
    assert "| weight publication | 0.050 |" in out   # the async row's profile still printed


@pytest.mark.parametrize("only", ["sync,verl", "sync,trl,sync"])
def test_unknown_or_repeated_rows_are_refused(tmp_path, only):
    with pytest.raises(SystemExit) as e:
        e2e.main(["--only", only, "--out", str(tmp_path)])
    assert e.value.code == 2


def test_the_trl_vllm_row_needs_a_gpu(tmp_path):
    """TRL's colocated vLLM runs on CUDA only: on a CPU config the row says so before importing TRL."""
    with pytest.raises(ValueError, match="trl_vllm row needs a CUDA GPU"):
        e2e.run_trl(tmp_path, 2, ["learner.device=cpu"], vllm=True)


def cpu_config(tmp_path, parquet: bool = False) -> str:
    """A config file as an operator writes one: CPU learner, small batches; with `parquet`, verl-schema
    files of the built-in task's strings (data_source reverse) instead of the built-in task."""
    lines = ["learner:", "  device: cpu", "  groups_per_step: 2", "actors:", "  n: 2", "  max_tokens: 8",
             "trainer:", "  val_samples: 1"]
    if parquet:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        for split, words in {"train": ["abcd", "bcda", "cdab", "dabc", "hgfe", "efgh"], "val": ["aabb", "ccdd"]}.items():
            pq.write_table(pa.table({"data_source": ["reverse"] * len(words),
                                     "prompt": [[{"role": "user", "content": w + ">"}] for w in words],
                                     "reward_model": [{"style": "rule", "ground_truth": w[::-1]} for w in words]}),
                           tmp_path / f"{split}.parquet")
        lines += ["data:", f"  train_files: [{tmp_path / 'train.parquet'}]",
                  f"  val_files: [{tmp_path / 'val.parquet'}]", "  shuffle: false"]
    f = tmp_path / "cfg.yaml"
    f.write_text("\n".join(lines) + "\n")
    return str(f)


def test_config_reaches_every_row(tmp_path, monkeypatch):
    seen = {}

    def run_ours(name, out, steps, overrides, config=None):
        seen[name] = (config, overrides)
        return fake_row(name)

    def run_trl(out, steps, overrides, vllm=False, config=None):
        name = "trl_vllm" if vllm else "trl"
        seen[name] = (config, overrides)
        return fake_row(name)

    monkeypatch.setattr(e2e, "run_ours", run_ours)
    monkeypatch.setattr(e2e, "run_trl", run_trl)
    f = cpu_config(tmp_path)
    assert e2e.main(["--config", f, "--steps", "6", "--out", str(tmp_path), "learner.lr=1e-5"]) == 0
    assert seen == {name: (f, ["learner.lr=1e-5"]) for name in e2e.ROWS}


def test_config_goes_on_our_rows_command_lines(tmp_path, monkeypatch):
    """cluster.start and experiments.sync each get --config FILE, the overrides after it (so they win)."""
    cmds = []

    def fake_run(cmd, **_kw):
        cmds.append(cmd)
        run = Path(cmd[cmd.index("--run-dir") + 1])
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps(
            {M.TIME: 1.0, M.REWARD_MEAN: 0.5, M.SAMPLES: 4, M.VAL_REWARD_INITIAL: 0.3, M.VAL_REWARD: 0.4}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    f = cpu_config(tmp_path)
    for name in ("ours_async", "sync"):
        assert e2e.run_ours(name, tmp_path, 3, ["actors.n=2"], config=f)["val_end"] == 0.4
    for cmd, module in zip(cmds, ["cluster.start", "experiments.sync"]):
        assert cmd[1:3] == ["-m", module]
        assert cmd[cmd.index("--config") + 1] == f and cmd[-1] == "actors.n=2"
    # without --config the command lines are as before
    e2e.run_ours("ours_s0", tmp_path, 3, [])
    assert "--config" not in cmds[-1]


@pytest.mark.parametrize("module", ["cluster.start", "experiments.sync"])
def test_our_entry_points_take_config(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--config" in out.stdout, out.stderr[-500:]


def test_the_trl_vllm_row_on_a_cpu_config_file_says_why(tmp_path, capsys):
    """The config file reaches the TRL rows' load_config: its learner.device=cpu is the reason given."""
    f = cpu_config(tmp_path)
    assert e2e.main(["--config", f, "--only", "trl_vllm", "--steps", "2", "--out", str(tmp_path)]) == 1
    err = (tmp_path / "trl_vllm.error.txt").read_text()
    assert "ValueError: the trl_vllm row needs a CUDA GPU" in err and "learner.device=cpu" in err
    assert "| trl_vllm | failed |" in capsys.readouterr().out


def test_the_trl_vllm_row_on_the_smollm2_config_without_a_gpu_says_why(tmp_path):
    """configs/gsm8k_smollm2.yaml asks for learner.device=cuda: on a host without CUDA the row says so
    before TRL is imported (and before the model is built)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA host runs this row")
    cpu_config(tmp_path, parquet=True)  # the SmolLM2 config's data files are on the GPU host: these instead
    data = [f"data.train_files=[{tmp_path / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'val.parquet'}]"]
    with pytest.raises(ValueError, match="trl_vllm row needs a CUDA GPU.*learner.device=cuda and torch sees no GPU"):
        e2e.run_trl(tmp_path, 2, data, vllm=True, config=str(ROOT / "configs" / "gsm8k_smollm2.yaml"))


def test_a_missing_config_file_is_refused_before_any_row(tmp_path):
    with pytest.raises(SystemExit) as e:
        e2e.main(["--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)])
    assert e.value.code == 2 and not list(tmp_path.glob("*.json"))


def test_trl_row_on_a_parquet_config(tmp_path, monkeypatch):
    """TRL's GRPOTrainer (transformers generation, CPU) trains on the config's parquet prompts in the order
    our job leases them (file order: data.shuffle=false) and is scored on its validation file; runs where
    `.[bench]` is installed (about 15 s on 2 cores)."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    built = {}
    build = e2e.trl_vllm.build

    def spy(*args, **kw):
        built["trainer"], built["val"], *_ = out = build(*args, **kw)
        return out

    monkeypatch.setattr(e2e.trl_vllm, "build", spy)
    r = e2e.run_trl(tmp_path, 2, [], config=cpu_config(tmp_path, parquet=True))
    # 2 steps x 2 groups: the first four training rows; the two validation rows
    assert built["trainer"].train_dataset["prompt"] == ["abcd>", "bcda>", "cdab>", "dabc>"]
    assert [p.prompt_id for p in built["val"]] == ["val:0", "val:1"]
    assert r["name"] == "trl" and r["samples"] == 2 * 2 * 2 and len(r["rewards"]) == 2
    assert 0.0 <= r["val_end"] <= 1.0


def test_trl_trains_the_same_lora_adapter_as_our_learner(tmp_path):
    """learner.lora reaches TRL's GRPOTrainer as PEFT's adapter of the same rank, alpha and target modules on the
    frozen base: only the adapter trains, in TRL as in our learner (the LoRA rows beside TRL + PEFT)."""
    pytest.importorskip("trl")
    cfg = load_config(cpu_config(tmp_path), ["learner.lora.rank=4", "learner.lora.alpha=8",
                                             "learner.lora.target_modules=[q_proj,v_proj]"])
    trainer, *_ = e2e.trl_vllm.build(cfg, tmp_path, n_prompts=4, vllm=False, on_gpu=False)
    model = trainer.model
    conf = model.peft_config["default"]
    assert (conf.r, conf.lora_alpha, sorted(conf.target_modules)) == (4, 8, ["q_proj", "v_proj"])
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained), sorted(trained)[:4]
    assert all(("q_proj" in n or "v_proj" in n) for n in trained)


def test_fewer_than_two_steps_are_refused_before_any_row(tmp_path):
    with pytest.raises(SystemExit) as e:
        e2e.main(["--steps", "1", "--out", str(tmp_path)])
    assert e.value.code == 2 and not list(tmp_path.glob("*.json"))
