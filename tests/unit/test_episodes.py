"""Episodes in tokens (envs/episode.py) and streamed by the actor's EpisodeEngine (actors/episodes.py), on the
built-in tiny-tool model and the HF engine: the sample is the exact sequence the engine saw, masks and behavior
logprobs match a replay of it, and a hanging or crashing tool ends only its own episode."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from actors.episodes import EpisodeEngine
from data.tasks import TaskConfig, val_prompts
from data.tiny_model import TOOL_CHAT_TEMPLATE, resolve_model_path
from data.tokenizer import build_byte_tokenizer
from engines.core import SamplingParams
from engines.hf_engine import HFEngine
from envs.calculator import CalculatorReverseEnv
from envs.config import EpisodesConfig
from envs.core import TOOL_ERROR, TOOL_TIMEOUT
from envs.episode import MAX_EPISODE_TOKENS, ChatRenderer, EpisodePlayer
from envs.registry import ENVIRONMENTS, register_env
from envs.tools import ERROR, ToolFailure

pytestmark = pytest.mark.unit

TOY = dict(name="calculator_reverse", options={"instructions": False, "max_turns": 3})
PARAMS = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=32, seed=0)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def engine():
    return HFEngine(resolve_model_path("builtin:tiny-tool", TaskConfig()))


def records(n: int) -> list[dict]:
    return [p.record() for p in val_prompts(TaskConfig())[:n]]


def test_renderer_appends_observations_as_the_template_renders_the_whole_conversation():
    tok = build_byte_tokenizer()
    tok.chat_template = CHATML
    r = ChatRenderer(tok)
    first = [{"role": "user", "content": "2+2?"}]
    turn = tok("<tool>calc: 2+2</tool>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    obs = [{"role": "user", "content": "<result>4</result>"}]
    ids = r.prompt_ids(first) + turn + r.observation_ids(obs, turn_ended=True)
    whole = first + [{"role": "assistant", "content": "<tool>calc: 2+2</tool>"}] + obs
    assert ids == tok(tok.apply_chat_template(whole, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    # a turn cut before its EOS gets the whole closing from the environment: the same text follows
    cut = r.observation_ids(obs, turn_ended=False)
    assert cut == [tok.eos_token_id] + r.observation_ids(obs, turn_ended=True)


def test_renderer_refuses_a_tokenizer_without_a_chat_template():
    with pytest.raises(ValueError, match="chat template"):
        ChatRenderer(build_byte_tokenizer())


def test_masks_and_logprobs_match_a_replay_of_the_episode(engine):
    eps = [e for per in EpisodePlayer(EpisodesConfig(**TOY), 96).play(engine, records(8), PARAMS) for e in per]
    answered = [e for e in eps if e.reason == "answered" and len(e.turns) == 2]
    assert answered, [e.reason for e in eps]
    tok = engine.tokenizer
    for e in answered:
        # the engine saw exactly the chat template's rendering of the conversation
        text = tok.apply_chat_template(e.messages, tokenize=False, add_generation_prompt=False)
        assert e.prompt_ids + e.response_ids == tok(text, add_special_tokens=False)["input_ids"]
        # the mask is 1 exactly on the assistant turns (each ends with EOS), 0 on the tool's result
        mask = np.zeros(len(e.response_ids), dtype=int)
        for off, _vs, _ve in e.turns:
            end = e.response_ids.index(tok.eos_token_id, off)
            mask[off:end + 1] = 1
        assert e.mask == mask.tolist()
        # behavior logprobs of the model's tokens are the model's own on a replay; the environment's are 0
        ids = torch.tensor([e.prompt_ids + e.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(engine.model(ids).logits[0, :-1].float() / PARAMS.temperature, -1)
        replay = lp.gather(1, ids[0, 1:, None])[:, 0].numpy()[len(e.prompt_ids) - 1:]
        m = np.array(e.mask, dtype=bool)
        np.testing.assert_allclose(np.array(e.logprobs)[m], replay[m], atol=1e-4)
        assert not np.any(np.array(e.logprobs)[~m])


def test_an_episode_longer_than_its_token_limit_ends_with_that_reason(engine):
    eps = EpisodePlayer(EpisodesConfig(**TOY), 40).play(engine, records(4), PARAMS)
    ended = [e for per in eps for e in per if e.reason == MAX_EPISODE_TOKENS]
    assert ended and all(len(e.response_ids) <= 40 for per in eps for e in per)


class FlakyTools(CalculatorReverseEnv):
    """The toy whose `reverse` hangs on prompts starting with `a` and raises on those starting with `b`."""

    def __init__(self, config=None, runner=None):
        def reverse(text: str) -> str:
            if self.record["prompt_id"].startswith("a"):
                time.sleep(30)
            if self.record["prompt_id"].startswith("b"):
                raise ToolFailure(ERROR, "the tool crashed")
            return text[::-1]

        super().__init__(config, runner, tools={"reverse": reverse})


def test_a_hanging_and_a_crashing_tool_end_their_own_episodes_while_the_others_go_on(engine):
    register_env("flaky_tools", FlakyTools)
    try:
        cfg = EpisodesConfig(name="flaky_tools", options={"instructions": False, "tool_timeout_s": 1.0})
        eng = EpisodeEngine(engine, cfg, max_tokens=96)
        recs = [r for r in (p.record() for p in val_prompts(TaskConfig())) if r["prompt_id"][0] in "abc"][:6]
        for i, rec in enumerate(recs):
            eng.start(f"g{i}", rec, PARAMS)
        done, t0 = {}, time.monotonic()
        while eng.in_flight() and time.monotonic() - t0 < 20:
            done.update(eng.step())
        eng.close()
    finally:
        ENVIRONMENTS.pop("flaky_tools")
    assert len(done) == len(recs) and eng.in_flight() == 0
    for i, rec in enumerate(recs):
        called = [e for e in done[f"g{i}"] if e.env.tool_calls]
        want = {"a": TOOL_TIMEOUT, "b": TOOL_ERROR}.get(rec["prompt_id"][0])
        if want:
            assert called and all(e.reason == want and e.total_reward == 0 for e in called), (rec, want)
        else:
            assert all(e.reason in ("answered", "format_error") for e in done[f"g{i}"])
    assert eng.stats()["episode_reasons"].get(TOOL_TIMEOUT)
    assert time.monotonic() - t0 < 20   # the hung calls cost their timeout, not their 30 s


def test_the_readme_environment_example_runs_as_written(tmp_path, monkeypatch):
    from pathlib import Path

    from envs.core import FORMAT_ERROR, run_episode

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Multi-turn episodes and tools"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("\n```", section.index("```python"))]
    (tmp_path / "readme_envs.py").write_text(code)   # its own module name: another test imports a `my_envs`
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = EpisodesConfig(name="readme_envs:LookupEnv", options={"max_turns": 3})
    rec = {"prompt_id": "q", "data_source": "openai/gsm8k", "answer": "8",
           "messages": [{"role": "user", "content": "How many legs does a spider have?"}]}
    policy = iter(["LOOKUP legs of a spider", "ANSWER The answer is #### 8"])
    ep = run_episode(cfg.make(), rec, lambda _msgs: next(policy))
    assert ep.reason == "answered" and ep.total_reward == 1.0
    assert ep.messages[2] == {"role": "user", "content": "RESULT 8"}
    assert run_episode(cfg.make(), rec, lambda _msgs: "8").reason == FORMAT_ERROR
    missing = run_episode(cfg.make(), rec, lambda _msgs: "LOOKUP legs of a cat")
    assert missing.reason == TOOL_ERROR and "KeyError" in missing.detail
