"""rewards/scorers.py scorers: real-looking model outputs, right and wrong, malformed ones included."""
from __future__ import annotations

import json
import math

import pytest

from rewards.scorers import (FULL_SCORE, boxed_math_score, check_scorer, compute_score, countdown_score,
                            eval_arithmetic, extract_gsm8k, get_scorer, gsm8k_score, last_answer_tag, last_boxed,
                            math_equal, numbers_equal, reasoning_gym_score, record_scorer, register_scorer, SCORERS)

pytestmark = pytest.mark.unit

HUGE = "9" * 5000


# --------------------------------------------------------------------------- GSM8K

GSM8K_CASES = [  # (completion, ground truth, score with format_score=0, score with format_score=0.1)
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
     "in April and May.\n#### 72", "72", 1.0, 1.0),
    ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
     "$<<0.2*50=10>>10.\n#### 10", "10", 1.0, 1.0),
    # right number with thousands separator and a dollar sign
    ("The total cost is 1200 + 300 = 1500 dollars... wait, plus tax: 1,500 + 250 = 1,750.\n#### $1,750", "1750",
     1.0, 1.0),
    # several #### lines: the last one counts (the model corrected itself)
    ("First I thought #### 18\nBut she also gave away 2 more, so 18 - 2 = 16.\n#### 16", "16", 1.0, 1.0),
    ("First guess #### 16\nActually I double counted: 16 + 2 = 18.\n#### 18", "16", 0.0, 0.1),
    # wrong, well formatted: only the format reward
    ("Betty has 100 / 2 = 50 dollars. Her parents give 15 and grandparents 30. 50 + 15 + 30 = 95.\n#### 95",
     "5", 0.0, 0.1),
    # no ####: the last number is the fallback answer (right here), no format credit for a wrong one
    ("James writes 3 pages to 2 friends twice a week: 3 * 2 * 2 = 12 pages a week, so 12 * 52 = 624 pages a "
     "year.", "624", 1.0, 1.0),
    ("So the answer is 620 pages, I think.", "624", 0.0, 0.0),
    # no answer at all
    ("I am not sure how to solve this problem. Let me think about the apples and the oranges.", "5", 0.0, 0.0),
    ("", "5", 0.0, 0.0),
    # huge numbers are never equal by float rounding, and never crash
    (f"#### {HUGE}", "10", 0.0, 0.0),  # too long to be an answer: no #### answer, falls back to nothing valid
    ("#### 100000000000000000001", "100000000000000000000", 0.0, 0.1),
    ("#### 100000000000000000000", "100000000000000000000", 1.0, 1.0),
    # trailing punctuation and decimals that are integers
    ("She pays 3 * 6 = 18 dollars.\n#### 18.00", "18", 1.0, 1.0),
    ("The answer is 18.", "18", 1.0, 1.0),
    ("#### -3", "-3", 1.0, 1.0),
]


@pytest.mark.parametrize("completion,gt,plain,with_format", GSM8K_CASES)
def test_gsm8k_real_outputs(completion, gt, plain, with_format):
    assert gsm8k_score(completion, gt) == plain
    assert gsm8k_score(completion, gt, format_score=0.1) == with_format
    assert compute_score("openai/gsm8k", completion, gt, format_score=0.1) == with_format


def test_gsm8k_methods_match_verl():
    text = "She has 3 + 4 = 7 apples.\n#### 7\nThe answer is 8"
    assert extract_gsm8k(text, "strict") == ("7", True)            # verl strict: the #### answer
    assert extract_gsm8k(text, "flexible") == ("8", False)         # verl flexible: the last number
    assert extract_gsm8k(text, "strict_then_last") == ("7", True)
    assert extract_gsm8k("so 12 apples", "strict") == (None, False)
    assert gsm8k_score("so 12 apples", "12", method="strict") == 0.0
    assert gsm8k_score("so 12 apples", "12", method="strict_then_last") == 1.0
    with pytest.raises(ValueError, match="method"):
        extract_gsm8k("x", "loose")


