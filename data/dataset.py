"""Datasets in verl's preprocessed parquet schema, as the source of the prompt queue.

One row per prompt, the columns verl's `examples/data_preprocess/*.py` write:

| column | type | used for |
|---|---|---|
| `data_source` | str | picks the reward function (`rewards/scorers.py`) |
| `prompt` | list of {role, content} | rendered with the model's chat template |
| `ability` | str | carried, not used |
| `reward_model` | {style, ground_truth} | `ground_truth` goes to the reward function |
| `extra_info` | struct / null | carried to the reward function (reasoning-gym needs its metadata) |

`data.train_files` empty keeps the built-in task (`task` section). The learner (rank 0) loads the
files, renders every prompt and tokenizes it once; the queue then carries token ids, so actors and
the evaluation see exactly the same prompt tokens.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from data.tasks import Prompt, train_prompts, val_prompts
from rewards.scorers import check_scorer, load_reward_fn
from runbase.configload import ConfigError, local_path

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
# a generated dataset's test split is drawn from seed + this: far from any training seed a user picks
VAL_SEED_OFFSET = 1_000_003
MAX_PROMPT_ID_STEM = 64  # prompt ids are "<file stem>:<row>"; the wire schema caps ids at 256 characters


def verl_schema(extra_info_fields: list) -> "pyarrow.Schema":  # noqa: F821
    """The arrow schema verl's preprocessing writes (field order as its dicts are written), with a
    dataset's own `extra_info` fields: [(name, pyarrow type), ...]."""
    import pyarrow as pa

    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct(extra_info_fields)),
    ])


