"""`python_tool`: the model may run Python in a sandbox before it answers (math, code reasoning).

An assistant turn that ends with one block

    <python>
    print(sum(range(10)))
    </python>

runs the block in `tools.PythonSandbox` (CPU, memory, file-size and wall limits) and gets back what it printed
as `<output>\n45\n</output>` in a message of `EnvConfig.observation_role` (plain text: SmolLM2's ChatML carries
it as any user message). A turn without a block is the final answer, scored by the record's reward function
(its data_source's: `\\boxed{}` for math, `#### N` for GSM8K). A block anywhere but at the end of the turn, or
two blocks, breaks the format (reason `format_error`, reward 0). A run that times out, exits non-zero (an
uncaught exception included) or hits a limit ends the episode with `tool_timeout` / `tool_error`, or with
`end_on_tool_error` off comes back as `<output>\nerror: exit code 1\n<traceback>\n</output>`.
"""
from __future__ import annotations

import re

from envs.core import FORMAT_ERROR, EnvConfig, StepResult, prompt_messages, with_instructions
from envs.tools import KILL_WAIT_S, PythonSandbox, SandboxConfig, ToolRunner
from envs.toolenv import ToolEnvironment

# Code longer than this is not a tool call but a runaway generation; it is refused unrun.
MAX_CODE_CHARS = 8000
# Seconds the runner waits beyond the sandbox's own wall limit and its kill, so that the sandbox reports the
# precise reason and the runner's timeout stays the backstop.
RUNNER_SLACK_S = 2.0

INSTRUCTIONS = (
    "You can run Python code. To run some, end your message with a block\n<python>\nCODE\n</python>\n"
    "and what it prints comes back as <output>...</output>. Use print() to see values. Run one block per "
    "message. When you know the answer, reply without a block and give the answer as the question asks.")

_BLOCK = re.compile(r"(?s)(?P<before>.*?)<python>\n?(?P<code>.*?)</python>\s*")


class PythonToolEnv(ToolEnvironment):
    """Python blocks run in a sandbox; the first turn without one is the answer."""

    def __init__(self, config: EnvConfig | None = None, runner: ToolRunner | None = None,
                 sandbox: SandboxConfig | None = None):
        super().__init__(config, runner)
        self.sandbox = PythonSandbox(sandbox)

    def _reset(self, record: dict):
        return with_instructions(prompt_messages(record), INSTRUCTIONS)

    def _step(self, assistant_text: str) -> StepResult:
        if "<python>" not in assistant_text and "</python>" not in assistant_text:
            return self.answer(assistant_text)
        m = _BLOCK.fullmatch(assistant_text)
        if m is None or "<python>" in m["before"] or "python>" in m["code"]:
            return StepResult(done=True, reason=FORMAT_ERROR,
                              detail="a turn runs code with exactly one <python>...</python> block at its end")
        if len(m["code"]) > MAX_CODE_CHARS:
            return StepResult(done=True, reason=FORMAT_ERROR,
                              detail=f"a block of {len(m['code'])} characters (at most {MAX_CODE_CHARS})")
        timeout = max(self.config.tool_timeout_s, self.sandbox.config.wall_s + KILL_WAIT_S + RUNNER_SLACK_S)
        return self.run_tool(self.sandbox.run, m["code"], timeout_s=timeout,
                             wrap=lambda out: f"<output>\n{out.rstrip()}\n</output>")