def test_gsm8k_only_the_tail_is_read():
    # an answer buried before a long tail is not the final answer (and the regex cost stays bounded)
    assert gsm8k_score("#### 5\n" + "blah " * 200, "5") == 0.0
    assert gsm8k_score("x" * 100_000 + "\n#### 5", "5") == 1.0


def test_numbers_equal_exact():
    assert numbers_equal("1,000", "1000.0") and numbers_equal("$5", "5") and numbers_equal(".5", "0.5")
    assert not numbers_equal("0.1", "0.10000000000000001")  # floats would say equal
    assert not numbers_equal("12", "abc") and not numbers_equal(HUGE, HUGE)  # too long: no number


# --------------------------------------------------------------------------- boxed math

MATH_CASES = [
    ("We have $x^2 - 5x + 6 = (x-2)(x-3)$, so the roots sum to $\\boxed{5}$.", "5", 1.0),
    ("The probability is $\\frac{3}{6} = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("Simplifying, the answer is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("So the answer is $\\boxed{0.5}$.", "\\frac12", 1.0),
    ("The interval is $\\boxed{\\left(-\\infty, 3\\right)}$.", "(-\\infty,3)", 1.0),
    ("The angle measures $\\boxed{90^\\circ}$.", "90", 1.0),
    ("Thus $x = \\boxed{x=7}$", "7", 1.0),
    ("The final answer is $\\boxed{\\sqrt{2}}$", "\\sqrt2", 1.0),
    # wrong
    ("The roots sum to $\\boxed{6}$.", "5", 0.0),
    ("The probability is $\\boxed{\\frac{2}{3}}$.", "\\frac{1}{2}", 0.0),
    # several boxes: the last one counts
    ("At first I got $\\boxed{4}$ but rechecking, it is $\\boxed{5}$.", "5", 1.0),
    ("Maybe $\\boxed{5}$... no, it must be $\\boxed{4}$.", "5", 0.0),
    # no box, unclosed box (truncated), empty
    ("The roots sum to 5.", "5", 0.0),
    ("So the answer is $\\boxed{\\frac{1}{2", "\\frac{1}{2}", 0.0),
    ("", "5", 0.0),
    # huge numbers
    (f"$\\boxed{{{HUGE}}}$", HUGE, 1.0),  # identical strings are equal, however long
    (f"$\\boxed{{{HUGE}}}$", "9", 0.0),
]


@pytest.mark.parametrize("completion,gt,expected", MATH_CASES)
def test_boxed_math_real_outputs(completion, gt, expected):
    assert boxed_math_score(completion, gt) == expected
    assert compute_score("lighteval/MATH", completion, gt) == expected


def test_boxed_helpers():
    assert last_boxed("a \\boxed{x^{2}} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{3}") == "3" and last_boxed("\\boxed 7$") == "7"
    assert last_boxed("no box") is None and last_boxed("\\boxed{open") is None
    assert math_equal("3/4", "\\frac{3}{4}") and math_equal("-3/4", "-\\frac{3}{4}")
    assert not math_equal("3/4", "\\frac{4}{3}")
    # ground truth stored with its box (some datasets do)
    assert boxed_math_score("\\boxed{12}", "\\boxed{12}") == 1.0
    assert boxed_math_score("\\boxed{13}", "12", format_score=0.2) == 0.2


# --------------------------------------------------------------------------- countdown

CD = {"target": 98, "numbers": [44, 19, 35]}
COUNTDOWN_CASES = [
    ("<think>44 + 19 = 63, 63 + 35 = 98.</think>\n<answer>44 + 19 + 35</answer>", 1.0),
    ("<think>Try (44 - 19) = 25, no. 35 + 44 = 79, 79 + 19 = 98</think><answer>(35 + 44) + 19</answer>", 1.0),
    # wrong value with the right numbers: format credit only
    ("<think>44 * 2 ...</think><answer>44 - 19 + 35</answer>", 0.1),
    # uses a number twice / a number not given
    ("<answer>44 + 44 + 10</answer>", 0.1),
    ("<answer>98</answer>", 0.1),
    # several answers: the last counts
    ("<answer>44 - 19 + 35</answer> wait, <answer>44 + 19 + 35</answer>", 1.0),
    ("<answer>44 + 19 + 35</answer> hmm no <answer>44 * 19 * 35</answer>", 0.1),
    # no answer tag
    ("44 + 19 + 35 = 98", 0.0),
    ("", 0.0),
    # code, not arithmetic; division by zero; huge
    ("<answer>__import__('os').system('true') or 44 + 19 + 35</answer>", 0.1),
    ("<answer>44 / (19 - 19) + 35</answer>", 0.1),
    (f"<answer>{HUGE} + 44 + 19 + 35</answer>", 0.1),
]


@pytest.mark.parametrize("completion,expected", COUNTDOWN_CASES)
def test_countdown_real_outputs(completion, expected):
    assert countdown_score(completion, CD) == expected
    assert compute_score("countdown", completion, json.dumps(CD)) == expected  # ground truth stored as JSON text


def test_countdown_exact_division_and_format_option():
    gt = {"target": 3, "numbers": [9, 6, 2]}
    assert countdown_score("<answer>9 / (6 / 2)</answer>", gt) == 1.0  # exact rationals: 9 / 3
    assert countdown_score("<answer>9 / 6 * 2</answer>", gt) == 1.0    # 1.5 * 2, no float error
    assert countdown_score("<answer>9 - 6 - 2</answer>", gt, format_score=0.0) == 0.0
    assert eval_arithmetic("2 ** 10") is None and eval_arithmetic("abs(-3)") is None
    assert eval_arithmetic("(" * 150 + "1" + ")" * 150) is None  # longer than any real solution
    assert eval_arithmetic("-(3 - 5) * 2") == 4


# --------------------------------------------------------------------------- reasoning-gym

def rg_info(meta=None, fmt="answer_tag", question="q"):
    return {"metadata": json.dumps(meta or {}), "answer_format": fmt, "question": question}


GSM_SYMBOLIC_CASES = [  # reasoning-gym's gsm_symbolic scorer: first number inside the last <answer> tag
    ("John has 35 apples and 105 kiwi... 160 + 128 = 288.\n<answer>288</answer>", "288", 1.0),
    ("<answer>288 items</answer>", "288", 1.0),
    ("So the total is 288.\n<answer>290</answer>", "288", 0.01),
    ("<answer>First 12, then 288</answer>", "288", 0.01),  # its scorer reads the first number
    ("<answer>288</answer> oh wait <answer>289</answer>", "288", 0.01),
    ("The answer is 288.", "288", 0.0),                       # no tag: no answer
    ("<answer>many</answer>", "288", 0.0),
    (f"<answer>{HUGE}</answer>", "288", 0.01),
]


@pytest.mark.parametrize("completion,gt,expected", GSM_SYMBOLIC_CASES)
def test_reasoning_gym_gsm_symbolic(completion, gt, expected):
    got = compute_score("reasoning_gym/gsm_symbolic", completion, gt, rg_info())
    assert got == pytest.approx(expected)


def test_gsm_symbolic_port_agrees_with_the_package():
    rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install -e '.[data]')")
    ds = rg.create_dataset("gsm_symbolic", size=5, seed=3)
    for entry in ds:
        outs = [f"<answer>{entry['answer']}</answer>", f"<answer>{int(entry['answer']) + 1}</answer>",
                "<answer>none</answer>", "no tag", f"<answer>{entry['answer']}.0 units</answer>", f"<answer>{HUGE}</answer>"]
        for out in outs:
            ours = reasoning_gym_score(out, entry["answer"], rg_info(entry["metadata"]),
                                       data_source="reasoning_gym/gsm_symbolic")
            theirs = ds.score_answer(last_answer_tag(out), entry)
            assert ours == pytest.approx(theirs), out