def write_splits(rows_by_split: dict[str, list[dict]], local_dir: Path, schema) -> dict[str, Path]:
    """`<local_dir>/<split>.parquet` per split, as verl's preparation scripts lay them out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    local_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, rows in rows_by_split.items():
        out[split] = local_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), out[split])
    return out


@dataclass(kw_only=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """verl-schema parquet files to train on (`~` expanded, relative to the launcher's directory); empty = the
    built-in `task`."""
    val_files: list[str] = field(default_factory=list)
    """verl-schema parquet files evaluated at step 0, every `trainer.val_every` steps and at the end;
    required with train_files."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens, after the chat template (verl: data.max_prompt_length)."""
    overlong_prompt: Literal["error", "filter", "truncate"] = "error"
    """A longer prompt: `error` stops the job naming the file and row; `filter` drops the row;
    `truncate` keeps its last max_prompt_length tokens (the end holds the generation prompt)."""
    val_max_prompts: int = 0
    """Evaluate only the first this many validation prompts, of the files or the built-in task (0 = all);
    bounds evaluation time."""
    shuffle: bool = True
    """Visit training rows in a fresh seeded order every epoch (else file order)."""
    seed: int = 1
    """Seed of the training order."""
    format_score: float | None = None
    """Reward for a well-formed but wrong answer; null = each scorer's default (gsm8k 0, countdown 0.1)."""
    gsm8k_method: Literal["strict", "flexible", "strict_then_last"] = "strict_then_last"
    """GSM8K answer extraction: `#### N` only, the last number only, or `#### N` else the last number."""
    reward_fn_path: str = ""
    """A Python file whose function `reward_fn_name` scores every prompt, whatever its data_source (verl's
    custom_reward_function.path): called as fn(data_source, solution_str, ground_truth, extra_info) -> float in
    [0, 1] (or a dict with a `score`). Every process that scores loads it, so on several nodes the path must be
    readable on each. Empty: the registered scorer of each row's data_source (rewards/scorers.py)."""
    reward_fn_name: str = "compute_score"
    """The function of reward_fn_path (verl's custom_reward_function.name)."""

    def __post_init__(self):
        self.train_files = [local_path(f) for f in self.train_files]   # read by the learner, in its own cwd
        self.val_files = [local_path(f) for f in self.val_files]
        if self.train_files and not self.val_files:
            raise ConfigError("val_files", "required with data.train_files (the held-out set the run is judged on)")
        if self.val_files and not self.train_files:
            raise ConfigError("train_files", "required with data.val_files (validation files alone train nothing)")
        for key in ("train_files", "val_files"):
            for i, f in enumerate(getattr(self, key)):
                try:
                    check_schema(f)
                except DataError as e:
                    raise ConfigError(f"{key}[{i}]", str(e)) from None
        if self.reward_fn_path:   # loaded now, so a missing file or function stops the launcher naming the key
            self.reward_fn_path = local_path(self.reward_fn_path)   # workers' cwd differs
            try:
                load_reward_fn(self.reward_fn_path, self.reward_fn_name)
            except Exception as e:
                raise ConfigError("reward_fn_path", f"cannot load {self.reward_fn_name!r} from {self.reward_fn_path}: "
                                  f"{type(e).__name__}: {e}") from None
        if self.max_prompt_length < 1:
            raise ConfigError("max_prompt_length", "must be >= 1")
        if self.val_max_prompts < 0:
            raise ConfigError("val_max_prompts", "must be >= 0 (0 = all rows)")
        if self.format_score is not None and not 0 <= self.format_score <= 1:
            raise ConfigError("format_score", "must be in [0, 1] (rewards are in [0, 1]) or null")

    def reward_options(self) -> dict:
        """Keyword options every scorer accepts (each ignores what it does not use)."""
        opts = {"format_score": self.format_score, "method": self.gsm8k_method}
        if self.reward_fn_path:   # taken out by rewards.scorers.record_scorer
            opts["reward_fn"] = (self.reward_fn_path, self.reward_fn_name)
        return opts


class DataError(ValueError):
    """A dataset problem; the message names the file (and row) at fault."""


def check_schema(path: str) -> None:
    """Cheap start-up check (parquet footer only): the file exists, has verl's required columns and a row."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: file not found")
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(p)
        names = set(meta.schema.to_arrow_schema().names)
    except Exception as e:  # not parquet, truncated, ...
        hint = (" (only parquet is read, verl's layout: convert it, e.g. pandas.read_json(path, lines=True)"
                ".to_parquet(...))" if p.suffix.lower() in (".json", ".jsonl", ".csv") else "")
        raise DataError(f"{path}: not a readable parquet file ({e}){hint}") from None
    if meta.num_rows == 0:   # found by the learner only after every process started
        raise DataError(f"{path}: no rows")
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; verl's schema has data_source, prompt, ability, "
                        f"reward_model {{style, ground_truth}}, extra_info (see python -m data.gsm8k)")


@dataclass(frozen=True)
class Row:
    """One validated dataset row."""
    where: str                 # "FILE row N", for messages
    data_source: str
    messages: list[dict]
    ground_truth: Any
    extra_info: dict | None


def _validate(rec: dict, where: str) -> Row:
    ds = rec.get("data_source")
    if not isinstance(ds, str) or not ds:
        raise DataError(f"{where}: data_source must be a non-empty string, got {ds!r}")
    msgs = rec.get("prompt")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: prompt must be a non-empty list of chat messages {{role, content}}, "
                        f"got {type(msgs).__name__}")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: prompt[{j}] must be {{role: str, content: str}}, got {m!r:.200}")
    rm = rec.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise DataError(f"{where}: reward_model must be {{style, ground_truth}} with a ground_truth, got {rm!r:.200}")
    extra = rec.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: extra_info must be a struct (dict) or null, got {type(extra).__name__}")
    return Row(where=where, data_source=ds, messages=[{"role": m["role"], "content": m["content"]} for m in msgs],
               ground_truth=rm["ground_truth"], extra_info=extra)


def read_rows(path: str) -> list[Row]:
    """Every row of one verl-schema parquet file, validated (errors name the file and row)."""
    import pyarrow.parquet as pq

    check_schema(path)
    table = pq.read_table(path)
    cols = [c for c in ("data_source", "prompt", "reward_model", "extra_info") if c in table.column_names]
    rows = [_validate(rec, f"{path} row {i}") for i, rec in enumerate(table.select(cols).to_pylist())]
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def render(messages: list[dict], tokenizer) -> tuple[str, bool]:
    """(prompt text, templated): the model's chat template with the generation prompt when the tokenizer
    has one; otherwise the message contents joined by newlines (e.g. the built-in byte tokenizer)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
    return "\n".join(m["content"] for m in messages), False


def _json_safe(x):
    return json.loads(json.dumps(x, default=str)) if x is not None else None


def build_prompts(files: list[str], tokenizer, cfg: DataConfig, *, limit: int = 0) -> list[Prompt]:
    """Rows of `files` as queue prompts (token ids included), with the over-long policy applied."""

    stems = [Path(f).stem[:MAX_PROMPT_ID_STEM] for f in files]
    unique = len(set(stems)) == len(stems)
    out: list[Prompt] = []
    dropped = 0
    checked: set[str] = set()
    for k, path in enumerate(files):
        rows = read_rows(path)
        for i, row in enumerate(rows):
            if limit and len(out) >= limit:
                break
            # fail at start, not in an actor halfway through the run (data.reward_fn_path scores every data_source)
            if not cfg.reward_fn_path and row.data_source not in checked:
                try:
                    check_scorer(row.data_source)
                except (KeyError, ImportError) as e:
                    raise DataError(f"{row.where}: {e.args[0]}") from None
                checked.add(row.data_source)
            text, templated = render(row.messages, tokenizer)
            # A chat template writes its own special tokens (BOS included where the model has one);
            # plain text gets the tokenizer's usual ones.
            ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
            if len(ids) > cfg.max_prompt_length:
                if cfg.overlong_prompt == "error":
                    raise DataError(f"{row.where}: prompt has {len(ids)} tokens after the chat template, more than "
                                    f"data.max_prompt_length={cfg.max_prompt_length}; raise it, or set "
                                    f"data.overlong_prompt=filter (drop such rows) or truncate (keep the last tokens)")
                if cfg.overlong_prompt == "filter":
                    dropped += 1
                    continue
                ids = ids[-cfg.max_prompt_length:]
                text = tokenizer.decode(ids)
            if not ids:
                raise DataError(f"{row.where}: the prompt renders to no tokens")
            pid = f"{stems[k]}:{i}" if unique else f"{k}.{stems[k]}:{i}"
            out.append(Prompt(prompt_id=pid, text=text, answer=_json_safe(row.ground_truth),
                              data_source=row.data_source, prompt_ids=tuple(int(t) for t in ids),
                              extra_info=_json_safe(row.extra_info), messages=tuple(row.messages)))
    if dropped:
        log.warning("data.overlong_prompt=filter: dropped %d of %d rows of %s longer than %d tokens",
                    dropped, dropped + len(out), files, cfg.max_prompt_length)
    if not out:
        raise DataError(f"{files}: no rows left (every prompt is longer than data.max_prompt_length="
                        f"{cfg.max_prompt_length})")
    return out


class RowStream:
    """Endless deterministic stream over dataset prompts, epoch after epoch.

    Position p is row order[p % n] of epoch p // n (each epoch its own seeded shuffle), so a stream
    created with `start=position` continues exactly where a saved cursor left off.
    """

    def __init__(self, prompts: list[Prompt], *, shuffle: bool, seed: int, start: int = 0):
        self.prompts, self.shuffle, self.seed, self.position = prompts, shuffle, seed, start
        self._epoch, self._order = -1, list(range(len(prompts)))

    def __iter__(self):
        return self

    def __next__(self) -> Prompt:
        epoch, i = divmod(self.position, len(self.prompts))
        if self.shuffle and epoch != self._epoch:
            self._order = list(range(len(self.prompts)))
            random.Random(f"{self.seed}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        self.position += 1
        return self.prompts[self._order[i]]


class PrepError(RuntimeError):
    """Bad or missing input to a preparation command; the message names the file and row."""


def prompt_sources(cfg, tokenizer, *, start: int = 0):
    """(training stream from cursor `start`, validation prompts) of the configured data: verl parquet
    files when data.train_files is set, else the built-in task."""

    d = cfg.data
    if not d.train_files:
        return train_prompts(cfg.task, start), val_prompts(cfg.task)[:d.val_max_prompts or None]
    train = build_prompts(d.train_files, tokenizer, d)
    val = build_prompts(d.val_files, tokenizer, d, limit=d.val_max_prompts)
    log.info("data: %d training prompts from %s, %d validation prompts from %s", len(train), d.train_files,
             len(val), d.val_files)
    return RowStream(train, shuffle=d.shuffle, seed=d.seed, start=start), val
