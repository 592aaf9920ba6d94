"""The episode contract: an environment is reset from a prompt record to its first chat messages, then
takes one assistant turn at a time and answers with a `StepResult`.

Text in, messages out: an environment never sees token ids (turning messages into tokens, and keeping the
assistant's tokens apart from the observations', is the caller's job). An episode's return is the sum of its
steps' rewards: outcome-rewarded environments pay everything on the last step, others may pay along the way.

    env.reset(record)                 -> the first messages (system instructions, the user's question)
    env.step(assistant_text)          -> StepResult(observations, reward, done, reason, detail)

`Environment.step` counts turns: the turn that reaches `EnvConfig.max_turns` without ending the episode ends
it with reason `max_turns` (its observations are dropped: no assistant turn would read them).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from runbase.configload import ConfigError

Message = dict[str, str]   # {"role": ..., "content": ...}, as chat templates take them

# Why an episode ended (StepResult.reason). Environments of one's own may add reasons of their own.
ANSWERED = "answered"          # the assistant gave its final answer (which the reward judged)
MAX_TURNS = "max_turns"        # EnvConfig.max_turns assistant turns without a final answer
TOOL_TIMEOUT = "tool_timeout"  # a tool ran past its time limit (StepResult.detail says which)
TOOL_ERROR = "tool_error"      # a tool failed: raised, exited non-zero, hit a resource limit
FORMAT_ERROR = "format_error"  # the turn broke the environment's documented format

ROLES = ("system", "user", "assistant", "tool")

# A tool's output is cut to this many characters before it becomes a message: a runaway print would
# otherwise fill the context (and the wire) with one observation.
DEFAULT_MAX_OBSERVATION_CHARS = 2000
# A turn-count beyond this is a configuration mistake, not an episode (each turn is a generation).
MAX_TURNS_LIMIT = 64


@dataclass(kw_only=True)
class EnvConfig:
    """What every environment shares; an environment's own settings sit in its own config."""

    max_turns: int = 4
    """Assistant turns per episode; the turn that reaches it without a final answer ends the episode
    (reason `max_turns`, reward 0 unless the environment paid partial rewards before)."""
    tool_timeout_s: float = 10.0
    """Wall-clock seconds one tool call may take before its caller gets a timeout result; the call's
    thread is abandoned, never waited for (tools.ToolRunner)."""
    end_on_tool_error: bool = True
    """A failing tool (timeout, crash, resource limit) ends the episode with reason `tool_timeout` or
    `tool_error`; false: the error goes back to the model as an observation and the episode goes on."""
    observation_role: str = "user"
    """The chat role observations (tool results) are sent in. `user` fits every chat template (SmolLM2's
    ChatML was never trained on a `tool` role); `tool` for templates that have one (Qwen2.5)."""
    max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS
    """A tool's output longer than this is cut (keeping its start, marked as cut) before it is sent."""

    def __post_init__(self):
        if not 1 <= self.max_turns <= MAX_TURNS_LIMIT:
            raise ConfigError("max_turns", f"must be in 1..{MAX_TURNS_LIMIT}, got {self.max_turns}")
        if not (math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0):
            raise ConfigError("tool_timeout_s", f"must be a positive number of seconds, got {self.tool_timeout_s}")
        if self.observation_role not in ("user", "tool"):
            raise ConfigError("observation_role", f"must be 'user' or 'tool', got {self.observation_role!r}")
        if self.max_observation_chars < 16:
            raise ConfigError("max_observation_chars", f"must be at least 16, got {self.max_observation_chars}")


@dataclass(frozen=True)
class StepResult:
    """What one assistant turn brought about."""

    observations: list[Message] = field(default_factory=list)
    """Messages to append after the assistant's turn (tool results); empty when the episode is done."""
    reward: float = 0.0
    """This step's reward (finite); the episode's return is the sum over its steps."""
    done: bool = False
    """The episode is over: no further `step` is allowed."""
    reason: str | None = None
    """Why it ended (ANSWERED, MAX_TURNS, TOOL_TIMEOUT, TOOL_ERROR, FORMAT_ERROR, ...); None while it goes on."""
    detail: str = ""
    """The particulars for logs and metrics: "timeout after 2 s", "exit code 3", the bad tool name."""

    def __post_init__(self):
        if not math.isfinite(self.reward):
            raise ValueError(f"a step's reward must be finite, got {self.reward}")
        if self.done != (self.reason is not None):
            raise ValueError(f"a reason is given exactly when the episode is done (done={self.done}, "
                             f"reason={self.reason!r})")
        if self.done and self.observations:
            raise ValueError("a finished episode appends no observations")
        for m in self.observations:
            check_message(m)


