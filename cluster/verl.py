"""verl's command-line knobs, translated: the part of the alias table that is more than a rename.

`cluster.config.ALIASES` renames keys one to one (`actor_rollout_ref.rollout.n` -> `actors.n`). This
module handles the rest, before and after the YAML/override merge:

- keys whose value needs translating (`loss_agg_mode=token-mean`, `save_freq=-1`, a single
  `data.train_files` path) or that set two keys (`clip_ratio`), or combine (`n_gpus_per_node x nnodes`);
- keys that need the loaded config (`trainer.total_epochs` needs the dataset size,
  `ppo_mini_batch_size` must equal the step batch);
- keys accepted and ignored because they mean nothing in this system (IGNORED, with the reason);
- every other verl-only key fails at start, naming it.

docs/verl.md lists every key handled here and in ALIASES.
"""
from __future__ import annotations

import logging
import math

from runbase.configload import ConfigError, parse_override

log = logging.getLogger(__name__)

VERL_GPUS_PER_NODE, VERL_NNODES = 8, 1  # verl's defaults, for whichever of the pair is not given

# Top-level sections that exist only in verl: a key under them that is neither an alias, translated
# nor ignored is a knob we cannot honour, and must not pass silently.
VERL_ONLY_SECTIONS = ("actor_rollout_ref.", "reward_model.", "custom_reward_function.", "ray_init.")

IGNORED = {
    "actor_rollout_ref.rollout.micro_batch_size_per_gpu":
        "verl recomputes old log-probs in a separate pass; here actors return behavior log-probs with the samples",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu":
        "verl recomputes old log-probs in a separate pass; here actors return behavior log-probs with the samples",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size":
        "verl recomputes old log-probs in a separate pass; here actors return behavior log-probs with the samples",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz":
        "verl recomputes old log-probs in a separate pass; here actors return behavior log-probs with the samples",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu":
        "the reference runs inside the learner step, on the policy's micro-batches",
    "actor_rollout_ref.ref.log_prob_micro_batch_size":
        "the reference runs inside the learner step, on the policy's micro-batches",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz":
        "the reference runs inside the learner step, on the policy's micro-batches",
    "actor_rollout_ref.hybrid_engine": "actors and learners are separate processes by design",
    "actor_rollout_ref.model.use_remove_padding":
        "packing is learner.pack_sequences, off unless set: with sdpa attention a packed micro-batch attends "
        "through a dense block mask (it pays off with flash-attention or flex_attention)",
    "actor_rollout_ref.actor.strategy": "the learner is FSDP2 (fsdp/fsdp2 accepted; megatron is an error)",
    "critic.strategy": "the critic is FSDP2 (fsdp/fsdp2 accepted; megatron is an error)",
}

LOSS_AGG = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean"}
MUST_BE = {  # verl knobs accepted at the one value this system implements
    "actor_rollout_ref.actor.ppo_epochs": (1, "the policy takes one optimizer step per batch (staleness, "
                                              "not reuse, is how samples are spent); critic.ppo_epochs is supported"),
    "trainer.critic_warmup": (0, "the critic and the policy are updated from the first step"),
    # in verl's own example scripts at these values (they were refused as keys with no equivalent)
    "reward_model.enable": (False, "rewards are rule-based functions chosen by data_source, or your own "
                                   "(data.reward_fn_path, verl's custom_reward_function.path); no reward model"),
    "actor_rollout_ref.actor.entropy_coeff": (0, "the policy loss has no entropy bonus"),
}
MINI_BATCH_KEYS = ("actor_rollout_ref.actor.ppo_mini_batch_size", "critic.ppo_mini_batch_size")


class Deferred:
    """What can only be resolved on the loaded config."""

    def __init__(self):
        self.total_epochs: int | None = None
        self.steps_given = False
        self.mini_batch: dict[str, int] = {}


