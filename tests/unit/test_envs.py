"""envs/: the episode contract, the registry, tools off the caller's thread and the subprocess sandbox (real
processes), the calculator_reverse toy through whole scripted episodes, and python_tool."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from envs.calculator import (CalculatorConfig, CalculatorReverseEnv, calc, make_record, make_records,
                             parse_action)
from envs.core import (ANSWERED, FORMAT_ERROR, MAX_TURNS, TOOL_ERROR, TOOL_TIMEOUT, EnvConfig, Environment,
                       StepResult, cut, prompt_messages, run_episode)
from envs.python_tool import PythonToolEnv
from envs.registry import ENVIRONMENTS, get_env_class, load_env_class, make_env, register_env
from envs.tools import ERROR, OK, TIMEOUT, PythonSandbox, SandboxConfig, ToolFailure, ToolRunner
from rewards.scorers import tagged_answer_score
from runbase.configload import ConfigError

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# Seconds a failing tool may take beyond its limit before the caller has its result: process start and kill
# on a loaded 2-core machine. The tests assert the reason; this bound only proves nothing waited forever.
SLACK_S = 10.0
# Fast sandbox limits for the tests (the defaults are several seconds). 128 MiB of address space: a loop that grows
# its memory reaches it after ~100 MB of zero-filled pages; at the default 512 MiB, filling ~450 MB of pages took more
# than the one CPU second on a loaded 2-core machine (the kernel's page faults count too), reported as "cpu limit".
FAST = SandboxConfig(cpu_s=1, wall_s=2.0, memory_mb=128)


@pytest.fixture
def runner():
    r = ToolRunner(threads=2)
    yield r
    r.close()


def hang_forever(_: str) -> str:
    threading.Event().wait()   # never set: the tool never returns
    return "unreachable"


def scripted(turns: list[str]):
    """A policy that writes the given turns in order, whatever it is shown."""
    it = iter(turns)
    return lambda messages: next(it)


# --------------------------------------------------------------------------- the contract

def test_step_result_invariants():
    assert StepResult(observations=[{"role": "user", "content": "x"}]).done is False
    with pytest.raises(ValueError, match="exactly when"):
        StepResult(done=True)
    with pytest.raises(ValueError, match="exactly when"):
        StepResult(reason=ANSWERED)
    with pytest.raises(ValueError, match="finite"):
        StepResult(reward=float("nan"), done=True, reason=ANSWERED)
    with pytest.raises(ValueError, match="no observations"):
        StepResult(observations=[{"role": "user", "content": "x"}], done=True, reason=ANSWERED)
    with pytest.raises(ValueError, match="chat message"):
        StepResult(observations=[{"role": "robot", "content": "x"}])


def test_config_invariants_name_the_key():
    for kwargs, key in (({"max_turns": 0}, "max_turns"), ({"tool_timeout_s": 0}, "tool_timeout_s"),
                        ({"observation_role": "system"}, "observation_role"), ({"max_observation_chars": 3},
                                                                               "max_observation_chars")):
        with pytest.raises(ConfigError, match=key):
            EnvConfig(**kwargs)
    with pytest.raises(ConfigError, match="memory_mb"):
        SandboxConfig(memory_mb=8)
    with pytest.raises(ConfigError, match="wall_s"):
        SandboxConfig(wall_s=float("inf"))


def test_prompt_messages_from_text_or_messages():
    assert prompt_messages({"prompt_id": "a", "text": "hi"}) == [{"role": "user", "content": "hi"}]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert prompt_messages({"prompt_id": "b", "text": "ignored", "messages": msgs}) == msgs
    with pytest.raises(ValueError, match="neither messages nor text"):
        prompt_messages({"prompt_id": "c"})
    with pytest.raises(ValueError, match="chat message"):
        prompt_messages({"prompt_id": "d", "messages": [{"role": "user"}]})


def test_cut_keeps_the_start_and_says_so():
    assert cut("short", 100) == "short"
    out = cut("x" * 5000, 200)
    assert len(out) <= 200 and out.startswith("xxx") and "4" in out and "cut" in out


def test_a_record_no_reward_function_scores_is_refused_at_reset(runner):
    with pytest.raises(KeyError, match="no reward function for data_source 'nope'"):
        CalculatorReverseEnv(runner=runner).reset({"prompt_id": "n", "text": "q", "answer": "1", "data_source": "nope"})


def test_step_before_reset_and_after_the_end_is_refused(runner):
    env = CalculatorReverseEnv(runner=runner)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("<answer>1</answer>")
    env.reset(make_record("sum", [1, 2], "p"))
    assert env.step("<answer>3</answer>").done
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("<answer>3</answer>")


# --------------------------------------------------------------------------- the toy, scripted

def test_a_sum_episode_calls_the_tool_and_is_paid_for_the_right_answer(runner):
    env = CalculatorReverseEnv(runner=runner)
    rec = make_record("sum", [12, 7, 30], "s:1")
    first = env.reset(rec)
    assert first[0]["role"] == "system" and "<tool>" in first[0]["content"]
    assert first[1] == {"role": "user", "content": "What is the sum of 12, 7 and 30?"}
    r1 = env.step("I will add them.\n<tool>calc: 12 + 7 + 30</tool>")
    assert (r1.done, r1.reward, r1.observations) == (False, 0.0, [{"role": "user", "content": "<result>49</result>"}])
    r2 = env.step("The tool says 49.\n<answer>49</answer>\n")
    assert (r2.done, r2.reason, r2.reward, r2.observations) == (True, ANSWERED, 1.0, [])


def test_a_reverse_episode_through_run_episode_with_partial_credit(runner):
    env = CalculatorReverseEnv(runner=runner)
    rec = make_record("reverse", "planet", "r:1")
    ep = run_episode(env, rec, scripted(["<tool>reverse: planet</tool>", "<answer>tenalp</answer>"]))
    assert (ep.reason, ep.total_reward, ep.turns) == (ANSWERED, 1.0, 2)
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert ep.messages[3]["content"] == "<result>tenalp</result>"
    wrong = run_episode(env, rec, scripted(["<tool>reverse: planet</tool>", "<answer>tenalx</answer>"]))
    assert wrong.reason == ANSWERED and wrong.total_reward == pytest.approx(5 / 6)


def test_an_answer_without_a_tool_call_scores_nothing_when_a_tool_is_required(runner):
    rec = make_record("sum", [1, 2], "s:2")
    ep = run_episode(CalculatorReverseEnv(runner=runner), rec, scripted(["<answer>3</answer>"]))
    assert (ep.reason, ep.total_reward) == (ANSWERED, 0.0) and "without calling a tool" in ep.detail
    free = CalculatorReverseEnv(CalculatorConfig(require_tool=False), runner=runner)
    assert run_episode(free, rec, scripted(["<answer>3</answer>"])).total_reward == 1.0


@pytest.mark.parametrize("turn,why", [
    ("I think it is 49.", "does not end with"),
    ("<tool>calc: 1+2</tool> and then some words", "does not end with"),
    ("<tool>calc: 1+2</tool><tool>calc: 3+4</tool>", "more than one action"),
    ("<answer>3</answer><answer>4</answer>", "tag inside"),
    ("<tool>calc: 1+\n2</tool>", "does not end with"),
    ("<tool>CALC: 1+2</tool>", "does not end with"),
    ("<tool>search: cats</tool>", "unknown tool 'search'"),
    ("<tool>calc: " + "1+" * 150 + "1</tool>", "tool argument of"),
])
def test_format_breaks_end_the_episode_with_nothing(runner, turn, why):
    env = CalculatorReverseEnv(runner=runner)
    env.reset(make_record("sum", [1, 2], "s:3"))
    r = env.step(turn)
    assert (r.done, r.reason, r.reward) == (True, FORMAT_ERROR, 0.0)
    assert why in r.detail


def test_parse_action_and_the_calc_tool():
    assert parse_action("think <tool>calc:3*(2+1)</tool>  \n").argument == "3*(2+1)"
    assert parse_action("<answer> dcba </answer>").answer == "dcba"
    assert calc("7 / 2") == "7/2" and calc("10 - 12") == "-2"
    with pytest.raises(ToolFailure, match="not an expression"):
        calc("__import__('os')")


def test_max_turns_ends_the_episode_with_its_reason(runner):
    env = CalculatorReverseEnv(CalculatorConfig(max_turns=3), runner=runner)
    ep = run_episode(env, make_record("sum", [1, 2], "s:4"), lambda messages: "<tool>calc: 1+2</tool>")
    assert (ep.reason, ep.turns, ep.total_reward) == (MAX_TURNS, 3, 0.0)
    assert ep.messages[-1]["role"] == "assistant"   # the last turn's tool result is not appended
    assert env.done and env.turns == 3


def test_the_toy_records_and_their_scorer():
    recs = make_records(6, seed=3)
    assert [r["extra_info"]["task"] for r in recs] == ["sum", "reverse"] * 3 and recs == make_records(6, seed=3)
    assert len({r["prompt_id"] for r in recs}) == 6
    assert tagged_answer_score("<answer>1,750</answer>", "1750", {"task": "sum"}) == 1.0
    assert tagged_answer_score("<answer>1751</answer>", "1750", {"task": "sum"}) == 0.0
    assert tagged_answer_score("1750", "1750", {"task": "sum"}) == 0.0
    assert tagged_answer_score("<answer>dcbx</answer>", "dcba", {"task": "reverse"}) == 0.75


# --------------------------------------------------------------------------- tools that fail

def test_a_hanging_tool_ends_the_episode_and_the_caller_returns(runner):
    env = CalculatorReverseEnv(CalculatorConfig(tool_timeout_s=0.5), runner=runner, tools={"calc": hang_forever})
    env.reset(make_record("sum", [1, 2], "h:1"))
    t0 = time.monotonic()
    r = env.step("<tool>calc: 1+2</tool>")
    assert time.monotonic() - t0 < 0.5 + SLACK_S
    assert (r.done, r.reason, r.detail) == (True, TOOL_TIMEOUT, "timeout after 0.5 s")
    # the runner still serves: the hung thread is abandoned, another takes the next call
    ok = run_episode(CalculatorReverseEnv(runner=runner), make_record("sum", [1, 2], "h:2"),
                     scripted(["<tool>calc: 1+2</tool>", "<answer>3</answer>"]))
    assert (ok.reason, ok.total_reward) == (ANSWERED, 1.0)


def test_hung_calls_do_not_starve_a_one_thread_runner():
    r = ToolRunner(threads=1)
    try:
        for _ in range(3):
            assert r.call(hang_forever, "", 0.2).status == TIMEOUT
        res = r.call(str.upper, "abc", 5.0)
        assert (res.status, res.output) == (OK, "ABC") and r.abandoned == 3
    finally:
        r.close()


def test_a_raising_tool_or_one_returning_no_text_is_an_error_result(runner):
    assert runner.call(lambda a: 1 / 0, "", 5.0).error == "ZeroDivisionError: division by zero"
    assert "not text" in runner.call(lambda a: 42, "", 5.0).error
    env = CalculatorReverseEnv(runner=runner)
    env.reset(make_record("sum", [1, 2], "e:1"))
    r = env.step("<tool>calc: 1/0</tool>")
    assert (r.done, r.reason) == (True, TOOL_ERROR) and "not an expression" in r.detail


def test_with_end_on_tool_error_off_the_model_reads_the_error_and_goes_on(runner):
    env = CalculatorReverseEnv(CalculatorConfig(end_on_tool_error=False, tool_timeout_s=0.3), runner=runner,
                               tools={"slow": hang_forever})
    ep = run_episode(env, make_record("sum", [1, 2], "e:2"),
                     scripted(["<tool>slow: x</tool>", "<tool>calc: 1+2</tool>", "<answer>3</answer>"]))
    assert (ep.reason, ep.total_reward) == (ANSWERED, 1.0)
    assert ep.messages[3]["content"] == "<result>error: timeout after 0.3 s</result>"


# --------------------------------------------------------------------------- the sandbox, real processes

@pytest.mark.parametrize("code,status,why", [
    ("import os\nos.abort()", ERROR, "killed by SIGABRT"),
    ("raise SystemExit(3)", ERROR, "exit code 3"),
    ("x = bytearray(2 ** 34)", ERROR, "memory limit"),
    ("x = []\nwhile True:\n    x.append(bytearray(10 ** 7))", ERROR, "memory limit"),
    ("while True:\n    pass", ERROR, "cpu limit"),
    ("import time\ntime.sleep(10 ** 6)", TIMEOUT, "timeout after 2 s"),
    ("while True:\n    print('x' * 10000)", ERROR, "output limit"),
])
def test_the_sandbox_reports_why_a_run_failed(code, status, why):
    t0 = time.monotonic()
    with pytest.raises(ToolFailure) as e:
        PythonSandbox(FAST).run(code)
    assert time.monotonic() - t0 < FAST.wall_s + SLACK_S
    assert e.value.status == status and why in e.value.error


def test_the_sandbox_runs_isolated_in_an_empty_directory():
    out = PythonSandbox(FAST).run(textwrap.dedent("""
        import os, sys
        print(sys.flags.isolated, sorted(f for f in os.listdir('.') if f != '.output'), 'PYTHONPATH' in os.environ,
              os.environ['OMP_NUM_THREADS'])
    """))
    assert out == "1 ['main.py'] False 1\n"


def test_a_timed_out_run_takes_what_it_started_down_with_it():
    code = textwrap.dedent("""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'])
        print(p.pid, flush=True)
        time.sleep(1000)
    """)
    with pytest.raises(ToolFailure) as e:
        PythonSandbox(FAST).run(code)
    assert e.value.status == TIMEOUT
    pid = int(e.value.output.split()[0])
    deadline = time.monotonic() + SLACK_S
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), f"the run's child {pid} outlived the kill"


def _alive(pid: int) -> bool:
    """Running or asleep (a zombie waiting for its reaper is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


# --------------------------------------------------------------------------- python_tool

def test_a_python_tool_episode_runs_code_then_is_scored_by_the_records_reward_function(runner):
    env = PythonToolEnv(runner=runner, sandbox=FAST)
    rec = {"prompt_id": "g:1", "text": "What is 17 * 23 + 4?", "answer": "395", "data_source": "openai/gsm8k"}
    ep = run_episode(env, rec, scripted([
        "Let me compute it.\n<python>\nprint(17 * 23 + 4)\n</python>",
        "The code printed 395.\n#### 395"]))
    assert (ep.reason, ep.total_reward, ep.turns) == (ANSWERED, 1.0, 2)
    assert ep.messages[3] == {"role": "user", "content": "<output>\n395\n</output>"}


@pytest.mark.parametrize("code,reason,why", [
    ("import os\nos.abort()", TOOL_ERROR, "killed by SIGABRT"),
    ("import sys\nsys.exit(3)", TOOL_ERROR, "exit code 3"),
    ("hog = ' ' * (2 ** 33)", TOOL_ERROR, "memory limit"),
    ("import time\ntime.sleep(10 ** 6)", TOOL_TIMEOUT, "timeout after 2 s"),
])
def test_a_crashing_or_hanging_python_block_ends_the_episode_with_its_reason(runner, code, reason, why):
    env = PythonToolEnv(runner=runner, sandbox=FAST)
    env.reset({"prompt_id": "c:1", "text": "q", "answer": "1", "data_source": "openai/gsm8k"})
    t0 = time.monotonic()
    r = env.step(f"<python>\n{code}\n</python>")
    assert time.monotonic() - t0 < FAST.wall_s + SLACK_S
    assert (r.done, r.reason, r.reward) == (True, reason, 0.0) and why in r.detail


def test_python_tool_errors_as_observations_and_format_breaks(runner):
    env = PythonToolEnv(EnvConfig(end_on_tool_error=False), runner=runner, sandbox=FAST)
    env.reset({"prompt_id": "c:2", "text": "q", "answer": "1", "data_source": "openai/gsm8k"})
    r = env.step("<python>\n1 / 0\n</python>")
    assert not r.done and r.observations[0]["content"].startswith("<output>\nerror: exit code 1")
    assert "ZeroDivisionError" in r.observations[0]["content"]
    for bad in ("<python>\nprint(1)\n</python> then more", "<python>print(1)</python><python>print(2)</python>",
                "<python>\nprint(1)\n"):
        env.reset({"prompt_id": "c:3", "text": "q", "answer": "1", "data_source": "openai/gsm8k"})
        assert env.step(bad).reason == FORMAT_ERROR


# --------------------------------------------------------------------------- the registry

class EchoEnv(Environment):
    """A one-turn environment of a user's own: pays 1 for repeating the prompt."""

    def _reset(self, record):
        return prompt_messages(record)

    def _step(self, text):
        return StepResult(reward=float(text == self.record["text"]), done=True, reason=ANSWERED)


def test_registry_by_name_and_register_env(runner):
    assert isinstance(make_env("calculator_reverse", runner=runner), CalculatorReverseEnv)
    assert get_env_class("python_tool") is PythonToolEnv
    register_env("test/echo", EchoEnv)
    try:
        ep = run_episode(make_env("test/echo"), {"prompt_id": "e", "text": "hello"}, scripted(["hello"]))
        assert (ep.reason, ep.total_reward) == (ANSWERED, 1.0)
    finally:
        ENVIRONMENTS.pop("test/echo")
    with pytest.raises(TypeError, match="subclass of envs.core.Environment"):
        register_env("bad", dict)
    with pytest.raises(ValueError, match="no ':'"):
        register_env("a:b", EchoEnv)


def test_registry_by_import_path_and_its_errors(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(textwrap.dedent("""
        from envs.core import ANSWERED, Environment, StepResult, prompt_messages

        class Shout(Environment):
            def _reset(self, record):
                return prompt_messages(record)

            def _step(self, text):
                return StepResult(reward=float(text.isupper()), done=True, reason=ANSWERED)

        not_an_env = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("my_envs:Shout", EnvConfig(max_turns=1))
    assert type(env).__name__ == "Shout" and env.config.max_turns == 1
    assert run_episode(env, {"prompt_id": "x", "text": "hi"}, scripted(["HI"])).total_reward == 1.0
    with pytest.raises(KeyError, match=r"no environment named 'calculator'; registered: \['calculator_reverse', "
                                       r"'python_tool'\]"):
        get_env_class("calculator")
    with pytest.raises(ValueError, match="package.module:ClassName"):
        load_env_class("my_envs:")
    with pytest.raises(ImportError, match="cannot import module 'no_such_envs'"):
        get_env_class("no_such_envs:Shout")
    with pytest.raises(AttributeError, match=r"has no 'Whisper'; the environments it defines or imports: "
                                             r"\['Shout'\]"):
        get_env_class("my_envs:Whisper")
    with pytest.raises(TypeError, match="not a subclass"):
        get_env_class("my_envs:not_an_env")


def test_envs_loads_no_heavy_library():
    probe = ("import sys, envs.registry\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'vllm', 'ray'}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_instructions_join_a_system_message_the_prompt_brings():
    rec = {"prompt_id": "p", "answer": "3", "data_source": "calculator_reverse", "extra_info": {"task": "sum"},
           "messages": [{"role": "system", "content": "Answer in tags."}, {"role": "user", "content": "1+2?"}]}
    for env in (CalculatorReverseEnv(), PythonToolEnv()):
        first = env.reset(rec)
        assert [m["role"] for m in first] == ["system", "user"]
        assert first[0]["content"].endswith("\n\nAnswer in tags.") and len(first[0]["content"]) > 100
        env.close()
    assert CalculatorReverseEnv(CalculatorConfig(instructions=False)).reset(rec) == rec["messages"]
