"""data/dataset.py, data/gsm8k.py, data/reasoning_gym.py: verl parquet in, prompt records out."""
from __future__ import annotations

import json
from itertools import islice

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.dataset import DataConfig, DataError, RowStream, build_prompts, prompt_sources, read_rows
from data.gsm8k import INSTRUCTION, main as gsm8k_main, to_verl_row, verl_schema, write
from runbase.configload import ConfigError, from_dict

pytestmark = pytest.mark.unit

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

GSM8K_RAW = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
     "clips did Natalia sell altogether in April and May?",
     "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in "
     "April and May.\n#### 72"),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did "
     "she earn?", "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
                  "$<<0.2*50=10>>10.\n#### 10"),
    ("A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
     "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts of "
     "fabric\n#### 3"),
    ("Josh buys a house for $80,000 and puts in $50,000 in repairs. This increased the value of the house by "
     "150%. How much profit did he make?", "The cost of the house and repairs came out to 80,000+50,000="
     "$<<80000+50000=130000>>130,000\n... So he made a profit of 200,000-130,000=$<<200000-130000=70000>>70,000"
     "\n#### 70,000"),
]


@pytest.fixture(scope="module")
def byte_tok():
    from data.tokenizer import build_byte_tokenizer

    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    from data.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    tok.chat_template = CHATML
    return tok


@pytest.fixture
def gsm8k_dir(tmp_path):
    write({"train": [(q, a, f"raw {i}") for i, (q, a) in enumerate(GSM8K_RAW)],
           "test": [(q, a, f"raw {i}") for i, (q, a) in enumerate(GSM8K_RAW[:2])]}, tmp_path)
    return tmp_path


def test_gsm8k_rows_are_verls_layout(gsm8k_dir):
    t = pq.read_table(gsm8k_dir / "train.parquet")
    assert t.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    r = t.to_pylist()[3]
    assert r["data_source"] == "openai/gsm8k" and r["ability"] == "math"
    assert r["prompt"] == [{"role": "user", "content": GSM8K_RAW[3][0] + " " + INSTRUCTION}]
    assert r["reward_model"] == {"style": "rule", "ground_truth": "70000"}  # commas removed, like verl
    assert r["extra_info"] == {"split": "train", "index": 3, "answer": GSM8K_RAW[3][1], "question": GSM8K_RAW[3][0]}


def test_build_prompts_applies_the_chat_template(gsm8k_dir, chat_tok):
    cfg = DataConfig(train_files=[str(gsm8k_dir / "train.parquet")], val_files=[str(gsm8k_dir / "test.parquet")])
    prompts = build_prompts(cfg.train_files, chat_tok, cfg)
    assert [p.prompt_id for p in prompts] == ["train:0", "train:1", "train:2", "train:3"]
    p = prompts[0]
    assert p.text == f"<|im_start|>user\n{GSM8K_RAW[0][0]} {INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert list(p.prompt_ids) == chat_tok(p.text, add_special_tokens=False)["input_ids"]
    rec = json.loads(json.dumps(p.record()))  # what the Redis queue carries
    assert rec["data_source"] == "openai/gsm8k" and rec["answer"] == "72" and rec["prompt_ids"] == list(p.prompt_ids)
    assert rec["extra_info"]["index"] == 0
    # the row's messages travel too: a multi-turn environment starts its episodes from them
    assert rec["messages"] == [{"role": "user", "content": f"{GSM8K_RAW[0][0]} {INSTRUCTION}"}]


def test_without_a_template_messages_are_joined(tmp_path, byte_tok):
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": None}]
    f = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    [p] = build_prompts([str(f)], byte_tok, DataConfig(train_files=[str(f)], val_files=[str(f)]))
    assert p.text == "Be brief.\n1+1?" and p.extra_info is None
    assert byte_tok.decode(list(p.prompt_ids)) == p.text


