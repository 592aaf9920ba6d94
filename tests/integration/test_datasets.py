"""verl-schema datasets through the whole system, and the offline SmolLM2 model.

A parquet laid out exactly like verl's examples/data_preprocess/gsm8k.py
output (built here by hand, not by our writer) trains with `python -m cluster.start` unchanged.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray_shared

from learner import metric_names as M

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 400  # a loaded 2-core CI machine; a healthy tiny-model run takes ~30 s
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
PROBLEMS = [  # (question, full GSM8K solution, ground truth as verl extracts it)
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
     "clips did Natalia sell altogether in April and May?", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
     "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72", "72"),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she "
     "earn?", "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
     "$<<0.2*50=10>>10.\n#### 10", "10"),
    ("Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her "
     "parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How "
     "much more money does Betty need to buy the wallet?", "In the beginning, Betty has only 100 / 2 = $<<100/2=50"
     ">>50.\nBetty's grandparents gave her 15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = "
     "$<<100-50-30-15=5>>5 more.\n#### 5", "5"),
    ("James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
     "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 pages every week\nThat "
     "means he writes 12*52=<<12*52=624>>624 pages a year\n#### 624", "624"),
]


def verl_gsm8k_rows(split: str) -> list[dict]:
    """Rows as verl's gsm8k.py `process_fn` returns them (same keys, order and values)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": q + " " + INSTRUCTION}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": gt},
             "extra_info": {"split": split, "index": i, "answer": a, "question": q}}
            for i, (q, a, gt) in enumerate(PROBLEMS)]


def start(run_dir: Path, *args: str, timeout: int = START_TIMEOUT_S) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cluster.start", "--run-dir", str(run_dir), *ray_shared.job_args(), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}"
    return res


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_verl_gsm8k_parquet_trains(tmp_path):
    for split in ("train", "test"):
        # pyarrow infers the types from the dicts, as HF datasets' to_parquet does for verl
        pq.write_table(pa.Table.from_pylist(verl_gsm8k_rows(split)), tmp_path / f"{split}.parquet")
    run = tmp_path / "run"
    res = start(run, "--actors", "1", f"data.train_files=[{tmp_path}/train.parquet]",
                f"data.val_files=[{tmp_path}/test.parquet]", "data.max_prompt_length=512",
                "trainer.total_steps=2", "learner.groups_per_step=4", "actors.groups_per_batch=4",
                "trainer.val_samples=2", "trainer.tensorboard=false", "trainer.export_hf=false")
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == [0, 1]
    for m in lines:
        assert m[M.SAMPLES] == 4 * 8 and 0.0 <= m[M.REWARD_MEAN] <= 1.0
    # validation ran on the parquet's test rows with the GSM8K scorer, at step 0 and at the end
    assert 0.0 <= lines[0][M.VAL_ACCURACY_INITIAL] <= 1.0 and 0.0 <= lines[-1][M.VAL_ACCURACY] <= 1.0
    assert "val_accuracy_end" in res.stdout
    log = (run / "logs" / "learner-0.log").read_text()
    assert f"data: 4 training prompts from ['{tmp_path}/train.parquet'], 4 validation prompts" in log
    # the tiny model has 128 positions: the HF engine would run a 512-token prompt past them, said at start
    assert "is past the model's 128 positions" in (run / "logs" / "launcher.log").read_text()
    # the resolved config records the dataset (what a later reader needs to reproduce the run)
    assert f"{tmp_path}/train.parquet" in (run / "config.yaml").read_text()