def check_message(m: Any) -> None:
    """Raise ValueError unless `m` is a chat message {role, content} with a known role."""
    if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
        raise ValueError(f"not a chat message {{role in {ROLES}, content: str}}: {m!r:.200}")


def prompt_messages(record: dict) -> list[Message]:
    """The chat messages a prompt record starts from: its `messages` when it carries them, else its
    `text` as the user's one message."""
    msgs = record.get("messages")
    if msgs is None:
        if not isinstance(record.get("text"), str):
            raise ValueError(f"prompt record {record.get('prompt_id')!r} has neither messages nor text")
        return [{"role": "user", "content": record["text"]}]
    for m in msgs:
        check_message(m)
    return [dict(m) for m in msgs]


def with_instructions(messages: list[Message], instructions: str) -> list[Message]:
    """An environment's instructions as the system message, before a system message the prompt brings (one
    system message: chat templates expect at most one, first)."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{instructions}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def cut(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, the cut said at its end."""
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit} more characters cut]"
    return text[:max(0, limit - len(note))] + note


class Environment(abc.ABC):
    """One episode at a time: `reset`, then `step` until a result is done. Subclasses write `_reset` and
    `_step`; this class counts turns, ends the episode at `max_turns` and refuses steps after the end. An
    instance plays one episode at a time, from one thread; concurrent episodes take one instance each."""

    config_class: type[EnvConfig] = EnvConfig
    """The class of its settings (the job's `env.options` build one)."""

    def __init__(self, config: EnvConfig | None = None):
        self.config = config or self.config_class()
        self.record: dict | None = None
        self.turns = 0
        self.done = False

    def reset(self, record: dict) -> list[Message]:
        """Start an episode for one prompt record (the dict the prompt queue carries); its first messages."""
        self.record, self.turns, self.done = record, 0, False
        messages = self._reset(record)
        if not messages:
            raise ValueError(f"{type(self).__name__} started an episode with no messages")
        for m in messages:
            check_message(m)
        return messages

    def step(self, assistant_text: str) -> StepResult:
        """Take one assistant turn (its text, the chat template's end-of-turn excluded)."""
        if self.record is None:
            raise RuntimeError(f"{type(self).__name__}.step before reset")
        if self.done:
            raise RuntimeError(f"{type(self).__name__}.step after the episode ended")
        self.turns += 1
        result = self._step(assistant_text)
        if not result.done and self.turns >= self.config.max_turns:
            result = StepResult(reward=result.reward, done=True, reason=MAX_TURNS,
                                detail=f"{self.turns} turns without a final answer")
        self.done = result.done
        return result

    def observe(self, text: str) -> Message:
        """A tool's output as the message the model reads (the configured role, cut to size)."""
        return {"role": self.config.observation_role, "content": cut(text, self.config.max_observation_chars)}

    def state(self) -> dict:
        """What `restore` needs to continue this episode in a new instance reset for the same record (an actor
        resuming it after another died, actors/journal.py): plain msgpack-able values. Subclasses that keep
        more between turns add theirs."""
        return {"turns": self.turns}

    def restore(self, state: dict) -> None:
        """Continue from `state` (`state()` of an instance reset for the same record, after a finished turn)."""
        self.turns = int(state["turns"])

    def close(self) -> None:
        """Release what the environment holds (it holds nothing unless a subclass says otherwise)."""

    @abc.abstractmethod
    def _reset(self, record: dict) -> list[Message]:
        """The first messages of an episode for `record`."""

    @abc.abstractmethod
    def _step(self, assistant_text: str) -> StepResult:
        """The result of one assistant turn; `Environment.step` handles max_turns."""


@dataclass
class Episode:
    """A whole episode as text: what `run_episode` returns."""

    messages: list[Message]
    """Every message: the first ones, then each assistant turn followed by its observations."""
    rewards: list[float]
    """Each step's reward, in order."""
    reason: str
    """Why it ended (StepResult.reason of the last step)."""
    detail: str = ""
    """The last step's detail."""

    @property
    def total_reward(self) -> float:
        return sum(self.rewards)

    @property
    def turns(self) -> int:
        return len(self.rewards)


def run_episode(env: Environment, record: dict, policy: Callable[[list[Message]], str]) -> Episode:
    """Play one episode: `policy(messages so far)` writes each assistant turn."""
    messages = env.reset(record)
    rewards: list[float] = []
    while True:
        text = policy(list(messages))
        messages.append({"role": "assistant", "content": text})
        result = env.step(text)
        rewards.append(result.reward)
        messages += result.observations
        if result.done:
            return Episode(messages=messages, rewards=rewards, reason=result.reason, detail=result.detail)
