"""Reward functions keyed by `data_source` (verl's convention): pure and total.

Every scorer takes `(completion, ground_truth, extra_info, **options)` and returns a finite float in
[0, 1], whatever the text: no answer, several answers, a number with 5,000 digits, an expression
that divides by zero. `FULL_SCORE` means correct; validation accuracy counts samples that reach it,
so partial credit (format rewards, reasoning-gym's 0.01 for a wrong number) never counts as right.

| data_source | scorer | answer the prompt asks for |
|---|---|---|
| `reverse` | `reverse_reward` | the reversed string (the embedded task) |
| `openai/gsm8k`, `gsm8k` | `gsm8k_score` | `#### 42`; the last number in the text as a fallback |
| `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`, `math` | `boxed_math_score` | `\\boxed{...}` |
| `countdown` | `countdown_score` | `<answer>(25 + 5) * 4</answer>` using each number once |
| `calculator_reverse` | `tagged_answer_score` | `<answer>...</answer>`: a number, or a reversed string (extra_info `task`) |
| `reasoning_gym/<task>` | `reasoning_gym_score` | `<answer>...</answer>` (or `#### ...` for rows written with `--answer_format gsm8k`), judged by the task's own scorer |

Users add their own with `register_scorer(data_source, fn)`.
"""
from __future__ import annotations

import ast
import functools
import json
import math
import operator
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Callable

FULL_SCORE = 1.0
# Answers sit at the end of a completion; scanning only its tail keeps regexes cheap on runaway
# outputs (verl's gsm8k scorer uses the same 300-character window).
TAIL_CHARS = 300
# A "number" longer than this is not an answer anyone should get credit for, and comparing it
# exactly would cost time on adversarial outputs (Decimal has no digit limit).
MAX_NUMBER_CHARS = 64
# Countdown expressions: longer than this is not a solution to a 3-6 number puzzle.
MAX_EXPR_CHARS = 200
# Countdown intermediate values beyond this are rejected (no power operator exists, but a chain of
# products of large numbers could still grow; the targets are at most 4 digits).
MAX_EXPR_MAGNITUDE = 10**18

Scorer = Callable[..., float]


def _clamp(x: float) -> float:
    x = float(x)
    return 0.0 if not math.isfinite(x) else min(1.0, max(0.0, x))


# --------------------------------------------------------------------------- the embedded task

def reverse_reward(completion: str, answer: str) -> float:
    """Fraction of positions right; extra or missing characters count as wrong.

    Partial credit gives GRPO a dense signal on a tiny model; an exact answer scores 1.
    """
    denom = max(len(answer), len(completion))
    if denom == 0:
        return 1.0
    return sum(a == b for a, b in zip(completion, answer)) / denom


def _reverse_scorer(completion: str, ground_truth: Any, extra_info: dict | None = None, **_) -> float:
    return reverse_reward(completion, str(ground_truth))


# --------------------------------------------------------------------------- numbers

_NUMBER = re.compile(r"-?\$?(?:\d[\d,]*(?:\.\d*)?|\.\d+)")