@pytest.mark.parametrize("policy", ["error", "filter", "truncate"])
def test_overlong_prompts(gsm8k_dir, chat_tok, policy):
    files = [str(gsm8k_dir / "train.parquet")]
    lengths = [len(chat_tok.apply_chat_template([{"role": "user", "content": q + " " + INSTRUCTION}],
                                                tokenize=False, add_generation_prompt=True).encode())
               for q, _ in GSM8K_RAW]
    limit = sorted(lengths)[1]  # byte tokens: two rows fit, two are longer
    cfg = DataConfig(train_files=files, val_files=files, max_prompt_length=limit, overlong_prompt=policy)
    longest = max(range(4), key=lambda i: lengths[i])
    if policy == "error":
        with pytest.raises(DataError, match=r"train\.parquet row \d: prompt has \d+ tokens .*data\.max_prompt_length=\d+"):
            build_prompts(files, chat_tok, cfg)
        return
    prompts = build_prompts(files, chat_tok, cfg)
    if policy == "filter":
        assert len(prompts) == sum(n <= limit for n in lengths)
        assert f"train:{longest}" not in {p.prompt_id for p in prompts}
    else:
        assert len(prompts) == 4 and all(len(p.prompt_ids) <= limit for p in prompts)
        cut = next(p for p in prompts if p.prompt_id == f"train:{longest}")
        assert len(cut.prompt_ids) == limit and cut.text.endswith("<|im_start|>assistant\n")  # the end is kept


def test_everything_filtered_is_an_error(gsm8k_dir, chat_tok):
    files = [str(gsm8k_dir / "train.parquet")]
    cfg = DataConfig(train_files=files, val_files=files, max_prompt_length=5, overlong_prompt="filter")
    with pytest.raises(DataError, match="no rows left"):
        build_prompts(files, chat_tok, cfg)


@pytest.mark.parametrize("row,message", [
    ({"prompt": [{"role": "user", "content": None}]}, r"bad\.parquet row 1: prompt\[0\] must be"),
    ({"prompt": []}, r"bad\.parquet row 1: prompt must be a non-empty list"),
    ({"reward_model": {"style": "rule", "ground_truth": None}}, r"bad\.parquet row 1: reward_model must be"),
    ({"data_source": ""}, r"bad\.parquet row 1: data_source must be a non-empty string"),
    ({"data_source": "my/unknown"}, r"bad\.parquet row 1: no reward function for data_source 'my/unknown'"),
])
def test_bad_rows_are_named(tmp_path, byte_tok, row, message):
    good = to_verl_row(*GSM8K_RAW[0], "train", 0)
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([good, {**good, **row}]), f)
    with pytest.raises(DataError, match=message):
        build_prompts([str(f)], byte_tok, DataConfig(train_files=[str(f)], val_files=[str(f)]))


def test_prompt_as_plain_text_is_named(tmp_path, byte_tok):
    f = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist([{**to_verl_row(*GSM8K_RAW[0], "train", 0), "prompt": "just text"}]), f)
    with pytest.raises(DataError, match=r"text\.parquet row 0: prompt must be a non-empty list of chat messages"):
        read_rows(str(f))


def test_config_errors_name_the_dotted_key(tmp_path, gsm8k_dir):
    train = str(gsm8k_dir / "train.parquet")
    cases = [
        ({"train_files": [train]}, "data.val_files", "required with data.train_files"),
        ({"val_files": [train]}, "data.train_files", "required with data.val_files"),
        ({"train_files": [train], "val_files": [str(tmp_path / "nope.parquet")]}, "data.val_files[0]", "not found"),
        ({"train_files": [train], "val_files": [train], "overlong_prompt": "cut"}, "data.overlong_prompt", "one of"),
        ({"train_files": [train], "val_files": [train], "format_score": 2.0}, "data.format_score", "[0, 1]"),
    ]
    bad = tmp_path / "cols.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), bad)
    cases.append(({"train_files": [str(bad)], "val_files": [train]}, "data.train_files[0]", "missing column"))
    notpq = tmp_path / "raw.parquet"
    notpq.write_text('{"question": "q"}\n')
    cases.append(({"train_files": [str(notpq)], "val_files": [train]}, "data.train_files[0]", "not a readable parquet"))
    jsonl = tmp_path / "train.jsonl"     # only parquet is read: said so, with a way to convert
    jsonl.write_text('{"question": "q"}\n')
    cases.append(({"train_files": [str(jsonl)], "val_files": [train]}, "data.train_files[0]", "only parquet is read"))
    empty = tmp_path / "empty.parquet"   # the right columns, no row: refused at start, not by the learner later
    pq.write_table(pa.Table.from_pylist([to_verl_row(*GSM8K_RAW[0], "train", 0)]).slice(0, 0), empty)
    cases.append(({"train_files": [train], "val_files": [str(empty)]}, "data.val_files[0]", "no rows"))
    for data, key, msg in cases:
        with pytest.raises(ConfigError) as e:
            from_dict(DataConfig, data, "data")
        assert e.value.key == key and msg in e.value.message, (data, e.value)


