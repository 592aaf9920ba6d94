"""`calculator_reverse`: a CPU toy where the model calls a tool, reads its result and answers.

A prompt asks for the sum of a few numbers or for a string reversed (the built-in reverse task's prompts,
`abcd>`, are reversals too). Each assistant turn ends with exactly
one action, the last thing in the turn (free text before it is allowed and ignored):

    <tool>calc: 12 + 7 + 30</tool>      integers, + - * / and parentheses (rewards.scorers.eval_arithmetic)
    <tool>reverse: hello</tool>         the argument reversed
    <answer>49</answer>                 the final answer; ends the episode

A tool's argument is one line without `<`. The environment answers a tool call with `<result>19</result>`
(`<result>error: ...</result>` for a failing call when `end_on_tool_error` is off). A turn with no action, two
actions, an unknown tool or a tag anywhere but at its end breaks the format: the episode ends (reason
`format_error`, reward 0). The answer is scored by the `calculator_reverse` reward function
(rewards/scorers.py `tagged_answer_score`); with `require_tool` an answer before any tool result scores 0.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

from envs.core import ANSWERED, FORMAT_ERROR, EnvConfig, StepResult, prompt_messages, with_instructions
from envs.tools import ERROR, ToolFailure, ToolRunner
from envs.toolenv import ToolEnvironment
from rewards.scorers import eval_arithmetic

DATA_SOURCE = "calculator_reverse"
# A tool argument longer than this is no toy question's operand; refusing it keeps a runaway turn cheap.
MAX_ARGUMENT_CHARS = 200

INSTRUCTIONS = (
    "You can use tools. To call one, end your message with <tool>NAME: ARGUMENT</tool>; the result comes back "
    "as <result>...</result>. Tools: calc (adds, subtracts, multiplies and divides integers, e.g. "
    "<tool>calc: 12 + 7</tool>) and reverse (reverses text, e.g. <tool>reverse: abc</tool>). Call one tool per "
    "message. When you know the answer, end your message with <answer>ANSWER</answer>.")

_ACTION = re.compile(r"(?s)(?P<before>.*?)(?:<tool>(?P<name>[a-z_]+):\s*(?P<arg>[^\n<]*)</tool>"
                     r"|<answer>(?P<answer>.*?)</answer>)\s*")
_TAG = re.compile(r"</?(?:tool|answer|result)>")


@dataclass(frozen=True)
class Action:
    """One parsed turn: a tool call (name, argument) or a final answer."""

    tool: str | None = None
    """The tool's name, for a tool call."""
    argument: str = ""
    """The tool's argument, stripped."""
    answer: str | None = None
    """The answer's text, for a final answer."""


def parse_action(text: str) -> Action | str:
    """The turn's action, or the reason it breaks the format (a str)."""
    m = _ACTION.fullmatch(text)
    if m is None:
        return "the turn does not end with one <tool>NAME: ARGUMENT</tool> or <answer>...</answer>"
    if _TAG.search(m["before"]):
        return "more than one action in the turn"
    if m["answer"] is not None:
        if _TAG.search(m["answer"]):
            return "a tag inside <answer>"
        return Action(answer=m["answer"].strip())
    arg = m["arg"].strip()
    if len(arg) > MAX_ARGUMENT_CHARS:
        return f"a tool argument of {len(arg)} characters (at most {MAX_ARGUMENT_CHARS})"
    return Action(tool=m["name"], argument=arg)


def calc(expr: str) -> str:
    """An arithmetic expression's exact value: '19', or '7/2' for a fraction."""
    value = eval_arithmetic(expr)
    if value is None:
        raise ToolFailure(ERROR, f"calc: not an expression of integers with + - * / ( ): {expr!r:.80}")
    return str(value)   # a Fraction prints as '19' or '7/2'


def reverse(text: str) -> str:
    return text[::-1]


TOOLS: dict[str, Callable[[str], str]] = {"calc": calc, "reverse": reverse}


@dataclass(kw_only=True)
class CalculatorConfig(EnvConfig):
    """The toy's settings on top of EnvConfig's."""

    require_tool: bool = True
    """An answer given before any tool call scores 0 (the task is to use the tool)."""
    instructions: bool = True
    """Start each episode with a system message that explains the tools; false for a model trained on the
    format already (the built-in tiny-tool model, whose 128 positions would not hold it)."""


class CalculatorReverseEnv(ToolEnvironment):
    """The toy environment; `tools` adds or replaces tools (name -> fn(argument) -> text)."""

    config_class = CalculatorConfig

    def __init__(self, config: CalculatorConfig | None = None, runner: ToolRunner | None = None,
                 tools: dict[str, Callable[[str], str]] | None = None):
        super().__init__(config or CalculatorConfig(), runner)
        self.tools = {**TOOLS, **(tools or {})}

    def _reset(self, record: dict):
        if record.get("data_source", "reverse") == "reverse":   # the built-in task's prompt ("abcd>"): answered
            self.record = {**record, "data_source": DATA_SOURCE, "extra_info": {"task": "reverse"}}   # in tags
        messages = prompt_messages(record)
        return with_instructions(messages, INSTRUCTIONS) if self.config.instructions else messages

    def _step(self, assistant_text: str) -> StepResult:
        action = parse_action(assistant_text)
        if isinstance(action, str):
            return StepResult(done=True, reason=FORMAT_ERROR, detail=action)
        if action.answer is not None:
            if self.config.require_tool and self.tool_calls == 0:
                return StepResult(done=True, reason=ANSWERED, detail="answered without calling a tool")
            return self.answer(assistant_text)
        fn = self.tools.get(action.tool)
        if fn is None:
            return StepResult(done=True, reason=FORMAT_ERROR,
                              detail=f"unknown tool {action.tool!r}; tools: {sorted(self.tools)}")
        return self.run_tool(fn, action.argument, wrap=lambda out: f"<result>{out}</result>")


def make_record(task: str, operand, prompt_id: str) -> dict:
    """A prompt record of the toy: task `sum` (operand: a list of integers) or `reverse` (a string)."""
    if task == "sum":
        nums = [int(n) for n in operand]
        text = f"What is the sum of {', '.join(map(str, nums[:-1]))} and {nums[-1]}?"
        answer = str(sum(nums))
    elif task == "reverse":
        text, answer = f"What is the string {operand} written backwards?", str(operand)[::-1]
    else:
        raise ValueError(f"unknown task {task!r}; the toy has tasks: sum, reverse")
    return {"prompt_id": prompt_id, "text": text, "answer": answer, "data_source": DATA_SOURCE,
            "extra_info": {"task": task}}


def make_records(n: int, seed: int = 0) -> list[dict]:
    """n toy prompt records, sums and reversals alternating, drawn from `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(make_record("sum", [rng.randint(10, 999) for _ in range(rng.randint(2, 4))], f"calc:{i}"))
        else:
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(5, 12)))
            out.append(make_record("reverse", word, f"calc:{i}"))
    return out
