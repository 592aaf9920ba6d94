"""TRL's GRPOTrainer on our multi-turn environments: the peer row for tool-using episodes, run on a config with
`env.name` set (the same environment, options and prompts as our job; the model, batch, samples per prompt,
sampling, learning rate and clip as bench/trl_vllm.py's row), each episode rewarded with its return in our
environment (the sum of its step rewards), as our learner is.

    python -m bench.trl_tools --config configs/tool_toy.yaml --seconds 200 --out DIR [overrides...]

Same arguments and output as bench/trl_vllm.py (DIR/trl.metrics.jsonl, held-out evaluations every --val-every-s
seconds of training); the summary line adds the episodes' means (turns, tool calls, observations read, seconds in
the environment). bench/e2e.py's `trl` and `trl_vllm` rows build their trainer here for such a config.

The TRL mechanism: `environment_factory` (TRL 1.16). TRL's own multi-turn loop (`GRPOTrainer._tool_call_loop`)
generates every turn, appends the tool result's tokens after the turn's without re-tokenising, and keeps them out
of the loss (`tool_mask`); `EnvAdapter` wraps one of our environments as the instance TRL builds per rollout.
`rollout_func` was the alternative: it would have run our own episode loop inside TRL's trainer, measuring our
multi-turn machinery rather than TRL's.

What TRL's loop needs that our environments do not offer, and what this module supplies instead:
- TRL continues an episode only after a turn its tokenizer parses into structured tool calls (`parse_response`
  with a `response_template`, which TRL ships only for known chat templates: Qwen, Llama 3.1, Gemma 4, ...), and
  it refuses a chat template that cannot render a tool-calling conversation (`supports_tool_calling`). The
  built-in models' templates (tiny-tool's messages back to back, SmolLM2's ChatML) render neither `tool_calls`
  nor `tool` messages, and our environments read each whole turn as text and decide themselves what it asks for.
  So the tokenizer handed to TRL gets a response template that reads every turn as one call of the adapter's one
  tool, `step(turn)`, with the whole turn's text, and the model's chat template behind a preamble that renders a
  `tool` message as the environment's observation (a message in its `observation_role`, as ours renders it) and
  hides tool schemas: the prompt and observation tokens are the ones our ChatRenderer produces.
- The environment, not the model's format, ends an episode. TRL ends a rollout when a turn has no tool call, and
  here every turn is one; so when the environment ends the episode, `step` returns a result longer than the
  episode's token budget, and TRL drops a tool result that would pass max_completion_length and ends that
  rollout's loop with the turns it has (its rule for over-long results). A TRL episode ends on the turn ours does.

Differences from ours, the environment and tokens being the same:
- Turns in lockstep: TRL generates one turn for every live episode, then calls each episode's `step` one after
  the other on its own thread (ours: each episode's next turn goes in when its tool result lands, environment
  steps on env.workers threads). Per episode, the seconds spent in `step` (tools included) are `env_s`.
- A turn is capped at actors.max_tokens and the episode at env.max_episode_tokens (TRL's max_completion_length,
  turns and observations together) in both; where the budget runs out, TRL cuts the last turn to fit and still
  plays it, ours plays it too and then ends the episode (max_episode_tokens).
- TRL decodes a turn with its special tokens; `step` removes them, as ours decodes with skip_special_tokens.
- An environment answers a turn with one message here (one tool result); one that answers with several is refused.
- TRL's own tool metrics count every turn as a tool call; the episodes' counts are logged as episodes/*.
- Held-out evaluation on TRL's vLLM engine: our episode player (envs/episode.py), episodes scored by their return.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np

from bench import trl_vllm
from cluster.config import load_config
from data.tiny_model import resolve_model_path
from engines.core import Completion
from envs.episode import MAX_EPISODE_TOKENS, EpisodePlayer
from envs.tools import ToolRunner
from rewards.scorers import record_scorer

STEP = "step"   # the adapter's one tool: every assistant turn is a call of it with the whole turn's text
# The text `step` repeats past the episode's token budget once the environment ended the episode (any text would
# do: TRL drops the result unread).
EPISODE_OVER = "[the episode is over] "
REASON_ERROR = "environment_error"   # the environment raised: the run stops at scoring, naming it

# Every turn is one `step` call whose argument is all the model wrote: generation starts where the prompt ends
# (nothing of the prefix is part of the turn) and the call opens at the turn's first character.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"\Z",
    "fields": {"tool_calls": {"open_pattern": r"\A", "repeats": True, "content": "text",
                              "transform": {"type": "function",
                                            "function": {"name": STEP, "arguments": {"turn": "{content}"}}}}},
}

# Put before the model's chat template: a `tool` message becomes the environment's observation in its role, an
# assistant message with tool calls a plain one (TRL renders one only to learn the tokens that follow a turn, and
# to check that the template shows calls at all), and tool schemas are never shown: our prompts carry none.
TOOL_PREAMBLE = """{%- set _obs = namespace(out=[]) -%}
{%- for m in messages -%}
{%- if m['role'] == 'tool' -%}
{%- set _obs.out = _obs.out + [{'role': '@ROLE@', 'content': m['content']}] -%}
{%- elif m['role'] == 'assistant' and m.get('tool_calls') -%}
{%- set _obs.out = _obs.out + [{'role': 'assistant', 'content': (m['content'] or '')
    ~ (m['tool_calls'] | map(attribute='function') | map('tojson') | join(''))}] -%}
{%- else -%}
{%- set _obs.out = _obs.out + [m] -%}
{%- endif -%}
{%- endfor -%}
{%- set messages = _obs.out -%}
{%- set tools = none -%}
"""


def tool_chat_template(template: str, observation_role: str) -> str:
    """The model's chat template as TRL's tool loop needs it (TOOL_PREAMBLE)."""
    return TOOL_PREAMBLE.replace("@ROLE@", observation_role) + template


def tool_tokenizer(path: str, observation_role: str):
    """The model's tokenizer for TRL: its chat template with TOOL_PREAMBLE, the response template that reads every
    turn as a `step` call."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):   # ours refuses such a model too (envs/episode.py ChatRenderer)
        raise ValueError(f"multi-turn episodes need a chat template; {path} has none")
    tok.chat_template = tool_chat_template(tok.chat_template, observation_role)
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def episode_over_text(tok, budget: int) -> str:
    """A text of more than `budget` tokens: the result `step` gives once the episode is over."""
    text = EPISODE_OVER
    while len(tok(text, add_special_tokens=False)["input_ids"]) <= budget:
        text += text
    return text


