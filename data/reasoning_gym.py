"""reasoning-gym tasks to parquet in verl's schema, offline (procedural generators, no hub).

    python -m data.reasoning_gym --task gsm_symbolic --size 2000 --local_dir DIR
           [--val_size 200] [--seed 1] [--answer_format answer_tag|gsm8k] [--kw key=value ...]

Any reasoning-gym task works (`--list` prints them). Rows:
    data_source  "reasoning_gym/<task>"        (scored by the task's own scorer, rewards/scorers.py)
    prompt       answer_tag: [system: reasoning-gym's default prompt (answer in <answer></answer>), user: question]
                 gsm8k:      [user: question + verl's GSM8K instruction (answer after "####")]
    ability      "reasoning"
    reward_model {"style": "rule", "ground_truth": the entry's answer}
    extra_info   {"split", "index", "question", "metadata" (JSON of the entry's metadata), "answer_format"}

test.parquet is generated with another seed and never repeats a training question.
`--kw` passes dataset options (e.g. `--kw min_terms=2 max_terms=3` for chain_sum).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from data.dataset import VAL_SEED_OFFSET, PrepError
from data.dataset import verl_schema as schema
from data.dataset import write_splits
from data.gsm8k import INSTRUCTION as GSM8K_INSTRUCTION
from rewards.scorers import RG_PREFIX

MAX_TRIES_FACTOR = 4         # generate up to this many times val_size candidates to find unseen questions


def verl_schema():
    import pyarrow as pa

    return schema([("split", pa.string()), ("index", pa.int64()), ("question", pa.string()),
                   ("metadata", pa.string()), ("answer_format", pa.string())])


def messages(question: str, answer_format: str) -> list[dict]:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if answer_format == "gsm8k":
        return [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}]
    return [{"role": "system", "content": SYSTEM_PROMPTS["default"]}, {"role": "user", "content": question}]


def _jsonable(o):
    # metadata holds tuples (JSON lists already), sets, Fractions, ...: keep what scorers can read back
    return sorted(o, key=str) if isinstance(o, (set, frozenset)) else str(o)


def to_row(task: str, entry: dict, split: str, index: int, answer_format: str) -> dict:
    return {
        "data_source": RG_PREFIX + task,
        "prompt": messages(entry["question"], answer_format),
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
        "extra_info": {"split": split, "index": index, "question": entry["question"],
                       "metadata": json.dumps(entry.get("metadata", {}), default=_jsonable),
                       "answer_format": answer_format},
    }


def generate(task: str, size: int, val_size: int, seed: int, kw: dict) -> dict[str, list[dict]]:
    import reasoning_gym

    try:
        train = list(reasoning_gym.create_dataset(task, size=size, seed=seed, **kw))
    except Exception as e:
        raise PrepError(f"reasoning-gym task {task!r} with options {kw}: {type(e).__name__}: {e}") from None
    seen = {e["question"] for e in train}
    cands = reasoning_gym.create_dataset(task, size=val_size * MAX_TRIES_FACTOR, seed=seed + VAL_SEED_OFFSET, **kw)
    val = []
    for e in cands:
        if e["question"] not in seen:
            seen.add(e["question"])
            val.append(e)
            if len(val) == val_size:
                break
    if len(val) < val_size:
        raise PrepError(f"{task}: found only {len(val)} test questions unseen in training (wanted {val_size}); "
                        f"the task has few distinct questions with these options: lower --size or --val_size")
    return {"train": train, "test": val}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.reasoning_gym", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", help="reasoning-gym task name (see --list)")
    p.add_argument("--size", type=int, default=2000, help="training rows")
    p.add_argument("--val_size", type=int, default=200, help="test rows (never a training question)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--local_dir", help="where train.parquet and test.parquet go")
    p.add_argument("--answer_format", choices=["answer_tag", "gsm8k"], default="answer_tag",
                   help="what the prompt asks for: <answer>...</answer> (reasoning-gym) or '#### N' (GSM8K style)")
    p.add_argument("--kw", nargs="*", default=[], metavar="KEY=VALUE", help="dataset options (values read as YAML)")
    p.add_argument("--list", action="store_true", help="print the task names and exit")
    args = p.parse_args(argv)
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        print("error: reasoning-gym is not installed: pip install -e '.[data]'", file=sys.stderr)
        return 2
    from reasoning_gym.factory import DATASETS

    if args.list:
        print("\n".join(sorted(DATASETS)))
        return 0
    if not args.task or not args.local_dir:
        p.error("--task and --local_dir are required")
    if args.task not in DATASETS:
        print(f"error: unknown reasoning-gym task {args.task!r} (python -m data.reasoning_gym --list)", file=sys.stderr)
        return 2
    if args.size < 1 or args.val_size < 1:
        p.error("--size and --val_size must be >= 1")
    kw = {}
    for item in args.kw:
        key, sep, raw = item.partition("=")
        if not sep:
            p.error(f"--kw {item!r}: expected KEY=VALUE")
        kw[key] = yaml.safe_load(raw)
    try:
        splits = generate(args.task, args.size, args.val_size, args.seed, kw)
    except PrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    rows = {split: [to_row(args.task, e, split, i, args.answer_format) for i, e in enumerate(entries)]
            for split, entries in splits.items()}
    for split, path in write_splits(rows, Path(args.local_dir).expanduser(), verl_schema()).items():
        print(f"{split}: {len(rows[split])} rows -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
