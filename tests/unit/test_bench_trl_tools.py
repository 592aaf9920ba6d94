"""bench/trl_tools.py: TRL's GRPOTrainer plays our multi-turn environment with its own tool loop. Its prompt and
observation tokens are the ones our ChatRenderer makes; on configs/tool_toy.yaml (tiny-tool model, transformers
generation on CPU) its episodes take several turns with the tool's result read in between, end on the turn our
environment ends them, and are rewarded with their return in the environment. Runs where `.[bench]` is installed."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import e2e, trl_tools, trl_vllm
from cluster.config import load_config
from data.tiny_model import resolve_model_path
from envs.episode import MAX_EPISODE_TOKENS, ChatRenderer

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "tool_toy.yaml")
# a CPU-sized step of the toy: 2 prompts x 4 episodes
SMALL = ["learner.device=cpu", "learner.groups_per_step=2", "actors.n=4", "trainer.val_samples=1"]


def tiny_tool_path() -> str:
    """The tiny-tool model's folder (trained once into the test cache at first use: not at collection, where it held
    up every worker)."""
    return resolve_model_path("builtin:tiny-tool", load_config(TOY, []).task)


@pytest.mark.parametrize("model", ["tiny-tool", "smollm2"])
def test_trl_sees_our_prompt_and_observation_tokens(model, request):
    """TRL accepts the tool tokenizer (the tiny-tool model's, and SmolLM2's: ChatML, a chat template with role
    headers), reads a whole turn as one `step` call, and (its own code computing them) renders prompts and the
    tokens after a turn exactly as our ChatRenderer does."""
    path = tiny_tool_path() if model == "tiny-tool" else str(request.getfixturevalue("smollm2_path"))
    pytest.importorskip("trl")
    from transformers import AutoTokenizer
    from trl import GRPOTrainer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    tok, ttok = AutoTokenizer.from_pretrained(path), trl_tools.tool_tokenizer(path, "user")
    ours = ChatRenderer(tok)
    assert supports_tool_calling(ttok) and is_chat_template_prefix_preserving(ttok)
    first = [{"role": "user", "content": "What is the sum of 12 and 30?"}]
    prompt = ttok.apply_chat_template(conversation=[first], tools=[trl_tools.EnvAdapter.step],
                                      add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
    assert prompt == ours.prompt_ids(first)   # the tool schema is not shown: our prompts carry none
    turn = "I add them.\n<tool>calc: 12 + 30</tool>"
    parsed = parse_response(ttok, tok(turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                            prefix=prompt, tools=[trl_tools.EnvAdapter.step])
    (call,) = parsed["tool_calls"]
    assert call["function"]["name"] == trl_tools.STEP and call["function"]["arguments"]["turn"].startswith(turn)
    obs = "<result>42</result>"
    trainer = SimpleNamespace(processing_class=ttok, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
                              _tokenizer=ttok)
    after = GRPOTrainer._get_tool_suffix_ids(trainer, [{"role": "tool", "name": trl_tools.STEP, "content": obs}])
    assert after == ours.observation_ids([{"role": "user", "content": obs}], turn_ended=True)


def test_episode_over_text_passes_the_budget():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tool_path())
    assert len(tok(trl_tools.episode_over_text(tok, 96))["input_ids"]) > 96


def replay(cfg, record: dict, texts: list[str]) -> tuple[float, bool]:
    """(return, whether the episode ended on its last turn) of `texts` played in a fresh environment."""
    env = cfg.env.make()
    env.reset(record)
    results = [env.step(t) for t in texts]
    env.close()
    return sum(r.reward for r in results), results[-1].done and not any(r.done for r in results[:-1])


@pytest.fixture
def spied(monkeypatch):
    """bench.e2e's TRL row with its trainer's reward function tapped: per scored batch, its episodes (the
    adapter's counts and texts), TRL's completions and completion ids, the rewards TRL trained on."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    batches, built = [], {}
    build = trl_tools.build

    def spy_build(*args, **kw):
        built["trainer"], built["val"], _, built["tok"] = out = build(*args, **kw)
        reward = built["trainer"].reward_funcs[0]

        def tap(**kw):
            rs = reward(**kw)
            batches.append([(env._episode(c), c, ids, i, r) for env, c, ids, i, r in
                            zip(kw["environments"], kw["completions"], kw["completion_ids"], kw["record_index"], rs)])
            return rs

        built["trainer"].reward_funcs[0] = tap
        return out

    monkeypatch.setattr(e2e.trl_tools, "build", spy_build)
    return batches, built


def test_trl_row_plays_our_episodes(tmp_path, spied):
    """Two TRL steps on the toy (bench.e2e's `trl` row): episodes of two turns, the tool's result read in
    between, each rewarded with its return in our environment and ended on the turn the environment ended it."""
    batches, built = spied
    r = e2e.run_trl(tmp_path, 2, SMALL, config=TOY)
    cfg, tok = load_config(TOY, SMALL), built["tok"]
    assert r["name"] == "trl" and len(batches) == 2 and all(len(b) == 8 for b in batches)
    # the rows: our job's first 2 x 2 training prompts in order, each the environment's first messages
    records = [p.record() for p in trl_vllm.training_prompts(cfg, tok, 4)[0]]
    assert built["trainer"].train_dataset["prompt"] == [cfg.env.make().reset(rec) for rec in records]
    eps = [x for b in batches for x in b]
    for ep, completion, ids, index, reward in eps:
        assert reward == ep["return"] and ep["turns"] == sum(m["role"] == "assistant" for m in completion)
        ret, ended_there = replay(cfg, records[index], ep["texts"])
        assert ret == pytest.approx(reward)   # the reward TRL trained on is the environment's return
        if ep["reason"] != MAX_EPISODE_TOKENS:   # every turn but the last got the environment's answer back
            assert ended_there and ep["observations"] == ep["turns"] - 1
        obs = [m["content"] for m in completion if m["role"] == "tool"]
        parts = [p for i, t in enumerate(ep["texts"]) for p in [t, *obs[i:i + 1]]]
        assert tok.decode(ids, skip_special_tokens=True) == "".join(parts)   # TRL's tokens: turns and results
    multi = [ep for ep, *_ in eps if ep["observations"] >= 1 and ep["turns"] >= 2]
    assert len(multi) >= len(eps) // 2 and all(ep["tool_calls"] >= 1 for ep in multi)
    assert any(ep["return"] > 0 for ep in multi) and 0.0 <= r["val_end"] <= 1.0


def test_trl_stops_where_the_environment_ends_the_episode(tmp_path, spied):
    """env max_turns=1: the environment ends every episode on its first turn (a tool call, for this model), so
    TRL must not hand a result back nor generate a second turn."""
    batches, _ = spied
    e2e.run_trl(tmp_path, 2, [*SMALL, "env.options.max_turns=1"], config=TOY)
    eps = [x for b in batches for x in b]
    assert all(ep["turns"] == 1 and ep["observations"] == 0 for ep, *_ in eps)
    assert sum(ep["reason"] == "max_turns" for ep, *_ in eps) >= len(eps) // 2


def test_each_module_points_to_the_other(tmp_path):
    """A config with env.name is refused by bench.trl_vllm (it would train single-turn on the episodes' prompts),
    one without by bench.trl_tools, before anything is built."""
    with pytest.raises(SystemExit, match="bench.trl_tools"):
        trl_vllm.main(["--config", TOY, "--out", str(tmp_path)])
    plain = tmp_path / "plain.yaml"
    plain.write_text("learner:\n  device: cpu\n")
    with pytest.raises(SystemExit, match="bench.trl_vllm"):
        trl_tools.main(["--config", str(plain), "--out", str(tmp_path)])


def test_a_wall_clock_run_sums_up_its_episodes(tmp_path):
    """bench/trl_vllm.py's wall-clock run with this module's trainer (transformers generation here, as vLLM needs
    a GPU): stopped after its second step, its summary line carries the episodes' means and end reasons."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    import functools
    import json

    cfg = load_config(TOY, SMALL)
    args = trl_vllm.arg_parser("").parse_args(["--config", TOY, "--out", str(tmp_path), "--seconds", "0.01",
                                                "--val-every-s", "1000"])
    tally = trl_tools.EpisodeTally()
    build = functools.partial(trl_tools.build, vllm=False, on_gpu=False, on_episodes=tally.add)
    trl_vllm.run(cfg, args, build, lambda *_a: {"accuracy": 0.5, "reward": 0.5, "samples": 1}, tally.summary)
    lines = [json.loads(x) for x in (tmp_path / "trl.metrics.jsonl").read_text().splitlines()]
    summary = lines[-1]
    assert summary["summary"] and summary["steps"] == 2 and summary["episodes"]["n"] == 2 * 8
    assert 1 <= summary["episodes"]["mean"]["turns"] <= 3 and sum(summary["episodes"]["reasons"].values()) == 16
    assert summary["lengths"]["n"] == 16   # each episode's tokens, the environment's among them


class FakeLLM:
    """Stands in for TRL's vLLM engine: the toy's right answer at each turn, the sampling parameters kept."""

    def __init__(self, tok):
        self.tok, self.params = tok, []

    def generate(self, prompts, params, use_tqdm=False):
        self.params += params
        outs = []
        for p, sp in zip(prompts, params):
            text = self.tok.decode(p["prompt_token_ids"], skip_special_tokens=True)
            reply = (f"<answer>{text.split('<result>')[1].split('<')[0]}</answer>" if "<result>" in text
                     else f"<tool>reverse: {text.rstrip('>')}</tool>")
            ids = self.tok(reply, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason="stop")] * sp.n))
        return outs


def test_the_held_out_evaluation_plays_episodes_on_trls_engine():
    """`evaluate` plays the held-out prompts' episodes with our episode player on TRL's vLLM engine (here a
    stand-in that answers right), each prompt seeded on its own, and scores them by their return."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    cfg = load_config(TOY, SMALL)
    tok = AutoTokenizer.from_pretrained(tiny_tool_path())
    llm = FakeLLM(tok)
    synced = []
    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(llm=llm, sync_weights=lambda: synced.append(1)))
    _, val = trl_vllm.training_prompts(cfg, tok, 1)
    r = trl_tools.evaluate(trainer, val[:6], None, tok, cfg)
    assert synced and r["reward"] == 1.0 and r["accuracy"] == 1.0 and r["samples"] == 6
    seeds = [sp.seed for sp in llm.params[:6]]   # the first turn's call: one seed per prompt
    assert len(set(seeds)) == 6 and all(sp.max_tokens == cfg.actors.max_tokens for sp in llm.params[:6])
