"""An episode's finished turns survive its actor (actors/journal.py), against a real Redis and the real lease
scripts: an actor that stops mid-episode leaves each episode's last finished turn in Redis; reclaiming its lease
re-queues the prompt tagged with the group; the next actor resumes every episode from there (the kept turns
token for token), counts it, finishes the group and drops the journal."""
from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from actors.episodes import EpisodeEngine
from actors.journal import EpisodeJournal
from buffer.store import Leaser, reclaim_leases
from data.tasks import TaskConfig, val_prompts
from data.tiny_model import resolve_model_path
from engines.core import SamplingParams
from engines.hf_engine import HFEngine
from envs.config import EpisodesConfig
from runbase.keys import Keys

CFG = EpisodesConfig(name="calculator_reverse", options={"instructions": False, "max_turns": 3})
PARAMS = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=32, seed=0)


@pytest.fixture(scope="module")
def hf():
    return HFEngine(resolve_model_path("builtin:tiny-tool", TaskConfig()))


def lease(r, keys, actor: str):
    (got,) = Leaser(r, keys, max_staleness=2, groups_per_step=1, actor_id=actor, admission="learner").lease(1, 0)
    return got


def run_to_end(eng: EpisodeEngine, limit: int = 50) -> dict:
    done = {}
    for _ in range(limit):
        done.update(eng.step())
        if not eng.in_flight():
            return done
    raise AssertionError("the group did not finish")


def test_a_group_resumes_from_its_journal_after_its_actor_stops_mid_episode(r, run_id, hf):
    keys = Keys(run_id)
    r.rpush(keys.prompts, json.dumps(val_prompts(TaskConfig())[0].record()))
    gid, record = lease(r, keys, "actor-0")
    first = EpisodeEngine(hf, CFG, max_tokens=96, journal=EpisodeJournal(r, keys))
    first.start(gid, record, PARAMS)
    while r.hlen(keys.episodes(gid)) < PARAMS.n:   # every episode's first turn answered and kept
        first.step()
    first.close()   # the actor is gone; its turns in flight with it (it may be a turn past its journal)
    journal = {int(i): msgpack.unpackb(v) for i, v in r.hgetall(keys.episodes(gid)).items()}
    kept = {i: d["t"] for i, d in journal.items()}
    kept_ids = {i: np.frombuffer(d["r"], np.int32).tolist() for i, d in journal.items()}

    assert reclaim_leases(r, keys, "actor-0") == 1
    gid2, record2 = lease(r, keys, "actor-1")
    assert gid2 != gid and record2["resume_gid"] == gid
    second = EpisodeEngine(hf, CFG, max_tokens=96, journal=EpisodeJournal(r, keys))
    second.start(gid2, record2, PARAMS)
    assert "resume_gid" not in record2 and not r.exists(keys.episodes(gid))
    assert second.stats()["episodes_resumed"] == PARAMS.n
    assert second.stats()["turns_resumed"] == sum(len(t) for t in kept.values())
    (eps,) = run_to_end(second).values()
    for i, ep in enumerate(eps):
        assert ep.done and [list(t) for t in ep.turns[:len(kept[i])]] == kept[i]
        assert ep.response_ids[:len(kept_ids[i])] == kept_ids[i]
    assert not r.exists(keys.episodes(gid2)), "a finished group drops its journal"
    second.close()


def test_a_re_queued_prompt_carries_one_resume_tag_and_none_without_a_journal(r, run_id):
    keys = Keys(run_id)
    r.rpush(keys.prompts, json.dumps({"prompt_id": "p", "text": "abcd>", "answer": "dcba"}))
    gid, _ = lease(r, keys, "a")
    r.hset(keys.episodes(gid), 0, b"x")
    reclaim_leases(r, keys, "a")
    gid2, rec = lease(r, keys, "b")
    assert rec["resume_gid"] == gid
    r.rename(keys.episodes(gid), keys.episodes(gid2))
    reclaim_leases(r, keys, "b")   # dies again before its first turn: the tag names the newer group, once
    gid3, rec = lease(r, keys, "c")
    assert rec["resume_gid"] == gid2 and list(rec) == ["resume_gid", "prompt_id", "text", "answer"]
    reclaim_leases(r, keys, "c")   # no journal under gid3: the prompt goes back untagged
    _, rec = lease(r, keys, "d")
    assert "resume_gid" not in rec
