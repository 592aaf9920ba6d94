"""The rollout actor process: lease prompts, generate, score, send, swap weights.

One loop on one thread owns the engine, so a weight swap can only happen between two
`generate` calls: every group is produced by a single version (version_start == version_end).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

import numpy as np

from actors.core import SamplingParams
from buffer.schema import Group, Limits, Sample
from data.tasks import token_ids

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.01        # wait between admission attempts when the buffer is full or prompts ran out
HEARTBEAT_S = 1.0         # how often the actor writes its status into the run's membership hash
STARTUP_WAIT_S = 60.0     # how long to wait for the ingest address and the weight backend in Redis


class RolloutWorker:
    def __init__(self, cfg, *, index: int, run_id: str, redis_url: str, model_path: str, gpu: int | None = None):
        if gpu is not None:  # before anything touches CUDA: this process then sees only its GPU, as cuda:0
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        import torch

        from buffer.store import Keys, Leaser, connect

        torch.set_num_threads(cfg.actors.torch_threads)
        self.cfg, self.index = cfg, index
        self.actor_id = f"actor-{index}"
        self.keys = Keys(run_id)
        self.r = connect(redis_url)
        self.model_path = model_path
        self.leaser = Leaser(self.r, self.keys, max_staleness=cfg.buffer.max_staleness,
                             groups_per_step=cfg.learner.groups_per_step, actor_id=self.actor_id)
        self.groups_sent = 0
        # actor i sends to ingest shard i % k (buffer.ingest_shards), announced as `address:<shard>`
        self.ingest_field = f"address:{index % cfg.buffer.ingest_shards}"
        # Versions that arrived while a batch was generating: they wait for the batch to end, so
        # the batch keeps one version (version_start == version_end); counted to show it happens.
        self.updates_mid_batch = 0

    def _ingest_address(self) -> str:
        deadline = time.monotonic() + STARTUP_WAIT_S
        while (addr := self.r.hget(self.keys.ingest, self.ingest_field)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.actor_id}: no ingest address in Redis after {STARTUP_WAIT_S}s")
            time.sleep(0.05)
        return addr.decode()

    def _heartbeat(self, engine) -> None:
        self.r.hset(self.keys.members, self.actor_id, json.dumps({
            "version": engine.version, "checksum": engine.checksum, "host": socket.gethostname(),
            "pid": os.getpid(), "engine": self.cfg.actors.engine, "groups": self.groups_sent,
            "updates_mid_batch": self.updates_mid_batch,
            "heartbeat": time.time()}))

    def run(self) -> int:
        from actors.core import build_engine
        from actors.rewards import record_scorer
        from actors.sender import ZmqTrajectorySink

        a = self.cfg.actors
        engine = build_engine(a, self.model_path, seed=a.seed + self.index)
        limits = Limits(vocab_size=engine.vocab_size, max_response_tokens=self.cfg.buffer.max_response_tokens,
                        max_message_bytes=self.cfg.buffer.max_message_bytes)
        self._ingest_address()  # wait for the first ingest; later ones (restarts) are followed
        sink = ZmqTrajectorySink(lambda: (self.r.hget(self.keys.ingest, self.ingest_field) or b"").decode(), limits,
                                 server_public=lambda: self.r.hget(self.keys.ingest, "curve_public"))
        weights = self._subscriber()
        reward_fn = record_scorer(self.cfg.data.reward_options())  # keyed by each prompt's data_source
        params = SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_tokens)
        import torch
        torch.manual_seed(a.seed + self.index)
        last_beat = 0.0
        try:
            while not self.r.exists(self.keys.stop) and not self.r.exists(self.keys.drain(self.actor_id)):
                _load_newest(weights, engine)
                if time.monotonic() - last_beat > HEARTBEAT_S:
                    self._heartbeat(engine)
                    last_beat = time.monotonic()
                leased = self.leaser.lease(a.groups_per_batch, engine.version)
                if leased is None:      # our weights are too old to be trained on: wait for the next version
                    weights.wait(0.1)
                    continue
                if not leased:
                    time.sleep(IDLE_POLL_S)
                    continue
                received = weights.received
                groups = self._rollout(engine, params, leased, reward_fn)
                self.updates_mid_batch += weights.received > received
                sink.send(groups)
                self.groups_sent += len(leased)
            # The job is over when the launcher sets stop after the learner returned (its publications
            # are synchronous, so none can count on us any more; closing below needs no quiet period)
            # or as it kills everything (close()). Otherwise we were drained from a running job.
            job_over = self.r.exists(self.keys.stop)
            if job_over:
                try:  # end on the newest weights received
                    _load_newest(weights, engine)
                except Exception as e:  # the run's result is the learner's; report, do not fail the drain
                    log.warning("%s: the last weight version could not be loaded: %s", self.actor_id, e)
            self._heartbeat(engine)
            if not job_over:
                weights.leave()  # serve any publication that still counts on us
            self._return_stray_leases()
            return self.groups_sent
        finally:
            weights.close()
            sink.close()

    def _subscriber(self):
        """The weight backend the learner announced in Redis (it decides from where it sits)."""
        deadline = time.monotonic() + STARTUP_WAIT_S
        while (backend := self.r.hget(self.keys.ws, "backend")) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.actor_id}: the learner announced no weight backend in {STARTUP_WAIT_S}s")
            time.sleep(0.05)
        timeout = self.cfg.weightsync.timeout_s
        if backend == b"cuda_ipc":
            from weightsync.cuda_ipc import CudaIpcSubscriber

            return CudaIpcSubscriber(self.r, self.keys, actor_id=self.actor_id, device=self.cfg.actors.device,
                                     timeout_s=timeout)
        if backend == b"nccl":
            from weightsync.nccl import NcclSubscriber

            return NcclSubscriber(self.r, self.keys, actor_id=self.actor_id, device=self.cfg.actors.device,
                                  timeout_s=timeout)
        from weightsync.gloo import GlooSubscriber

        return GlooSubscriber(self.r, self.keys, actor_id=self.actor_id, timeout_s=timeout)

    def _return_stray_leases(self) -> None:
        """Leases in our name that we never saw (a lease retried across a Redis restart whose first
        reply was lost) go back to the queue, so a clean exit leaves nothing in flight."""
        from buffer.store import reclaim_leases

        if n := reclaim_leases(self.r, self.keys, self.actor_id):
            log.warning("%s: returned %d leases it never received to the queue", self.actor_id, n)

    def _rollout(self, engine, params, leased, reward_fn) -> list[Group]:
        tok = engine.tokenizer
        t0 = time.time()
        # dataset prompts arrive tokenized (chat template applied by the learner); the built-in task as text
        prompts = [token_ids(p, tok) for _gid, p in leased]
        outs = engine.generate(prompts, params)
        groups = []
        for (gid, p), ids, comps in zip(leased, prompts, outs):
            samples = [Sample(response_ids=c.token_ids, behavior_logprobs=c.logprobs,
                              reward=float(reward_fn(p, tok.decode(c.token_ids, skip_special_tokens=True))),
                              finish_reason=c.finish_reason, version_start=engine.version,
                              version_end=engine.version) for c in comps]
            groups.append(Group(group_id=gid, prompt_id=p["prompt_id"], actor_id=self.actor_id,
                                prompt_ids=np.asarray(ids, dtype=np.int32), samples=samples, created_at=t0))
        return groups


def _load_newest(weights, engine) -> None:
    """The newest fully received weight version into the engine, if one arrived since the last call."""
    if (new := weights.take()) is not None:
        engine.load_weights(new.state_dict, new.version, new.checksum)
