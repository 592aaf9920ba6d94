"""The learner's checkpointer: DCP checkpoints every trainer.checkpoint_every steps and at the last, the
resume from the newest complete one, and when a step's groups are acked (after its optimizer step, or
with checkpoints only once a complete checkpoint covers it)."""
from __future__ import annotations

import logging
import os
import shutil
import time

import torch
import torch.distributed as dist

from learner.batches import BatchSource
from learner.config import TrainerConfig
from runbase import checkpoints

log = logging.getLogger(__name__)


def checkpoint_error(path: str, e: BaseException) -> RuntimeError:
    """A checkpoint that could not be written, named, with the free space where it goes (a full disk)."""
    try:
        free = f"{shutil.disk_usage(os.path.dirname(path)).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "free space unknown"
    cause = str(e).strip().splitlines()
    return RuntimeError(f"checkpoint {path} could not be written ({free}; trainer.checkpoint_every): "
                        f"{type(e).__name__}: {cause[-1] if cause else ''}".rstrip(": "))


class Checkpointer:
    def __init__(self, tc: TrainerConfig, *, model, opt, ppo, rank: int, group, run_dir: str,
                 batches: BatchSource, r=None, keys=None):
        """`ppo`: learner/ppo.py PPOExtras or None (its critic is saved beside the policy). `r`, `keys` on rank 0."""
        self.tc, self.model, self.opt, self.ppo = tc, model, opt, ppo
        self.rank, self.group, self.run_dir, self.batches, self.r, self.keys = rank, group, run_dir, batches, r, keys
        self.unacked: list = []  # entry ids trained since the last checkpoint (acked when it completes)

    def after_step(self, batch, version: int, *, last: bool) -> None:
        """Without checkpoints: ack after the optimizer step. With them: ack a step's groups only
        once a complete checkpoint covers it, so a crash never loses a step a resume cannot redo
        (the last step is always checkpointed, so nothing stays pending at the end)."""
        every = self.tc.checkpoint_every
        if not every:
            if self.rank == 0:
                self.batches.ack(batch.entry_ids)
            return
        if self.rank == 0:
            self.unacked += batch.entry_ids
        if version % every == 0 or last:
            self.save(version)
            if self.rank == 0:
                self.batches.ack(self.unacked)
                self.unacked = []
                # the groups of steps up to here are gone from Redis: a resume must start from this checkpoint
                self.r.set(self.keys.checkpointed, version)

    def save(self, step: int) -> None:
        """Collective: DCP shards of model + optimizer, each rank's RNG, then a COMPLETE marker."""
        path = str(checkpoints.folder(self.run_dir, step))
        self.write_shards(path)
        dist.barrier(group=self.group)
        if self.rank == 0:
            try:
                checkpoints.write_marker(path, {"step": step, "time": time.time(),
                                                **(self.ppo.scalar_state() if self.ppo else {})})
            except OSError as e:
                raise checkpoint_error(path, e) from e
            log.info("checkpoint of step %d complete: %s", step, path)
            for gone in checkpoints.prune(self.run_dir, self.tc.keep_checkpoints):
                log.info("checkpoint %s removed (trainer.keep_checkpoints=%d)", gone, self.tc.keep_checkpoints)

    def write_shards(self, path: str) -> None:
        """Collective: this rank's DCP shards of model + optimizer (and critic), and its RNG state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        try:
            dcp.save({"model": msd, "optim": osd, **self._critic_state()}, checkpoint_id=path)
            torch.save(torch.get_rng_state(), f"{path}/rng-rank{self.rank}.pt")
        except (Exception, dcp.api.CheckpointException) as e:  # (a BaseException) a full disk reads as
            raise checkpoint_error(path, e) from e              # "unexpected pos 704 vs 598" from torch's writer

    def resume(self) -> int:
        """Load the newest checkpoint with a COMPLETE marker; returns its step (0 if none)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        done = checkpoints.complete(self.run_dir)   # an empty or cut marker is passed over, with a warning
        if not done:
            log.warning("resume: no complete checkpoint in %s/checkpoints; starting at step 0", self.run_dir)
            return 0
        path = str(done[-1][1])
        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd, **self._critic_state()}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if "critic" in state:
            set_state_dict(self.ppo.critic, self.ppo.critic_opt, model_state_dict=state["critic"],
                           optim_state_dict=state["critic_optim"])
        rng = f"{path}/rng-rank{self.rank}.pt"
        if os.path.exists(rng):
            torch.set_rng_state(torch.load(rng, weights_only=True))  # a tensor: nothing to unpickle
        marker = checkpoints.read_marker(path)
        step = marker["step"]
        if self.ppo:
            self.ppo.load_scalar_state(marker)
        log.info("resumed from %s (step %d)", path, step)
        return step

    def _critic_state(self) -> dict:
        """The critic's DCP state (model and optimizer shards), saved and loaded beside the policy's;
        the reference is the frozen base model and needs none."""
        if self.ppo is None or self.ppo.critic is None:
            return {}
        from torch.distributed.checkpoint.state_dict import get_state_dict

        cmsd, cosd = get_state_dict(self.ppo.critic, self.ppo.critic_opt)
        return {"critic": cmsd, "critic_optim": cosd}