CHAIN_SUM_CASES = [  # SmolLM2-135M-style answers to "2 + 5 - 3 =" in the gsm8k format (expected 4)
    ("2 + 5 = 7, then 7 - 3 = 4.\n#### 4", 1.0),
    ("#### +04.00", 1.0),                               # sign, leading zeros, trailing decimals
    ("The final answer is 2.", 0.0),                    # last-number fallback: 2
    ("2 + 5 - 3 = 2 + 3 - 2 = 10", 0.0),
    ("#### 14", 0.5),                                   # "4" inside "14": the share it covers, as the package
    ("#### 1,004", 0.25),                               # commas dropped: 1004, which holds "4"
    ("no number at all", 0.0),
    (f"#### {HUGE}", 0.0),
]


@pytest.mark.parametrize("completion,expected", CHAIN_SUM_CASES)
def test_chain_sum_port(completion, expected, monkeypatch):
    import rewards.scorers as rw

    def no_package(task):
        raise ImportError("reasoning-gym must not be needed")

    monkeypatch.setattr(rw, "_rg_package_scorer", no_package)
    rw.check_scorer("reasoning_gym/chain_sum")
    got = compute_score("reasoning_gym/chain_sum", completion, "4", rg_info(fmt="gsm8k"))
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("task", ["chain_sum", "products"])
def test_decimal_port_agrees_with_the_package(task):
    rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install -e '.[data]')")
    from rewards.scorers import _decimal_score

    ds = rg.create_dataset(task, size=6, seed=4)
    for entry in ds:
        a = entry["answer"]
        for out in [a, f"+0{a}.00", f"{int(a):,}", str(int(a) + 1), f"1{a}", f"{a} apples", "", None, "abc", "nan",
                    "sNaN", "1e5", HUGE, f"-{a}"]:
            assert _decimal_score(out, entry) == pytest.approx(ds.score_answer(out, entry)), (task, out)


