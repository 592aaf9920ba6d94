"""A prompt group for the wire from an engine's completions: written once for the rollout actors, the
synchronous baseline (experiments/sync.py) and the actor benchmark."""
from __future__ import annotations

import numpy as np

from buffer.schema import Group, Sample
from envs.episode import MAX_EPISODE_TOKENS


def build_group(group_id: str, record: dict, prompt_ids, completions, *, score, tokenizer, actor_id: str,
                created_at: float, version: int | None = None) -> Group:
    """Each completion decoded (special tokens skipped) and scored by `score(record, text)`; behavior
    logprobs and version spans as the engine reported them, or all at `version` when given (an engine
    that held one version for the whole call)."""
    samples = [Sample(response_ids=c.token_ids, behavior_logprobs=c.logprobs,
                      reward=float(score(record, tokenizer.decode(c.token_ids, skip_special_tokens=True))),
                      finish_reason=c.finish_reason,
                      version_start=c.version_start if version is None else version,
                      version_end=c.version_end if version is None else version) for c in completions]
    return Group(group_id=group_id, prompt_id=record["prompt_id"], actor_id=actor_id,
                 prompt_ids=np.asarray(prompt_ids, dtype=np.int32), samples=samples, created_at=created_at)


def build_episode_group(group_id: str, record: dict, prompt_ids, episodes, *, actor_id: str,
                        created_at: float) -> Group:
    """A group of multi-turn episodes (envs/episode.py EpisodeState): each sample is the episode's tokens after
    the prompt, its loss mask (the model's tokens), per-turn versions, return and end reason."""
    samples = []
    for ep in episodes:
        turns = np.asarray(ep.turns, dtype=np.int32)
        samples.append(Sample(response_ids=np.asarray(ep.response_ids, dtype=np.int32),
                              behavior_logprobs=np.asarray(ep.logprobs, dtype=np.float32), reward=ep.total_reward,
                              finish_reason="stop" if ep.reason != MAX_EPISODE_TOKENS else "length",
                              version_start=int(turns[:, 1].min()), version_end=int(turns[:, 2].max()),
                              loss_mask=np.asarray(ep.mask, dtype=np.uint8), turns=turns.reshape(-1),
                              end_reason=ep.reason))
    return Group(group_id=group_id, prompt_id=record["prompt_id"], actor_id=actor_id,
                 prompt_ids=np.asarray(prompt_ids, dtype=np.int32), samples=samples, created_at=created_at)