def test_a_model_length_that_cannot_hold_a_prompt_and_an_answer_is_refused(gsm8k_dir):
    """actors.max_model_len below data.max_prompt_length + actors.max_tokens cut every answer short in silence."""
    from cluster.config import load_config

    files = [f"data.train_files=['{gsm8k_dir / 'train.parquet'}']", f"data.val_files=['{gsm8k_dir / 'test.parquet'}']",
             "data.max_prompt_length=100", "actors.max_tokens=50"]
    with pytest.raises(ConfigError, match=r"actors.max_model_len.*149 cannot hold a prompt of data.max_prompt_length"):
        load_config(None, [*files, "actors.max_model_len=149"])
    assert load_config(None, [*files, "actors.max_model_len=150"]).actors.max_model_len == 150


def test_config_expands_home(monkeypatch, gsm8k_dir):
    monkeypatch.setenv("HOME", str(gsm8k_dir))
    cfg = DataConfig(train_files=["~/train.parquet"], val_files=["~/test.parquet"])
    assert cfg.train_files == [str(gsm8k_dir / "train.parquet")]


def test_row_stream_epochs_and_resume(gsm8k_dir, byte_tok):
    files = [str(gsm8k_dir / "train.parquet")]
    prompts = build_prompts(files, byte_tok, DataConfig(train_files=files, val_files=files))
    stream = RowStream(prompts, shuffle=True, seed=3)
    seq = [p.prompt_id for p in islice(stream, 40)]
    for e in range(10):  # every epoch visits every row once
        assert sorted(seq[4 * e:4 * e + 4]) == sorted(p.prompt_id for p in prompts)
    assert len({tuple(seq[4 * e:4 * e + 4]) for e in range(10)}) > 1  # and epochs are shuffled differently
    for k in (1, 5, 13):
        assert [p.prompt_id for p in islice(RowStream(prompts, shuffle=True, seed=3, start=k), 20)] == seq[k:k + 20]
    assert [p.prompt_id for p in islice(RowStream(prompts, shuffle=False, seed=3), 6)] == \
        ["train:0", "train:1", "train:2", "train:3", "train:0", "train:1"]


def test_prompt_sources_default_is_the_builtin_task(byte_tok):
    from cluster.config import Config

    stream, val = prompt_sources(Config(), byte_tok)
    assert val[0].data_source == "reverse" and len(val) == 128
    capped = prompt_sources(Config(data=DataConfig(val_max_prompts=16)), byte_tok)[1]
    assert [p.prompt_id for p in capped] == [p.prompt_id for p in val[:16]]   # the cap holds for the task too
    rec = next(stream).record()
    assert set(rec) == {"prompt_id", "text", "answer", "data_source"}  # no token ids: actors tokenize the text


def test_val_max_prompts_and_two_files_with_one_name(tmp_path, gsm8k_dir, byte_tok):
    other = tmp_path / "b"
    write({"train": [(q, a, "x") for q, a in GSM8K_RAW[:2]]}, other)
    files = [str(gsm8k_dir / "train.parquet"), str(other / "train.parquet")]
    cfg = DataConfig(train_files=files, val_files=files, val_max_prompts=5)
    ids = [p.prompt_id for p in build_prompts(files, byte_tok, cfg)]
    assert ids == ["0.train:0", "0.train:1", "0.train:2", "0.train:3", "1.train:0", "1.train:1"]  # unique ids
    assert len(build_prompts(files, byte_tok, cfg, limit=cfg.val_max_prompts)) == 5