def _pairs(messages) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


class EnvAdapter:
    """One of our environments as the instance TRL's `environment_factory` builds per rollout (and reuses):
    `reset(**row)` starts the dataset row's episode, `step(turn)`, its only tool, plays one whole turn. Everything
    else is private, as TRL offers every public method to the model as a tool."""

    def __init__(self, make_env, records: list[dict], over: str, special: tuple[str, ...]):
        self._env = make_env()
        self._records, self._over, self._special = records, over, special
        self._start()

    def _start(self) -> None:
        self._rewards: list[float] = []
        self._texts: list[str] = []
        self._env_s = 0.0
        self._reason: str | None = None
        self._error: BaseException | None = None

    def reset(self, prompt=None, record_index: int = -1, **_) -> None:
        """Start the episode of one dataset row: `record_index` into the run's prompt records; the row's prompt
        is the environment's first messages already, so nothing is added to it (None)."""
        first = self._env.reset(self._records[record_index])
        if _pairs(first) != _pairs(prompt):   # an environment whose first messages vary between resets
            raise ValueError(f"{type(self._env).__name__} started record {record_index} with other messages than "
                             f"the dataset row holds: {_pairs(first)!r:.200} vs {_pairs(prompt)!r:.200}")
        self._start()

    def step(self, turn: str) -> str:
        """Play one assistant turn in the environment and return its answer to the turn.

        Args:
            turn: The assistant's whole turn, as it wrote it.
        """
        for s in self._special:
            turn = turn.replace(s, "")
        self._texts.append(turn)
        t0 = time.monotonic()
        try:
            result = self._env.step(turn)
        except Exception as e:  # TRL would hand the error to the model as a tool result: end here, raise at scoring
            self._error, self._reason = e, REASON_ERROR
            return self._over
        finally:
            self._env_s += time.monotonic() - t0
        self._rewards.append(result.reward)
        if result.done:
            self._reason = result.reason
            return self._over
        if len(result.observations) != 1:
            self._error = ValueError(f"{type(self._env).__name__} answered a turn with {len(result.observations)} "
                                     f"messages; TRL's tool loop carries one (a tool result) per turn")
            self._reason = REASON_ERROR
            return self._over
        return result.observations[0]["content"]

    def _episode(self, completion: list[dict]) -> dict:
        """The finished episode's return and counts; `completion`: its messages as TRL holds them."""
        if self._error is not None:
            raise RuntimeError(f"the environment failed on turn {len(self._texts)} of an episode: "
                               f"{type(self._error).__name__}: {self._error}") from self._error
        return {"return": float(sum(self._rewards)), "turns": len(self._texts),
                "tool_calls": getattr(self._env, "tool_calls", None),
                "observations": sum(m.get("role") == "tool" for m in completion),
                "env_s": self._env_s, "reason": self._reason or MAX_EPISODE_TOKENS, "texts": list(self._texts)}