@pytest.mark.parametrize("task,outputs", [
    # (completion, right?) real-looking outputs of a small model for the first generated question
    ("chain_sum", [("Let me add: {a}\n<answer>{a}</answer>", True), ("<answer>{a}</answer>", True),
                   ("<answer>{wrong}</answer>", False), ("The result is {a}", False),
                   ("<answer>{a}</answer> or <answer>{wrong}</answer>", False)]),
    ("basic_arithmetic", [("<answer>{a}</answer>", True), ("Step by step... <answer>{a}</answer>", True),
                          ("<answer>{wrong}</answer>", False), ("<answer></answer>", False), ("", False)]),
])
def test_reasoning_gym_package_scorers(task, outputs):
    rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install -e '.[data]')")
    entry = rg.create_dataset(task, size=1, seed=5)[0]
    a = entry["answer"]
    wrong = str(int(a) + 7)
    for template, right in outputs:
        out = template.format(a=a, wrong=wrong)
        score = compute_score(f"reasoning_gym/{task}", out, a, rg_info(entry["metadata"], question=entry["question"]))
        assert (score >= FULL_SCORE) == right, (task, out, score)
        assert 0.0 <= score <= 1.0


def test_reasoning_gym_gsm8k_answer_format():
    info = rg_info(fmt="gsm8k")
    assert compute_score("reasoning_gym/gsm_symbolic", "So 100 + 88 = 188.\n#### 188", "188", info) == 1.0
    assert compute_score("reasoning_gym/gsm_symbolic", "So it is 188.", "188", info) == 1.0   # last-number fallback
    assert compute_score("reasoning_gym/gsm_symbolic", "#### 187", "188", info) == pytest.approx(0.01)
    assert compute_score("reasoning_gym/gsm_symbolic", "no idea", "188", info) == 0.0
    # format_score: a wrong answer in the asked-for format earns it; no format, or a right answer, unchanged
    assert compute_score("reasoning_gym/gsm_symbolic", "#### 187", "188", info, format_score=0.1) == 0.1
    assert compute_score("reasoning_gym/gsm_symbolic", "it is 187", "188", info, format_score=0.1) == \
        pytest.approx(0.01)
    assert compute_score("reasoning_gym/gsm_symbolic", "#### 188", "188", info, format_score=0.1) == 1.0
    tag = rg_info()
    assert compute_score("reasoning_gym/gsm_symbolic", "<answer>7</answer>", "188", tag, format_score=0.2) == 0.2
    assert compute_score("reasoning_gym/gsm_symbolic", "7", "188", tag, format_score=0.2) == 0.0