# --------------------------------------------------------------------------- python -m data.gsm8k

def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))


def test_gsm8k_cli_from_a_local_folder(tmp_path, capsys):
    src = tmp_path / "grade_school_math" / "data"
    src.mkdir(parents=True)
    _jsonl(src / "train.jsonl", GSM8K_RAW)
    _jsonl(src / "test.jsonl", GSM8K_RAW[:1])
    assert gsm8k_main(["--local_dir", str(tmp_path / "out"), "--input", str(tmp_path / "grade_school_math")]) == 0
    train = pq.read_table(tmp_path / "out" / "train.parquet")
    assert train.schema.equals(verl_schema()) and train.num_rows == 4
    assert pq.read_table(tmp_path / "out" / "test.parquet").num_rows == 1
    assert [r.ground_truth for r in read_rows(str(tmp_path / "out" / "train.parquet"))] == ["72", "10", "3", "70000"]


def test_gsm8k_cli_single_file_holds_out_test_rows(tmp_path):
    _jsonl(tmp_path / "all.jsonl", GSM8K_RAW)
    assert gsm8k_main(["--local_dir", str(tmp_path / "o"), "--input", str(tmp_path / "all.jsonl"),
                       "--test_size", "1"]) == 0
    assert pq.read_table(tmp_path / "o" / "train.parquet").num_rows == 3
    assert pq.read_table(tmp_path / "o" / "test.parquet").to_pylist()[0]["reward_model"]["ground_truth"] == "70000"


def test_gsm8k_cli_errors_name_the_line(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    assert gsm8k_main(["--local_dir", str(tmp_path / "o"), "--input", str(tmp_path / "bad.jsonl"),
                       "--test_size", "0"]) == 2
    assert "--test_size" in capsys.readouterr().err
    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    assert gsm8k_main(["--local_dir", str(tmp_path / "o"), "--input", str(tmp_path / "bad.jsonl"),
                       "--test_input", str(tmp_path / "t.jsonl")]) == 2
    assert "bad.jsonl line 1: the answer has no '#### <number>' line" in capsys.readouterr().err
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    assert gsm8k_main(["--local_dir", str(tmp_path / "o"), "--input", str(tmp_path / "broken.jsonl"),
                       "--test_input", str(tmp_path / "t.jsonl")]) == 2
    assert "broken.jsonl line 2: not JSON" in capsys.readouterr().err


def test_gsm8k_cli_without_input_explains(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert gsm8k_main(["--local_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no --input given" in err and "train.jsonl" in err


# --------------------------------------------------------------------------- python -m data.reasoning_gym

def test_reasoning_gym_cli(tmp_path):
    pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install -e '.[data]')")
    from data.reasoning_gym import main

    assert main(["--task", "gsm_symbolic", "--size", "20", "--val_size", "5", "--local_dir", str(tmp_path)]) == 0
    train, test = (read_rows(str(tmp_path / f"{s}.parquet")) for s in ("train", "test"))
    assert len(train) == 20 and len(test) == 5
    assert {r.extra_info["question"] for r in train}.isdisjoint(r.extra_info["question"] for r in test)
    r = train[0]
    assert r.data_source == "reasoning_gym/gsm_symbolic" and r.messages[0]["role"] == "system"
    assert "<answer>" in r.messages[0]["content"] and json.loads(r.extra_info["metadata"])["answer_value"] is not None
    from rewards.scorers import compute_score

    # the stored ground truth and metadata score a right answer 1 and a wrong one below 1
    assert compute_score(r.data_source, f"<answer>{r.ground_truth}</answer>", r.ground_truth, r.extra_info) == 1.0
    assert compute_score(r.data_source, "<answer>-1</answer>", r.ground_truth, r.extra_info) < 1.0
    assert main(["--task", "no_such_task", "--local_dir", str(tmp_path)]) == 2