def _log_means(log_metric, eps: list[dict]) -> None:
    """The batch's episode means as TRL metrics (episodes/*), beside TRL's own."""
    for key in ("turns", "tool_calls", "observations", "env_s"):
        vals = [e[key] for e in eps if e[key] is not None]
        if vals and log_metric is not None:
            log_metric(f"episodes/{key}", sum(vals) / len(vals))


def make_reward(on_reward=None, on_lengths=None, on_episodes=None):
    """TRL's one reward function: each episode's return in our environment. `on_reward(returns)`,
    `on_lengths(episode tokens)` and `on_episodes(per-episode dicts)` see each scored batch."""

    def env_return(prompts, completions, completion_ids=None, environments=None, log_metric=None, **_kw):
        eps = [env._episode(c) for env, c in zip(environments, completions)]
        rs = [e["return"] for e in eps]
        _log_means(log_metric, eps)
        if on_reward is not None:
            on_reward(rs)
        if on_lengths is not None and completion_ids is not None:  # the episode's tokens, the environment's too
            on_lengths([len(ids) for ids in completion_ids])
        if on_episodes is not None:
            on_episodes(eps)
        return rs

    return env_return


def build(cfg, out: Path, *, max_steps: int = 100_000, n_prompts: int | None = None, vllm: bool = True,
          on_gpu: bool = True, on_reward=None, on_lengths=None, on_episodes=None, micro_batch: int = 0,
          vllm_memory: float = 0.0):
    """bench/trl_vllm.py's `build` for a config with env.name: (trainer, validation prompts, scorer, tokenizer),
    the trainer's dataset one row per training prompt (the environment's first messages, the record's index)."""
    # lazy: bench.e2e imports this module for a driver that runs without them
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    if not cfg.env.multi_turn:
        raise ValueError("bench.trl_tools runs multi-turn episodes: the config sets no env.name")
    path = resolve_model_path(cfg.model.path, cfg.task)
    tok = AutoTokenizer.from_pretrained(path)   # the model's own template: prompts and the held-out episodes
    prompts, val = trl_vllm.training_prompts(cfg, tok, n_prompts)
    records = [p.record() for p in prompts]
    runner = ToolRunner(threads=cfg.env.workers)   # one per process, as our actors share theirs
    probe = cfg.env.make(runner)
    rows = [{"prompt": probe.reset(r), "record_index": i} for i, r in enumerate(records)]
    budget = cfg.env.episode_tokens(cfg.buffer)
    ttok = tool_tokenizer(path, probe.config.observation_role)
    probe.close()
    factory = functools.partial(EnvAdapter, functools.partial(cfg.env.make, runner), records,
                                episode_over_text(ttok, budget), tuple(ttok.all_special_tokens))
    args = trl_vllm.grpo_config(cfg, out, max_steps=max_steps, vllm=vllm, on_gpu=on_gpu, micro_batch=micro_batch,
                                vllm_memory=vllm_memory, eos_id=tok.eos_token_id, episode_tokens=budget,
                                max_turns=probe.config.max_turns)
    trainer = GRPOTrainer(model=path, reward_funcs=make_reward(on_reward, on_lengths, on_episodes), args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=ttok, environment_factory=factory)
    return trainer, val, record_scorer(cfg.data.reward_options()), tok