def translate(overrides, aliases: dict[str, str]) -> tuple[list[str], Deferred]:
    """Rewrite verl-only overrides into ours; returns (overrides for the loader, deferred checks).

    Renames in `aliases` are left to the loader. Expansions that set defaults for more specific keys
    (`clip_ratio` for `clip_ratio_low/high`) go first, so the specific key wins wherever it appears.
    """
    first, out, deferred = [], [], Deferred()
    gpus = nodes = None
    for text in overrides:
        key, value = parse_override(text)
        if aliases.get(key, key) == "trainer.total_steps":
            deferred.steps_given = True  # verl: total_training_steps wins over total_epochs
            out.append(text)
        elif key in aliases:
            out.append(text)
        elif key in IGNORED:
            if key.endswith(".strategy") and value not in ("fsdp", "fsdp2"):
                raise ConfigError(key, f"only fsdp/fsdp2 is available here, got {value!r}")
            log.warning("config key '%s' accepted and ignored: %s", key, IGNORED[key])
        elif key in MUST_BE:
            want, why = MUST_BE[key]
            if value != want:
                raise ConfigError(key, f"only {want!r} is supported: {why}")
        elif key == "actor_rollout_ref.actor.clip_ratio":
            first += [f"learner.clip_low={value}", f"learner.clip_high={value}"]
        elif key == "actor_rollout_ref.actor.loss_agg_mode":
            if value not in LOSS_AGG:
                raise ConfigError(key, f"supported: {', '.join(LOSS_AGG)} (learner.loss_norm), got {value!r}")
            out.append(f"learner.loss_norm={LOSS_AGG[value]}")
        elif key in ("trainer.save_freq", "trainer.test_freq"):
            ours = {"trainer.save_freq": "trainer.checkpoint_every", "trainer.test_freq": "trainer.val_every"}[key]
            if type(value) is not int:
                raise ConfigError(key, f"expected int, got {value!r}")
            out.append(f"{ours}={max(value, 0)}")  # verl's -1 (never) is our 0
        elif key == "trainer.max_actor_ckpt_to_keep":  # verl: null keeps all, as our 0 does
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(key, f"expected null or an int >= 1, got {value!r}")
            out.append(f"trainer.keep_checkpoints={value or 0}")
        elif key in ("data.train_files", "data.val_files", "trainer.logger") and isinstance(value, str):
            out.append(f"{key}=[{value!r}]")  # verl takes one name or a list; ours is always a list
        elif key == "trainer.n_gpus_per_node":
            gpus = _positive_int(key, value)
        elif key == "trainer.nnodes":
            nodes = _positive_int(key, value)
        elif key == "trainer.total_epochs":
            deferred.total_epochs = _positive_int(key, value)
        elif key in MINI_BATCH_KEYS:
            deferred.mini_batch[key] = _positive_int(key, value)
        elif key.startswith(VERL_ONLY_SECTIONS):
            raise ConfigError(key, "a verl key with no equivalent here (docs/verl.md lists the verl keys "
                              "that are accepted and what they map to)")
        else:
            out.append(text)
    if gpus is not None or nodes is not None:  # verl: every GPU trains; here they are the learner group
        first.append(f"cluster.learners={(gpus or VERL_GPUS_PER_NODE) * (nodes or VERL_NNODES)}")
    return first + out, deferred


def _positive_int(key: str, value) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(key, f"expected an int >= 1, got {value!r}")
    return value


def dataset_rows(files: list[str]) -> int:
    """Rows of the training parquet files (footer metadata only)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def resolve(cfg, deferred: Deferred) -> list[str]:
    """Checks and extra overrides that need the loaded config (empty when nothing is deferred)."""
    for key, mini in deferred.mini_batch.items():
        if mini != cfg.learner.groups_per_step:
            raise ConfigError(key, f"{mini} != data.train_batch_size (learner.groups_per_step = "
                              f"{cfg.learner.groups_per_step}): here every batch gets exactly one optimizer "
                              f"step; for verl's {cfg.learner.groups_per_step}/{mini} updates per rollout batch, "
                              f"set data.train_batch_size={mini} and max_staleness >= "
                              f"{max(math.ceil(cfg.learner.groups_per_step / mini) - 1, 0)}")
    if deferred.total_epochs is None or deferred.steps_given:
        return []
    if not cfg.data.train_files:
        raise ConfigError("trainer.total_epochs", "needs data.train_files: the built-in task generates prompts "
                          "without end, so it has no epochs; set trainer.total_steps instead")
    rows = dataset_rows(cfg.data.train_files)
    steps = max(1, math.ceil(deferred.total_epochs * rows / cfg.learner.groups_per_step))
    log.info("trainer.total_epochs=%d over %d training rows at %d groups per step: trainer.total_steps=%d",
             deferred.total_epochs, rows, cfg.learner.groups_per_step, steps)
    return [f"trainer.total_steps={steps}"]
