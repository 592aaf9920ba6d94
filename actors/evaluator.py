"""The evaluator process (`trainer.val_engine=vllm`): held-out evaluation off the learner's loop.

It holds a vLLM engine and receives every weight version as an actor does (a member of the weight
group). The learner adds a version to `<run>:val:requests` when it wants that version evaluated and goes
on training; once the evaluator holds exactly that version it evaluates the held-out prompts (the same
prompts, sampling settings and seed as the learner's own evaluation) and writes the result to
`<run>:val:results`. A requested version it can no longer hold (a newer one replaced it first) is
answered `skipped`, so the learner never waits for it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

from actors.rollout import GIL_SWITCH_S, subscribe
from data.dataset import prompt_sources
from engines.backends import build_engine
from envs.episode import EpisodePlayer
from rewards.scorers import record_scorer
from runbase.keys import Keys, connect, mark_startup

log = logging.getLogger(__name__)

POLL_S = 0.05   # wait for a weight version or a request when there is nothing to evaluate


class EvaluatorProcess:
    def __init__(self, cfg, *, run_id: str, redis_url: str, model_path: str, gpu: int | None = None):
        if gpu is not None:  # before anything touches CUDA, as an actor does
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        sys.setswitchinterval(GIL_SWITCH_S)  # its weight subscriber thread beside the engine, as in an actor
        self.cfg, self.model_path = cfg, model_path
        self.keys, self.r = Keys(run_id), connect(redis_url)
        self.evaluated = 0
        self.episodes = None   # with a multi-turn environment, the held-out samples are episodes
        if cfg.env.multi_turn:
            self.episodes = EpisodePlayer(cfg.env, cfg.env.episode_tokens(cfg.buffer))

    def run(self) -> int:
        t = self.cfg.trainer
        # the actors' engine settings (and their fixed KV cache size, when set), its own memory share
        a = dataclasses.replace(self.cfg.actors, engine="vllm", gpu_memory_utilization=t.val_gpu_memory_utilization)
        # no behavior logprobs: an evaluation scores text, and vLLM's sampler hook costs ~20% of its steps
        engine = build_engine(a, self.model_path, seed=t.val_seed, behavior_logprobs=False, lora=self.cfg.learner.lora)
        mark_startup(self.r, self.keys, "evaluator", "engine")
        _train, val = prompt_sources(self.cfg, engine.tokenizer)
        score = record_scorer(self.cfg.data.reward_options())
        weights = subscribe(self.r, self.keys, self.cfg, "evaluator")
        try:
            while not self.r.exists(self.keys.stop):
                if (new := weights.take()) is not None:
                    engine.load_weights(new.state_dict, new.version, new.checksum, verified=True)
                if not self._serve(engine, val, score):
                    weights.wait(POLL_S)
            return self.evaluated
        finally:
            weights.close()

    def _serve(self, engine, val, score) -> bool:
        """Answer the requests for the version the engine holds (and skip older ones); True if any."""
        from engines.evaluate import evaluate_prompts  # lazy: imports torch

        t, a = self.cfg.trainer, self.cfg.actors
        answered = False
        for v in sorted(int(x) for x in self.r.smembers(self.keys.val_requests)):
            if v > engine.version:
                break
            if v < engine.version:
                result = {"skipped": f"the evaluator already holds version {engine.version}"}
            else:
                t0 = time.monotonic()
                res = evaluate_prompts(engine, val, score, samples=t.val_samples, temperature=a.temperature,
                                       max_tokens=a.max_tokens, seed=t.val_seed, eos_logit_bias=a.eos_logit_bias,
                                       episodes=self.episodes)
                result = {**res, "eval_s": time.monotonic() - t0, "checksum": engine.checksum}
                self.evaluated += 1
                mark_startup(self.r, self.keys, "evaluator", "first_eval")
                log.info("held-out reward at version %d: %.4f (accuracy %.4f, %.2f s)", v, res["reward"],
                         res["accuracy"], result["eval_s"])
            pipe = self.r.pipeline()
            pipe.hset(self.keys.val_results, v, json.dumps(result))
            pipe.srem(self.keys.val_requests, v)
            pipe.execute()
            answered = True
        return answered
