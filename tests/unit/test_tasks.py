"""data/tasks.py: held-out split, training stream, TaskConfig invariants."""
from __future__ import annotations

from itertools import islice

import pytest

from data.tasks import SEPARATOR, TaskConfig, train_prompts, val_prompts
from runbase.configload import ConfigError

pytestmark = pytest.mark.unit


def test_val_prompts_deterministic_and_reversed():
    cfg = TaskConfig()
    a, b = val_prompts(cfg), val_prompts(TaskConfig())
    assert a == b and len(a) == cfg.num_val_prompts
    assert len({p.prompt_id for p in a}) == len(a)
    for p in a:
        assert p.text == p.prompt_id + SEPARATOR and p.answer == p.prompt_id[::-1]
        assert len(p.prompt_id) == cfg.length and set(p.prompt_id) <= set(cfg.alphabet)
    assert val_prompts(TaskConfig(seed=99)) != a


def test_train_stream_excludes_held_out():
    cfg = TaskConfig()
    held = {p.prompt_id for p in val_prompts(cfg)}
    items = list(islice(train_prompts(cfg), 5000))
    assert not held & {p.prompt_id for p in items}
    assert all(p.answer == p.prompt_id[::-1] for p in items)
    assert len({p.prompt_id for p in items}) > 1000  # actually random, not a constant
    assert items == list(islice(train_prompts(cfg), 5000))


@pytest.mark.parametrize("k", [1, 17, 300])
def test_start_without_held_out_is_exact_skip(k):
    # With no held-out strings nothing is skipped, so `start` indexes the yielded items directly.
    cfg = TaskConfig(num_val_prompts=0)
    base = list(islice(train_prompts(cfg), k + 200))
    assert list(islice(train_prompts(cfg, start=k), 200)) == base[k:]


def test_resume_from_saved_position_continues_exactly():
    # The learner saves `position` as its prompt cursor; a stream restarted there must yield
    # exactly what the first one would have yielded next (no repeats, nothing skipped).
    cfg = TaskConfig()
    full = list(islice(train_prompts(cfg), 3000))
    for k in (1, 37, 500, 2000):
        stream = train_prompts(cfg)
        head = list(islice(stream, k))
        resumed = list(islice(train_prompts(cfg, start=stream.position), 500))
        assert head + resumed == full[:k + 500], k
    held_out = {p.prompt_id for p in val_prompts(cfg)}
    stream = train_prompts(cfg)
    list(islice(stream, 3000))
    assert stream.position > 3000 and held_out  # held-out strings were drawn and skipped


@pytest.mark.parametrize("kw,key", [
    ({"name": "math"}, "name"), ({"alphabet": "aab"}, "alphabet"), ({"alphabet": "a"}, "alphabet"),
    ({"alphabet": "ab>"}, "alphabet"), ({"length": 0}, "length"), ({"length": 33}, "length"),
    ({"alphabet": "ab", "length": 3, "num_val_prompts": 3}, "num_val_prompts"),
])
def test_task_config_invariants(kw, key):
    with pytest.raises(ConfigError) as e:
        TaskConfig(**kw)
    assert e.value.key == key


def test_task_config_boundary_ok():
    TaskConfig(alphabet="ab", length=3, num_val_prompts=2)  # 2*4 == 2**3: allowed
    TaskConfig(length=1, alphabet="abcd", num_val_prompts=1)
