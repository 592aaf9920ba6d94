"""GSM8K to parquet in verl's layout (examples/data_preprocess/gsm8k.py), offline first.

    python -m data.gsm8k --local_dir DIR [--input PATH] [--test_input FILE] [--test_size N]

`--input` is a local copy of GSM8K: a folder holding train and test files (`train.jsonl` and
`test.jsonl` as in github.com/openai/grade-school-math, or the hub's `train-*.parquet` /
`test-*.parquet`), or one jsonl/json/parquet file of {question, answer} rows (then `--test_input`
gives the test split, or the last `--test_size` rows are held out). Without `--input` the
`datasets` package is tried (a reachable hub); otherwise the command says what to do.

Each row becomes (exactly verl's columns and values):
    data_source  "openai/gsm8k"
    prompt       [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability      "math"
    reward_model {"style": "rule", "ground_truth": the number after "####", commas removed}
    extra_info   {"split", "index", "answer" (the full solution), "question"}
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from data.dataset import PrepError
from data.dataset import verl_schema as schema
from data.dataset import write_splits

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str, where: str = "") -> str:
    """The ground truth of a GSM8K solution: the number after '#### ', commas removed (verl's rule)."""
    m = _SOLUTION.search(answer)
    if m is None:
        raise PrepError(f"{where}: the answer has no '#### <number>' line: {answer[-120:]!r}")
    return m.group(1).replace(",", "")


def verl_schema():
    """The arrow schema of verl's gsm8k.py output."""
    import pyarrow as pa

    return schema([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())])


def to_verl_row(question: str, answer: str, split: str, index: int, where: str = "") -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer, where)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def read_raw(path: Path) -> list[tuple[str, str, str]]:
    """(question, answer, where) of every row of a jsonl / json / parquet file."""
    if not path.is_file():
        raise PrepError(f"{path}: file not found")
    recs: list[tuple[dict, str]] = []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        recs = [(r, f"{path} row {i}") for i, r in enumerate(pq.read_table(path).to_pylist())]
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise PrepError(f"{path}: expected a JSON list of {{question, answer}} objects")
        recs = [(r, f"{path} item {i}") for i, r in enumerate(data)]
    elif path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    recs.append((json.loads(line), f"{path} line {n}"))
                except json.JSONDecodeError as e:
                    raise PrepError(f"{path} line {n}: not JSON ({e.msg})") from None
    else:
        raise PrepError(f"{path}: expected .jsonl, .json or .parquet")
    out = []
    for r, where in recs:
        if not isinstance(r, dict) or not isinstance(r.get("question"), str) or not isinstance(r.get("answer"), str):
            raise PrepError(f"{where}: expected {{\"question\": str, \"answer\": str}}, got {str(r)[:120]}")
        out.append((r["question"], r["answer"], where))
    if not out:
        raise PrepError(f"{path}: no rows")
    return out


def _split_files(folder: Path, split: str) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.startswith(split)
                  and p.suffix in (".jsonl", ".json", ".parquet"))


def load_local(inp: Path, test_input: Path | None, test_size: int) -> dict[str, list]:
    if inp.is_dir():
        splits = {s: _split_files(inp, s) for s in ("train", "test")}
        for s, files in splits.items():
            if not files:
                raise PrepError(f"{inp}: no {s}*.jsonl / {s}*.json / {s}*.parquet file inside")
        return {s: [row for f in files for row in read_raw(f)] for s, files in splits.items()}
    train = read_raw(inp)
    if test_input is not None:
        return {"train": train, "test": read_raw(test_input)}
    if not 0 < test_size < len(train):
        raise PrepError(f"{inp}: --test_size {test_size} must be between 1 and {len(train) - 1} rows")
    return {"train": train[:-test_size], "test": train[-test_size:]}


def load_hub() -> dict[str, list]:
    try:
        import datasets
    except ImportError:
        raise PrepError("no --input given and the `datasets` package is not installed. Pass a local copy: "
                        "--input DIR with train.jsonl and test.jsonl (github.com/openai/grade-school-math, "
                        "grade_school_math/data/) or the hub's parquet files") from None
    try:
        ds = datasets.load_dataset(DATA_SOURCE, "main")
    except Exception as e:
        raise PrepError(f"no --input given and {DATA_SOURCE} could not be loaded from the hub ({type(e).__name__}: "
                        f"{str(e)[:200]}). Pass a local copy: --input DIR with train.jsonl and test.jsonl") from None
    return {s: [(r["question"], r["answer"], f"{DATA_SOURCE} {s} row {i}") for i, r in enumerate(ds[s])]
            for s in ("train", "test")}


def write(splits: dict[str, list], local_dir: Path) -> dict[str, Path]:
    return write_splits({split: [to_verl_row(q, a, split, i, where) for i, (q, a, where) in enumerate(rows)]
                         for split, rows in splits.items()}, local_dir, verl_schema())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.gsm8k", description=__doc__.split("\n\n")[0])
    p.add_argument("--local_dir", required=True, help="where train.parquet and test.parquet go")
    p.add_argument("--input", help="local GSM8K: a folder with train*/test* files, or one jsonl/json/parquet file")
    p.add_argument("--test_input", help="with a single --input file: the test split's file")
    p.add_argument("--test_size", type=int, default=0,
                   help="with a single --input file and no --test_input: hold out its last N rows as test")
    args = p.parse_args(argv)
    try:
        if args.input:
            splits = load_local(Path(args.input).expanduser(),
                                Path(args.test_input).expanduser() if args.test_input else None, args.test_size)
        else:
            splits = load_hub()
        out = write(splits, Path(args.local_dir).expanduser())
    except PrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, path in out.items():
        print(f"{split}: {len(splits[split])} rows -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
