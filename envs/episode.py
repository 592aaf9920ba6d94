"""Episodes in tokens: the exact sequence an engine saw, the model's tokens told apart from the environment's.

An episode's sample is its prompt's tokens, then each assistant turn as the engine sampled it (loss mask 1,
its behavior logprobs, the weight versions that sampled it), each followed by the environment's answer rendered
by the model's chat template (loss mask 0, logprob 0). Earlier turns are never re-tokenised: the next turn is
generated from exactly these tokens, and the learner trains on exactly them.

`ChatRenderer` turns messages into token ids with the tokenizer's chat template. The prompt is the template of
the first messages with the generation prompt. After an assistant turn, the tokens the environment adds are the
template's text between the end of that turn and the next generation prompt: the rest of the turn's closing
(`<|im_end|>` is the model's own stop token; the newline after it is not), the observation messages, and the
next assistant header; the text is found by rendering a stand-in conversation with and without them.

`EpisodeState` keeps one episode's tokens; `play_episodes` plays a batch of episodes on a blocking engine
(`generate`), as the held-out evaluation does. The rollout actor streams them (actors/episodes.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time

import numpy as np

from envs.core import Environment, Message
from envs.tools import ToolRunner

MAX_EPISODE_TOKENS = "max_episode_tokens"   # the reason an episode ends when its tokens reach the limit

# Stand-in messages for finding the template's text between two turns (any text the template does not alter).
_PROBE_USER, _PROBE_ASSISTANT = "u\u2063", "a\u2063"


class ChatRenderer:
    """Messages -> token ids with a tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"multi-turn episodes need a chat template; the model's tokenizer "
                             f"({type(tokenizer).__name__}) has none")
        self.tok = tokenizer
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        self._probe = probe
        self._probe_text = self._render(probe, generation_prompt=False)
        # the template's closing of an assistant turn: what follows the turn's text
        self.closing = self._probe_text[self._probe_text.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT):]

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The first messages, rendered with the generation prompt."""
        return self._ids(self._render(messages, generation_prompt=True))

    def observation_ids(self, observations: list[Message], *, turn_ended: bool) -> list[int]:
        """The tokens after an assistant turn: the rest of its closing (all of it when the model did not end the
        turn itself, `turn_ended` False), the observations, and the next generation prompt."""
        after = self._render(self._probe + list(observations), generation_prompt=True)
        if not after.startswith(self._probe_text):
            raise ValueError("the chat template renders earlier turns differently once observations follow; "
                             "multi-turn episodes need a template that only appends")
        closing = self.closing
        if turn_ended and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return self._ids(closing + after[len(self._probe_text):])


@dataclasses.dataclass
class EpisodeState:
    """One episode in flight: its environment, its tokens so far and what it earned."""

    env: Environment
    prompt_ids: list[int]
    max_tokens: int
    """Response tokens the episode may hold (env.max_episode_tokens)."""
    messages: list[Message] = dataclasses.field(default_factory=list)
    response_ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    """(offset in the response, version_start, version_end) of each assistant turn."""
    rewards: list[float] = dataclasses.field(default_factory=list)
    reason: str | None = None
    detail: str = ""
    env_s: float = 0.0
    """Seconds spent in the environment's steps (tool calls)."""

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def room(self) -> int:
        """Tokens the next turn may generate."""
        return self.max_tokens - len(self.response_ids)

    def next_ids(self) -> list[int]:
        """What the engine generates the next turn from."""
        return self.prompt_ids + self.response_ids

    def add_turn(self, completion, text: str) -> None:
        """An assistant turn as the engine sampled it (`text`: it decoded, for the messages)."""
        self.turns.append((len(self.response_ids), completion.version_start, completion.version_end))
        ids = np.asarray(completion.token_ids).tolist()
        self.response_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += np.asarray(completion.logprobs, dtype=np.float32).tolist()
        self.messages.append({"role": "assistant", "content": text})

    def add_observations(self, ids: list[int], observations: list[Message]) -> bool:
        """The environment's tokens; False (and the episode ended) when they would leave no room for a turn."""
        if len(self.response_ids) + len(ids) >= self.max_tokens:
            self.end(MAX_EPISODE_TOKENS, f"{len(self.response_ids)} + {len(ids)} observation tokens leave no room "
                                         f"for a turn within {self.max_tokens}")
            return False
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.messages += observations
        return True

    def end(self, reason: str, detail: str = "") -> None:
        self.reason, self.detail = reason, detail

    def step_env(self, text: str):
        """The environment's answer to the last turn (timed); the caller adds its observations."""
        t = time.monotonic()
        try:
            return self.env.step(text)
        finally:
            self.env_s += time.monotonic() - t

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))


