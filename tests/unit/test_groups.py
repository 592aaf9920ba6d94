"""actors/groups.py: one way from an engine's completions to a wire group, for actors and the sync baseline."""
from __future__ import annotations

import numpy as np
import pytest

from actors.groups import build_group
from buffer.schema import decode, encode
from engines.core import Completion

pytestmark = pytest.mark.unit


def test_a_group_carries_each_sample_scored_on_its_decoded_text_and_its_version_span():
    from data.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    texts = ["abcd", "dcba"]
    comps = [Completion(token_ids=np.asarray(tok(t, add_special_tokens=False)["input_ids"], dtype=np.int32),
                        logprobs=np.full(len(t), -0.5, dtype=np.float32), finish_reason="stop",
                        version_start=3, version_end=4 + i) for i, t in enumerate(texts)]
    record = {"prompt_id": "p7", "text": "abcd", "answer": "dcba", "data_source": "reverse"}
    seen = []

    def score(rec, text):
        seen.append((rec["prompt_id"], text))
        return float(text == rec["answer"])

    g = build_group("g1", record, [1, 2, 3], comps, score=score, tokenizer=tok, actor_id="actor-0", created_at=5.0)
    assert seen == [("p7", "abcd"), ("p7", "dcba")]
    assert [s.reward for s in g.samples] == [0.0, 1.0]
    assert [(s.version_start, s.version_end) for s in g.samples] == [(3, 4), (3, 5)]
    assert g.prompt_ids.dtype == np.int32 and g.prompt_ids.tolist() == [1, 2, 3]
    back = decode(encode(g))
    assert back.group_id == "g1" and back.prompt_id == "p7" and back.actor_id == "actor-0"
    pinned = build_group("g2", record, [1], comps, score=score, tokenizer=tok, actor_id="a", created_at=0.0, version=9)
    assert {(s.version_start, s.version_end) for s in pinned.samples} == {(9, 9)}
