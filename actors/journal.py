"""Each finished turn of an in-flight episode kept in Redis, so that another actor resumes the episode from
there, not from the prompt, when its actor dies (or drains).

After an episode's turn has been answered by its environment, its state (tokens, loss mask, behavior logprobs,
per-turn versions, rewards, messages, the environment's own `state()`) is written to the hash
`Keys.episodes(gid)`, field = the episode's index in its group. When the actor's leases are reclaimed (it died,
or drained with episodes in flight), the prompt goes back to the queue tagged with the group id
(buffer/store.py RECLAIM_LUA); the actor that leases it next renames the journal to its own group id and
continues each episode after its last finished turn (an episode that had ended stays ended). A group handed to
the sender drops its journal. A journal nobody resumes (its group aborted as stale) expires on its own.
"""
from __future__ import annotations

import msgpack
import numpy as np

from envs.episode import EpisodeState

# A journal whose group was never resumed (aborted stale, dead-lettered) is deleted by Redis after this long:
# far beyond any episode's life, short enough that a week-long run does not keep them all.
JOURNAL_TTL_S = 24 * 3600


def pack(ep: EpisodeState) -> bytes:
    return msgpack.packb({
        "p": np.asarray(ep.prompt_ids, np.int32).tobytes(), "r": np.asarray(ep.response_ids, np.int32).tobytes(),
        "m": np.asarray(ep.mask, np.uint8).tobytes(), "lp": np.asarray(ep.logprobs, np.float32).tobytes(),
        "t": [list(t) for t in ep.turns], "rw": list(ep.rewards), "msg": ep.messages, "es": ep.env.state(),
        "rs": ep.reason, "d": ep.detail}, use_bin_type=True)


def unpack(data: bytes, env, record: dict, max_tokens: int) -> EpisodeState:
    """The episode as it was journaled, its environment (new, reset for `record`) restored to match."""
    d = msgpack.unpackb(data, raw=False)
    env.reset(record)
    env.restore(d["es"])
    return EpisodeState(env=env, prompt_ids=np.frombuffer(d["p"], np.int32).tolist(), max_tokens=max_tokens,
                        messages=d["msg"], response_ids=np.frombuffer(d["r"], np.int32).tolist(),
                        mask=np.frombuffer(d["m"], np.uint8).tolist(),
                        logprobs=np.frombuffer(d["lp"], np.float32).tolist(), turns=[tuple(t) for t in d["t"]],
                        rewards=list(d["rw"]), reason=d["rs"], detail=d["d"])


class EpisodeJournal:
    """The journals of one actor's groups in Redis."""

    def __init__(self, r, keys):
        self.r, self.keys = r, keys

    def save(self, gid: str, i: int, ep: EpisodeState) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.keys.episodes(gid), i, pack(ep))
        pipe.expire(self.keys.episodes(gid), JOURNAL_TTL_S)
        pipe.execute()

    def adopt(self, old_gid: str, gid: str) -> dict[int, bytes]:
        """The journal of the group `old_gid`, renamed to `gid` (ours now); empty when there is none."""
        try:
            self.r.rename(self.keys.episodes(old_gid), self.keys.episodes(gid))
        except Exception as e:   # redis.ResponseError: no such key (expired, or resumed by another lease)
            if "no such key" not in str(e).lower():
                raise
            return {}
        return {int(k): v for k, v in self.r.hgetall(self.keys.episodes(gid)).items()}

    def drop(self, gid: str) -> None:
        self.r.delete(self.keys.episodes(gid))