class VLLMEpisodeEngine:
    """TRL's colocated vLLM engine behind our blocking `generate` (engines/core.py Engine.generate), so that
    the held-out episodes are played by our episode player on the weights TRL trains."""

    def __init__(self, llm, tokenizer):
        self.llm, self.tokenizer = llm, tokenizer

    def generate(self, prompts: list[list[int]], params) -> list[list[Completion]]:
        from vllm import SamplingParams  # lazy: GPU hosts only

        eos = self.tokenizer.eos_token_id
        # each prompt its own seed, as our vLLM engine seeds them (one seed for all would correlate the draws)
        sps = [SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                              max_tokens=params.max_tokens,
                              seed=None if params.seed is None else params.seed + i * params.n,
                              logit_bias={eos: params.eos_logit_bias} if params.eos_logit_bias else None)
               for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return [[Completion(token_ids=np.asarray(c.token_ids, dtype=np.int32),
                            logprobs=np.zeros(len(c.token_ids), dtype=np.float32),   # unused by an evaluation
                            finish_reason="stop" if c.finish_reason == "stop" else "length")
                 for c in o.outputs] for o in outs]


def evaluate(trainer, val, score, tok, cfg) -> dict:
    """Accuracy and mean return of the current weights on the held-out prompts' episodes (TRL's vLLM engine,
    our episode player and evaluation: engines/evaluate.py)."""
    from engines.evaluate import evaluate_prompts  # lazy: imports torch

    gen = trainer.vllm_generation
    gen.sync_weights()  # the engine holds the weights of the last generation; evaluate the trained ones
    a = cfg.actors
    return evaluate_prompts(VLLMEpisodeEngine(gen.llm, tok), val, score, samples=cfg.trainer.val_samples,
                            temperature=a.temperature, max_tokens=a.max_tokens, seed=trl_vllm.VAL_SEED,
                            eos_logit_bias=a.eos_logit_bias,
                            episodes=EpisodePlayer(cfg.env, cfg.env.episode_tokens(cfg.buffer)))


class EpisodeTally:
    """Running sums of the episodes' counts for the run's summary line (a wall-clock run plays many)."""

    KEYS = ("return", "turns", "tool_calls", "observations", "env_s")

    def __init__(self):
        self.n = 0
        self.sums = dict.fromkeys(self.KEYS, 0.0)
        self.reasons: dict[str, int] = {}

    def add(self, eps: list[dict]) -> None:
        for e in eps:
            self.n += 1
            for k in self.KEYS:
                self.sums[k] += e[k] or 0
            self.reasons[e["reason"]] = self.reasons.get(e["reason"], 0) + 1

    def summary(self) -> dict:
        means = {k: round(v / self.n, 4) for k, v in self.sums.items()} if self.n else {}
        return {"episodes": {"n": self.n, "mean": means, "reasons": self.reasons,
                             "env_s_total": round(self.sums["env_s"], 3)}}


def main(argv=None) -> None:
    args = trl_vllm.arg_parser(__doc__).parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if not cfg.env.multi_turn:
        raise SystemExit(f"--config {args.config} sets no env.name: its TRL row is `python -m bench.trl_vllm`")
    tally = EpisodeTally()
    trl_vllm.run(cfg, args, functools.partial(build, on_episodes=tally.add), evaluate, tally.summary)


if __name__ == "__main__":
    main()
