"""The calculator toy's prompts as verl parquet (data.calculator) and the tool warm-up of a real chat model
(data.tool_warmup, SmolLM2-135M-Instruct): its scripted episodes are the actors' own tokens."""
from __future__ import annotations

import json
import random

import pytest

from data.calculator import main as calculator_main
from data.dataset import read_rows
from data.tool_warmup import records_of, scripted_episode, warm_up
from envs.calculator import CalculatorConfig, CalculatorReverseEnv
from envs.episode import ChatRenderer


@pytest.fixture(scope="module")
def calc_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("calc")
    assert calculator_main(["--local_dir", str(d), "--size", "40", "--val_size", "8"]) == 0
    return d


def test_the_prompts_are_verl_rows_and_the_test_split_is_unseen(calc_data):
    train, test = read_rows(str(calc_data / "train.parquet")), read_rows(str(calc_data / "test.parquet"))
    assert (len(train), len(test)) == (40, 8)
    assert {r.data_source for r in train + test} == {"calculator_reverse"}
    assert {r.extra_info["task"] for r in train} == {"sum", "reverse"}
    assert not {r.messages[0]["content"] for r in train} & {r.messages[0]["content"] for r in test}


def test_scripted_episodes_are_what_an_actor_renders_and_noise_makes_them_wrong(calc_data, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    renderer, rng = ChatRenderer(tok), random.Random(0)
    records = records_of(str(calc_data / "train.parquet"), tok)
    for rec in records[:4]:
        ids, labels, reward = scripted_episode(rec, renderer, rng, noise=0.0)
        prompt = renderer.prompt_ids(CalculatorReverseEnv(CalculatorConfig(max_turns=3)).reset(rec))
        assert ids[:len(prompt)] == prompt and all(y == -100 for y in labels[:len(prompt)])
        turns = tok.decode([y for y in labels if y != -100])
        assert turns.startswith("<tool>") and turns.endswith(f"<answer>{rec['answer']}</answer><|im_end|>"), turns
        assert reward == 1.0
    noisy = [scripted_episode(r, renderer, rng, noise=0.5)[2] for r in records]
    assert 0.1 < sum(noisy) / len(noisy) < 0.9, noisy


def test_the_warm_up_saves_a_model_and_what_it_trained_on(calc_data, smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tool"
    s = warm_up(smollm2_path, str(calc_data / "train.parquet"), str(out), steps=1, batch_size=1, lr=3e-5, noise=0.4)
    assert json.loads((out / "tool_warmup.json").read_text()) == s
    assert s["steps"] == 1 and 0 < s["final_loss"] < 20 and 0 <= s["scripted_reward"] <= 1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert str(next(model.parameters()).dtype) == "torch.bfloat16"
    assert (out / "tokenizer_config.json").exists()