# --------------------------------------------------------------------------- registry

def test_registry_lookup_and_errors():
    assert get_scorer("openai/gsm8k") is gsm8k_score and get_scorer("countdown") is countdown_score
    assert get_scorer("reasoning_gym/anything") is reasoning_gym_score
    for bad in ("openai/gsm8k_typo", "reasoning_gym/", ""):
        with pytest.raises(KeyError, match="no reward function"):
            get_scorer(bad)
    with pytest.raises(KeyError):
        check_scorer("nope")
    check_scorer("reasoning_gym/gsm_symbolic")  # the port needs no package


def test_register_scorer_and_clamping():
    register_scorer("test/always_two", lambda c, gt, extra=None, **_: 2.0)
    register_scorer("test/nan", lambda c, gt, extra=None, **_: math.nan)
    try:
        assert compute_score("test/always_two", "x", "y") == 1.0
        assert compute_score("test/nan", "x", "y") == 0.0
    finally:
        SCORERS.pop("test/always_two")
        SCORERS.pop("test/nan")


def test_record_scorer_uses_the_record():
    score = record_scorer({"format_score": 0.1, "method": "strict_then_last"})
    assert score({"prompt_id": "a", "text": "t", "answer": "72", "data_source": "openai/gsm8k"}, "#### 72") == 1.0
    assert score({"prompt_id": "a", "text": "t", "answer": "72", "data_source": "openai/gsm8k"}, "#### 7") == 0.1
    assert score({"prompt_id": "b", "text": "abcd>", "answer": "dcba"}, "dcba") == 1.0  # old records: reverse


def test_a_scorer_that_fails_or_returns_no_number_names_its_data_source_and_prompt():
    """A scorer that raises, returns None or a non-numeric string: ScoreError naming the data_source, the prompt
    and the error (an actor dead-letters that group); NaN and out-of-range numbers are clamped as before."""
    from rewards.scorers import ScoreError

    register_scorer("test/raises", lambda c, gt, extra=None, **_: {}["numbers"])
    register_scorer("test/none", lambda c, gt, extra=None, **_: None)
    register_scorer("test/str", lambda c, gt, extra=None, **_: "high")
    score = record_scorer({})
    try:
        for ds, err in (("test/raises", "KeyError: 'numbers'"), ("test/none", "TypeError"), ("test/str", "ValueError")):
            with pytest.raises(ScoreError, match=rf"data_source '{ds}' failed on prompt 'p:3' .*{err}"):
                score({"prompt_id": "p:3", "answer": "1", "data_source": ds}, "x")
        with pytest.raises(ScoreError, match="data_source 'countdown' failed"):   # a malformed ground truth
            score({"prompt_id": "p:4", "answer": {"target": 3}, "data_source": "countdown"}, "<answer>1+2</answer>")
    finally:
        for ds in ("test/raises", "test/none", "test/str"):
            SCORERS.pop(ds)


def test_a_reward_function_file_scores_every_data_source(tmp_path):
    """data.reward_fn_path (verl's custom_reward_function.path): its function scores every record, clamped; a
    dict's `score` is taken (newer verl returns one); a missing file or function stops the config naming the key."""
    from data.dataset import DataConfig
    from runbase.configload import ConfigError

    (tmp_path / "r.py").write_text("import math\n"
                                   "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return {'a': 0.5, 'b': {'score': 3.0}, 'c': math.nan}[data_source]\n")
    cfg = DataConfig(reward_fn_path=str(tmp_path / "r.py"))
    score = record_scorer(cfg.reward_options())
    assert [score({"prompt_id": "p", "answer": "1", "data_source": ds}, "x") for ds in "abc"] == [0.5, 1.0, 0.0]
    with pytest.raises(ConfigError, match=r"'reward_fn_path'.*defines no function 'nope'"):
        DataConfig(reward_fn_path=str(tmp_path / "r.py"), reward_fn_name="nope")
    with pytest.raises(ConfigError, match=r"'reward_fn_path'.*FileNotFoundError"):
        DataConfig(reward_fn_path=str(tmp_path / "missing.py"))