def parse_number(text: Any) -> Decimal | None:
    """'1,234.50' / '$18' / '-3.' / '.5' -> an exact Decimal; anything else (or too long) -> None."""
    s = str(text).strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".") if s.count(".") == 1 and s.endswith(".") else s
    if not s or len(s) > MAX_NUMBER_CHARS or not re.fullmatch(r"-?(?:\d+(?:\.\d+)?|\.\d+)", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:  # pragma: no cover - the pattern above admits only valid literals
        return None


def numbers_equal(a: Any, b: Any) -> bool:
    """Exact equality of two written numbers ('18' == '18.00' == '$18'); False if either is no number."""
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


# --------------------------------------------------------------------------- GSM8K

_GSM8K_STRICT = re.compile(r"####\s*\$?\s*(-?[\d.,]+)")


def extract_gsm8k(completion: str, method: str = "strict_then_last") -> tuple[str | None, bool]:
    """(answer, formatted). `strict`: the last `#### N` (verl's strict); `flexible`: the last number
    (verl's flexible); `strict_then_last`: `#### N`, else the last number. `formatted` says the answer
    came from `#### N`, which the format reward pays for."""
    if method not in ("strict", "flexible", "strict_then_last"):
        raise ValueError(f"unknown gsm8k extraction method {method!r}")
    tail = completion[-TAIL_CHARS:]
    if method != "flexible":
        found = [m for m in _GSM8K_STRICT.findall(tail) if parse_number(m) is not None]
        if found:
            return found[-1], True
        if method == "strict":
            return None, False
    found = [m for m in _NUMBER.findall(tail) if parse_number(m) is not None]
    return (found[-1], False) if found else (None, False)


def gsm8k_score(completion: str, ground_truth: Any, extra_info: dict | None = None, *,
                method: str = "strict_then_last", format_score: float | None = None, **_) -> float:
    """1 for the right number; `format_score` (default 0, as in verl) for a wrong one written as
    `#### N`; 0 otherwise. Numbers compare exactly ('1,000' == '1000.0'), never as floats."""
    answer, formatted = extract_gsm8k(completion, method)
    if answer is None:
        return 0.0
    if numbers_equal(answer, ground_truth):
        return FULL_SCORE
    return _clamp(format_score or 0.0) if formatted else 0.0


# --------------------------------------------------------------------------- boxed math (MATH)

def last_boxed(completion: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces matched), or None."""
    start = max(completion.rfind("\\boxed"), completion.rfind("\\fbox"))
    if start < 0:
        return None
    i = completion.find("{", start)
    if i < 0:  # `\boxed 5`: the single token after a space
        m = re.match(r"\\boxed\s+([^\s$]+)", completion[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(completion)):
        c = completion[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return completion[i + 1:j]
    return None  # unclosed: a truncated answer is no answer


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72} (the MATH reference normalisation)
    parts = s.split("\\frac")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\frac"
        if sub.startswith("{") or len(sub) < 2:
            out += sub
        elif sub[1] == "{":
            out += "{" + sub[0] + "}" + sub[1:]
        else:
            out += "{" + sub[0] + "}{" + sub[1] + "}" + sub[2:]
    return out


def normalize_math(s: str) -> str:
    """The MATH dataset's answer normalisation (Hendrycks et al.), trimmed to what changes answers:
    spacing, \\left/\\right, dfrac/tfrac, degrees, dollars, units in \\text{}, trailing dots, `x =`."""
    s = str(s).strip().replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}$", "", s).strip()       # trailing units: "5 \text{ cm}"
    s = re.sub(r"\\(?:text|mbox|mathrm)\{(.*?)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if len(s.split("=")) == 2 and len(s.split("=")[0].strip()) <= 2:  # "x = 5" -> "5"
        s = s.split("=")[1]
    s = s.rstrip(".").replace(" ", "")
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)  # "3/4" -> "\frac{3}{4}"
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if not s.startswith("-") else f"-\\frac{{{m.group(1)[1:]}}}{{{m.group(2)}}}"
    return s


def _as_fraction(s: str) -> Fraction | None:
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", s)
    if m and int(m.group(3)) != 0 and len(s) <= MAX_NUMBER_CHARS:
        f = Fraction(int(m.group(2)), int(m.group(3)))
        return -f if m.group(1) else f
    d = parse_number(s)
    return Fraction(d) if d is not None else None


def math_equal(answer: str, ground_truth: str) -> bool:
    a, b = normalize_math(answer), normalize_math(ground_truth)
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    return fa is not None and fb is not None and fa == fb


def boxed_math_score(completion: str, ground_truth: Any, extra_info: dict | None = None, *,
                     format_score: float | None = None, **_) -> float:
    """1 if the last \\boxed{} equals the ground truth after MATH normalisation (or as exact
    rationals: 0.5 == \\frac{1}{2} == 1/2); `format_score` (default 0) for a wrong boxed answer."""
    answer = last_boxed(completion)
    if answer is None:
        return 0.0
    gt = str(ground_truth)
    inner = last_boxed(gt)  # some datasets keep the whole "\boxed{...}" as ground truth
    if math_equal(answer, inner if inner is not None else gt):
        return FULL_SCORE
    return _clamp(format_score or 0.0)


# --------------------------------------------------------------------------- countdown

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def last_answer_tag(completion: str) -> str | None:
    """Content of the last <answer>...</answer> (reasoning-gym's and TinyZero's convention), stripped."""
    found = _ANSWER_TAG.findall(completion)
    return found[-1].strip() if found else None


def eval_arithmetic(expr: str) -> Fraction | None:
    """Exact value of an expression of integers, + - * / and parentheses; None if it is anything
    else (names, calls, powers), divides by zero or grows past MAX_EXPR_MAGNITUDE. Never `eval`."""
    if len(expr) > MAX_EXPR_CHARS:
        return None
    try:
        tree = ast.parse(expr.replace("×", "*").replace("÷", "/"), mode="eval")
    except (SyntaxError, ValueError):
        return None

    def ev(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            v = _BINOPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(v) > MAX_EXPR_MAGNITUDE:
                raise OverflowError
            return v
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def countdown_score(completion: str, ground_truth: Any, extra_info: dict | None = None, *,
                    format_score: float | None = None, **_) -> float:
    """TinyZero/verl countdown: 1 if the last <answer> is an expression using exactly the given numbers
    (each once) that equals the target; `format_score` (default 0.1, as in verl) for an answer tag
    holding anything else; 0 without one. ground_truth: {"target": int, "numbers": [int, ...]}."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    target, numbers = gt["target"], gt["numbers"]
    fs = _clamp(0.1 if format_score is None else format_score)
    expr = last_answer_tag(completion)
    if expr is None:
        return 0.0
    if len(expr) > MAX_EXPR_CHARS:  # also keeps int() below from meeting a 5,000-digit literal
        return fs
    if sorted(int(n) for n in re.findall(r"\d+", expr)) != sorted(int(n) for n in numbers):
        return fs
    value = eval_arithmetic(expr)
    return FULL_SCORE if value is not None and value == Fraction(target) else fs


def tagged_answer_score(completion: str, ground_truth: Any, extra_info: dict | None = None, **_) -> float:
    """The last <answer>...</answer> against the ground truth: for extra_info `task` = `reverse` the reversed
    string with `reverse_reward`'s partial credit, otherwise a number compared exactly; 0 without a tag.
    The tool-using toy environment's episodes (envs/calculator.py) end this way."""
    answer = last_answer_tag(completion)
    if answer is None:
        return 0.0
    if (extra_info or {}).get("task") == "reverse":
        return reverse_reward(answer, str(ground_truth))
    return FULL_SCORE if numbers_equal(answer, ground_truth) else 0.0


# --------------------------------------------------------------------------- reasoning-gym

RG_PREFIX = "reasoning_gym/"


def _gsm_symbolic_score(answer: str | None, entry: dict) -> float:
    """reasoning-gym's gsm_symbolic scorer, ported so actors need no reasoning-gym install:
    the first number in the answer against the expected one (1.0), any other number 0.01.
    tests/unit/test_rewards.py checks it agrees with the package's own."""
    if answer is None:
        return 0.0
    m = re.search(r"\b-?\d+(?:\.\d+)?\b", answer)
    if not m:
        return 0.0
    try:
        return 1.0 if float(m.group(0)) == float(entry["answer"]) else 0.01
    except (ValueError, OverflowError):
        return 0.0


def _decimal_score(answer: str | None, entry: dict) -> float:
    """reasoning-gym's compute_decimal_reward (chain_sum, products), ported likewise: equal as decimals
    after dropping commas (sign, leading zeros and trailing decimals tolerated) is 1.0; otherwise, if
    the expected answer's text occurs in the answer, the share of the answer it covers."""
    if not answer:
        return 0.0
    answer, oracle = answer.replace(",", ""), str(entry["answer"]).replace(",", "")
    try:
        if Decimal(answer) == Decimal(oracle):
            return 1.0
    except (InvalidOperation, ValueError):
        pass
    return len(oracle) / len(answer) if oracle in answer else 0.0


_RG_PORTS: dict[str, Callable[[str | None, dict], float]] = {
    "gsm_symbolic": _gsm_symbolic_score, "chain_sum": _decimal_score, "products": _decimal_score}


@functools.cache  # building a task's scorer builds its dataset object: once per task, not per completion
def _rg_package_scorer(task: str):
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(f"scoring data_source {RG_PREFIX}{task} needs the reasoning-gym package where the "
                          f"actors run (pip install -e '.[data]'); built-in: {sorted(_RG_PORTS)}") from None
    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_score(completion: str, ground_truth: Any, extra_info: dict | None = None, *,
                        data_source: str = "", format_score: float | None = None, **_) -> float:
    """The task's own reasoning-gym scorer on the answer the prompt asked for: the last
    <answer>...</answer>, or for rows written with answer_format=gsm8k the `#### N` / last number.
    extra_info carries `metadata` (JSON) and the question, which some scorers need. With
    `format_score` set, a wrong answer in the asked-for format (a tag; `#### N`) scores at least that."""
    task = data_source[len(RG_PREFIX):]
    info = extra_info or {}
    if info.get("answer_format") == "gsm8k":
        answer, formatted = extract_gsm8k(completion)
    else:
        answer = last_answer_tag(completion)
        formatted = answer is not None
    meta = info.get("metadata") or "{}"
    entry = {"question": info.get("question", ""), "answer": str(ground_truth),
             "metadata": json.loads(meta) if isinstance(meta, str) else meta}
    fn = _RG_PORTS.get(task) or _rg_package_scorer(task)
    try:
        score = _clamp(fn(answer, entry))
    except Exception:  # a scorer choking on a malformed answer: that answer is wrong, not the run
        score = 0.0
    if score < FULL_SCORE and formatted and format_score:
        score = max(score, _clamp(format_score))
    return score


# --------------------------------------------------------------------------- registry

SCORERS: dict[str, Scorer] = {
    "reverse": _reverse_scorer,
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": boxed_math_score,
    "DigitalLearningGmbH/MATH-lighteval": boxed_math_score,
    "HuggingFaceH4/MATH-500": boxed_math_score,
    "math": boxed_math_score,
    "countdown": countdown_score,
    "calculator_reverse": tagged_answer_score,
}
PREFIX_SCORERS: dict[str, Scorer] = {RG_PREFIX: reasoning_gym_score}


def register_scorer(data_source: str, fn: Scorer) -> None:
    """Add a scorer: fn(completion, ground_truth, extra_info, **options) -> float in [0, 1]."""
    SCORERS[data_source] = fn


def get_scorer(data_source: str) -> Scorer:
    if data_source in SCORERS:
        return SCORERS[data_source]
    for prefix, fn in PREFIX_SCORERS.items():
        if data_source.startswith(prefix) and len(data_source) > len(prefix):
            return fn
    raise KeyError(f"no reward function for data_source {data_source!r}; known: {sorted(SCORERS)} "
                   f"and prefixes {sorted(PREFIX_SCORERS)} (score it with a function of your own: "
                   f"data.reward_fn_path=FILE.py, verl's custom_reward_function.path)")


def check_scorer(data_source: str) -> None:
    """Raise now (KeyError/ImportError) if rows of this data_source could not be scored later."""
    get_scorer(data_source)
    if data_source.startswith(RG_PREFIX) and data_source[len(RG_PREFIX):] not in _RG_PORTS:
        _rg_package_scorer(data_source[len(RG_PREFIX):])


def compute_score(data_source: str, completion: str, ground_truth: Any, extra_info: dict | None = None,
                  **options) -> float:
    """verl's `default_compute_score` shape: the registered scorer of `data_source`, clamped to [0, 1]."""
    return _clamp(get_scorer(data_source)(completion, ground_truth, extra_info, data_source=data_source, **options))


def score_record(record: dict, completion: str, **options) -> float:
    """Score a completion of one prompt record (what the prompt queue carries)."""
    return compute_score(record.get("data_source", "reverse"), completion, record["answer"],
                         record.get("extra_info"), **options)


REWARDS: dict[str, Callable[[str, str], float]] = {"reverse": reverse_reward}


def get_reward_fn(task: str) -> Callable[[str, str], float]:
    try:
        return REWARDS[task]
    except KeyError:
        raise KeyError(f"no reward function for task {task!r}; known: {sorted(REWARDS)}") from None


def load_reward_fn(path: str, name: str = "compute_score") -> Callable:
    """verl's custom_reward_function: the function `name` of the Python file at `path`, called for every prompt as
    name(data_source, solution_str, ground_truth, extra_info) -> float (or a dict with a `score`). Each process
    that scores (actors, the learner's evaluation, the evaluator) loads it itself: a scorer registered with
    register_scorer in the launcher's process never reaches them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"asyncrl_reward_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path} defines no function {name!r}")
    return fn


def _custom_score(fn: Callable, record: dict, completion: str) -> float:
    out = fn(record.get("data_source", "reverse"), completion, record["answer"], record.get("extra_info"))
    return _clamp(out["score"] if isinstance(out, dict) else out)


class ScoreError(ValueError):
    """A reward function raised (or returned no number) on one completion; the message names its data_source and
    prompt. An actor dead-letters that group and goes on (raised out of the actor, it would be restarted, lease the
    same prompt again and take every actor, then the job, down with only the scorer's bare exception)."""


def record_scorer(options: dict | None = None) -> Callable[[dict, str], float]:
    """score(record, completion) with fixed scorer options (data.reward_options()); ScoreError when the
    record's scorer fails."""
    opts = dict(options or {})
    custom = opts.pop("reward_fn", None)   # (path, name): data.reward_fn_path, verl's custom_reward_function
    fn = load_reward_fn(*custom) if custom else None

    def score(record: dict, completion: str) -> float:
        try:
            return _custom_score(fn, record, completion) if fn else score_record(record, completion, **opts)
        except Exception as e:
            raise ScoreError(f"the reward function of data_source {record.get('data_source', 'reverse')!r} failed on "
                             f"prompt {record.get('prompt_id')!r} (ground truth {record.get('answer')!r:.200}): "
                             f"{type(e).__name__}: {e}") from e

    return score