def test_bad_dataset_fails_before_anything_starts(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "#### 1"}]), tmp_path / "raw.parquet")
    res = subprocess.run([sys.executable, "-m", "cluster.start", "--run-dir", str(tmp_path / "r"),
                          f"data.train_files=[{tmp_path}/raw.parquet]", f"data.val_files=[{tmp_path}/raw.parquet]"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 2
    assert "data.train_files[0]" in res.stderr and "missing column(s) ['data_source', 'prompt', 'reward_model']" \
        in res.stderr


@pytest.mark.slow
def test_smollm2_folder_loads_everywhere_and_answers(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.core import SamplingParams
    from engines.hf_engine import HFEngine
    from learner.model import load_policy
    from weightsync.flat import checksum

    assert (smollm2_path / "model.safetensors").exists() and (smollm2_path / "conversion.json").exists()
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply, reply  # de-quantized weights and tokenizer fit together: a sensible answer
    # the HF engine (actors) and the learner load the same weights as version 0
    engine = HFEngine(str(smollm2_path))
    policy = load_policy(str(smollm2_path), torch.device("cpu"))
    assert engine.checksum == checksum(policy.state_dict())
    [[c]] = engine.generate([ids["input_ids"][0].tolist()], SamplingParams(n=1, temperature=1.0, top_p=1.0,
                                                                            max_tokens=8, seed=0))
    assert len(c.token_ids) >= 1 and all(lp <= 0 for lp in c.logprobs)


@pytest.mark.slow
def test_gsm8k_smollm2_config_runs_on_cpu(tmp_path, smollm2_path):
    """configs/gsm8k_smollm2.yaml (meant for a GPU) runs on CPU with small overrides, on its chain_sum data (the
    GPU runs' short-prompt task: a step of SmolLM2 on CPU costs a third of gsm_symbolic's ~300-token prompts')."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install -e '.[data]')")
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "data.reasoning_gym", "--task", "chain_sum", "--size", "8",
                    "--val_size", "2", "--answer_format", "gsm8k", "--kw", "min_terms=2", "max_terms=2",
                    "min_digits=1", "max_digits=2", "--local_dir", str(data)], check=True, cwd=ROOT,
                   capture_output=True)
    run = tmp_path / "run"
    start(run, "--config", str(ROOT / "configs" / "gsm8k_smollm2.yaml"), "--actors", "1",
          f"model.path={smollm2_path}", f"data.train_files=[{data}/train.parquet]",
          f"data.val_files=[{data}/test.parquet]", *CPU_OVERRIDES, "trainer.total_steps=1", timeout=600)
    lines = metrics(run)  # one step of 135M parameters on CPU is enough here
    assert [m[M.STEP] for m in lines] == [0]
    assert all(m[M.SAMPLES] == 2 * 2 and m[M.RESPONSE_LEN_MEAN] > 0 for m in lines)
    assert M.VAL_ACCURACY in lines[-1] and M.VAL_ACCURACY_INITIAL in lines[0]


# What turns the GPU config into a 2-step CPU smoke run (also in the README).
CPU_OVERRIDES = ["actors.device=cpu", "learner.device=cpu", "learner.param_dtype=float32", "actors.dtype=float32",
                 "actors.n=2",
                 "actors.groups_per_batch=2", "learner.groups_per_step=2", "actors.max_tokens=16",
                 "trainer.total_steps=2", "trainer.val_every=0", "trainer.val_samples=1", "data.val_max_prompts=2",
                 "trainer.tensorboard=false", "trainer.export_hf=false", "weightsync.backend=gloo",
                 "learner.kernels=none", "actors.max_inflight_seqs=0", "learner.plain_compute=autocast"]


def test_a_custom_reward_function_file_scores_every_process(tmp_path):
    """verl's custom_reward_function.path/.name: a scorer registered in the launcher's process would never
    reach the Ray processes that score, so the file is loaded by every process that scores: the actors'
    rewards and the learner's held-out rewards are its constant."""
    rows = [{"data_source": "mytask", "prompt": [{"role": "user", "content": w}], "ability": "x",
             "reward_model": {"style": "rule", "ground_truth": w[::-1]}, "extra_info": None}
            for w in ("abcd", "dcab", "bbca", "adcb", "cadb", "abdc", "dbca", "cbda")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "my_reward.py").write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'mytask' and isinstance(solution_str, str)\n"
        "    return {'score': 0.25}\n")
    data = [f"data.train_files=[{tmp_path}/train.parquet]", f"data.val_files=[{tmp_path}/train.parquet]"]
    bad = subprocess.run([sys.executable, "-m", "cluster.start", "--run-dir", str(tmp_path / "bad"), *data,
                          f"custom_reward_function.path={tmp_path}/my_reward.py"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "data.reward_fn_path" in bad.stderr and "defines no function 'compute_score'" \
        in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    run = tmp_path / "run"
    start(run, "--actors", "1", *data, f"custom_reward_function.path={tmp_path}/my_reward.py",
          "custom_reward_function.name=my_score", "trainer.total_steps=2", "trainer.tensorboard=false",
          "trainer.export_hf=false")
    lines = metrics(run)
    assert [m[M.REWARD_MEAN] for m in lines] == [0.25, 0.25]
    assert lines[0][M.VAL_REWARD_INITIAL] == 0.25 and lines[-1][M.VAL_REWARD] == 0.25