def start_episode(env: Environment, record: dict, renderer: ChatRenderer, max_tokens: int) -> EpisodeState:
    """Reset `env` for `record`: the episode's first messages, rendered to its prompt."""
    messages = env.reset(record)
    return EpisodeState(env=env, prompt_ids=renderer.prompt_ids(messages), max_tokens=max_tokens,
                        messages=list(messages))


def after_turn(ep: EpisodeState, completion, renderer: ChatRenderer, eos_id: int | None) -> None:
    """Take one finished turn: record it, step the environment, add its observations or end the episode.
    Runs the environment's step on the calling thread (the streaming actor calls it off its engine loop)."""
    text = renderer.tok.decode(completion.token_ids, skip_special_tokens=True)
    ep.add_turn(completion, text)
    result = ep.step_env(text)
    ep.rewards.append(result.reward)
    if result.done:
        ep.end(result.reason, result.detail)
        return
    ended = len(completion.token_ids) > 0 and eos_id is not None and int(completion.token_ids[-1]) == eos_id
    if not ended and ep.room <= 0:
        ep.end(MAX_EPISODE_TOKENS, f"the turn reached the episode's {ep.max_tokens} tokens")
        return
    ep.add_observations(renderer.observation_ids(result.observations, turn_ended=ended), result.observations)


def play_episodes(engine, envs: list[Environment], records: list[dict], params, *, max_tokens: int,
                  renderer: ChatRenderer | None = None, workers: int = 1) -> list[EpisodeState]:
    """Play one episode per (env, record) on a blocking engine: every live episode's next turn in one
    `generate` call per turn (n=1 each, at most the episode's room), then the environments' answers on
    `workers` threads (tool calls of different episodes overlap). `params`: the sampling parameters."""
    renderer = renderer or ChatRenderer(engine.tokenizer)
    eos = engine.tokenizer.eos_token_id
    eps = [start_episode(env, rec, renderer, max_tokens) for env, rec in zip(envs, records)]
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env-step") as pool:
        while live := [e for e in eps if not e.done]:
            by_room: dict[int, list[EpisodeState]] = {}   # one call per turn length cap (an episode's room left)
            for e in live:
                by_room.setdefault(min(params.max_tokens, e.room), []).append(e)
            turns = []
            for room, group in by_room.items():
                outs = engine.generate([e.next_ids() for e in group], dataclasses.replace(params, n=1, max_tokens=room))
                turns += [(ep, comp) for ep, (comp,) in zip(group, outs)]
            for f in [pool.submit(after_turn, ep, comp, renderer, eos) for ep, comp in turns]:
                f.result()   # an environment that raises stops the evaluation, naming itself
    return eps


class EpisodePlayer:
    """Held-out episodes on a blocking engine: `play(engine, records, params)` -> per record, its params.n
    ended episodes (the evaluations pass it to engines/evaluate.py's evaluate_prompts)."""

    def __init__(self, episodes_cfg, max_tokens: int):
        self.cfg, self.max_tokens = episodes_cfg, max_tokens
        self._renderer: ChatRenderer | None = None

    def play(self, engine, records: list[dict], params) -> list[list[EpisodeState]]:
        if self._renderer is None:
            self._renderer = ChatRenderer(engine.tokenizer)
        runner = ToolRunner(threads=self.cfg.workers)
        envs = [self.cfg.make(runner) for _ in records for _ in range(params.n)]
        try:
            eps = play_episodes(engine, envs, [r for r in records for _ in range(params.n)], params,
                                max_tokens=self.max_tokens, renderer=self._renderer, workers=self.cfg.workers)
        finally:
            for env in envs:
                env.close()
            runner.close()
        return [eps[i * params.n:(i + 1) * params.n] for i in range(len(records))]
