"""The tool-using toy's prompts as verl parquet: `python -m data.calculator --local_dir ~/data/calculator`.

Rows of data source `calculator_reverse` (envs/calculator.py): sums of 2-4 numbers and strings to reverse,
alternating, each asked as one user message; `reward_model.ground_truth` is the answer and `extra_info.task`
says which kind (the scorer gives a reversal partial credit). Run with `env.name=calculator_reverse`, whose
instructions explain the tools. The test split is drawn from another seed and never repeats a training prompt.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from data.dataset import VAL_SEED_OFFSET, verl_schema, write_splits
from envs.calculator import DATA_SOURCE, make_records


def to_row(record: dict, split: str, index: int) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": record["text"]}],
            "ability": "tools", "reward_model": {"style": "rule", "ground_truth": record["answer"]},
            "extra_info": {"split": split, "index": index, "task": record["extra_info"]["task"]}}


def splits(size: int, val_size: int, seed: int) -> dict[str, list[dict]]:
    """{'train': rows, 'test': rows}; no test question is a training question."""
    train = [to_row(r, "train", i) for i, r in enumerate(make_records(size, seed))]
    seen = {r["prompt"][0]["content"] for r in train}
    test = [r for r in make_records(2 * val_size, seed + VAL_SEED_OFFSET) if r["text"] not in seen][:val_size]
    return {"train": train, "test": [to_row(r, "test", i) for i, r in enumerate(test)]}


def schema():
    import pyarrow as pa

    return verl_schema([("split", pa.string()), ("index", pa.int64()), ("task", pa.string())])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.calculator", description=__doc__.split("\n\n")[0])
    p.add_argument("--local_dir", required=True, help="where train.parquet and test.parquet go")
    p.add_argument("--size", type=int, default=4000, help="training rows")
    p.add_argument("--val_size", type=int, default=128, help="test rows")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.size < 1 or args.val_size < 1:
        p.error("--size and --val_size must be >= 1")
    for split, path in write_splits(splits(args.size, args.val_size, args.seed), Path(args.local_dir).expanduser(),
                                    schema()).items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
