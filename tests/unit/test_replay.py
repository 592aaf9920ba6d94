"""A replay (buffer.replay_dir) that cannot be the recorded run is refused before it trains, naming the key:
a recording shorter than trainer.total_steps (not only on reaching the first missing step, after training the
others), and batches of another size than learner.groups_per_step (not trained on the recorded size silently,
under a config that says otherwise)."""
from __future__ import annotations

import pytest

from buffer.replay import ReplaySource, batch_path, record


def _recording(tmp_path, steps: int, groups: int):
    for k in range(steps):
        record(tmp_path, k, [b"payload-%d-%d" % (k, i) for i in range(groups)])
    return tmp_path


def test_a_recording_shorter_than_total_steps_is_refused_at_start(tmp_path):
    rec = _recording(tmp_path, steps=3, groups=2)
    ReplaySource(rec, groups_per_step=2, steps=3)  # exactly the recorded steps: fine
    with pytest.raises(FileNotFoundError) as e:
        ReplaySource(rec, groups_per_step=2, steps=5)
    msg = str(e.value)
    assert "step 3" in msg and str(batch_path(rec, 3)) in msg and "trainer.total_steps to at most 3" in msg


def test_a_batch_of_another_size_than_groups_per_step_is_refused(tmp_path):
    rec = _recording(tmp_path, steps=1, groups=8)
    src = ReplaySource(rec, groups_per_step=4, steps=1)
    with pytest.raises(ValueError) as e:
        src.next_batch(0)
    assert "holds 8 groups" in str(e.value) and "learner.groups_per_step is 4" in str(e.value)
