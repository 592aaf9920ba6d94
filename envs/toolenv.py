"""What tool-using environments share: a tool runner, tool results turned into observations or into the end
of the episode, and the final answer scored by the record's reward function (rewards/scorers.py)."""
from __future__ import annotations

from typing import Callable

from envs.core import ANSWERED, TOOL_ERROR, TOOL_TIMEOUT, EnvConfig, Environment, StepResult
from envs.tools import TIMEOUT, ToolRunner
from rewards.scorers import compute_score, get_scorer


class ToolEnvironment(Environment):
    """An environment whose turns may call tools. Pass a shared `runner` (one per process); without one the
    environment makes its own and stops it on `close`."""

    def __init__(self, config: EnvConfig | None = None, runner: ToolRunner | None = None):
        super().__init__(config)
        self._own_runner = runner is None
        self.runner = runner or ToolRunner()
        self.tool_calls = 0

    def reset(self, record: dict):
        get_scorer(record.get("data_source", "reverse"))   # a record no reward function scores fails now (KeyError)
        self.tool_calls = 0
        return super().reset(record)

    def state(self) -> dict:
        return {**super().state(), "tool_calls": self.tool_calls}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.tool_calls = int(state.get("tool_calls", 0))

    def run_tool(self, fn: Callable[[str], str], argument: str, *, wrap: Callable[[str], str],
                 timeout_s: float | None = None) -> StepResult:
        """Call a tool: its output as an observation (`wrap` formats it), or, when it fails and
        `end_on_tool_error` is set, the end of the episode with the failure as its detail."""
        self.tool_calls += 1
        res = self.runner.call(fn, argument, timeout_s or self.config.tool_timeout_s)
        if res.ok:
            return StepResult(observations=[self.observe(wrap(res.output))])
        if self.config.end_on_tool_error:
            return StepResult(done=True, reason=TOOL_TIMEOUT if res.status == TIMEOUT else TOOL_ERROR,
                              detail=res.error)
        shown = f"error: {res.error}" + (f"\n{res.output}" if res.output else "")
        return StepResult(observations=[self.observe(wrap(shown))])

    def answer(self, assistant_text: str, *, detail: str = "") -> StepResult:
        """End the episode on this turn, scored by the record's reward function (its data_source's)."""
        rec = self.record
        reward = compute_score(rec.get("data_source", "reverse"), assistant_text, rec["answer"],
                               rec.get("extra_info"))
        return StepResult(reward=reward, done=True, reason=ANSWERED, detail=detail)

    def close(self) -> None:
        if self._own_runner:
            self.runner.close()
