"""The root configuration: one dataclass per component, nested, loaded from YAML + overrides."""
from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from actors.config import ActorConfig
from buffer.config import BufferConfig
from cluster.verl import resolve, translate
from data.dataset import DataConfig
from data.tasks import TaskConfig
from envs.config import EpisodesConfig
from learner.config import AlgorithmConfig, CriticConfig, LearnerConfig, ModelConfig, TrainerConfig
from runbase.configload import ConfigError, load
from weightsync.config import WeightSyncConfig

RUN_ID_MAX = 100   # a run id prefixes every Redis key and may name a folder: short enough for any file system
RUN_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{RUN_ID_MAX - 1}}}")   # no '/', no '..': it stays one folder
DEFAULT_YAML = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

# Names users know from verl (and our short forms) mapped to our keys.
ALIASES = {
    "max_staleness": "buffer.max_staleness",
    "data.train_batch_size": "learner.groups_per_step",
    "actor_rollout_ref.actor.optim.lr": "learner.lr",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "learner.micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.n": "actors.n",
    "actor_rollout_ref.rollout.temperature": "actors.temperature",
    "actor_rollout_ref.model.path": "model.path",
    "trainer.total_training_steps": "trainer.total_steps",
    "custom_reward_function.path": "data.reward_fn_path",
    "custom_reward_function.name": "data.reward_fn_name",
    # the rest of verl's main_ppo knobs that mean the same here (docs/verl.md;
    # knobs that need more than a rename are in cluster/verl.py)
    "data.max_response_length": "actors.max_tokens",
    "actor_rollout_ref.rollout.name": "actors.engine",
    "actor_rollout_ref.rollout.top_p": "actors.top_p",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "actors.gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "actors.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.enforce_eager": "actors.enforce_eager",
    "actor_rollout_ref.rollout.max_model_len": "actors.max_model_len",
    "actor_rollout_ref.rollout.val_kwargs.n": "trainer.val_samples",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "learner.activation_checkpointing",
    "actor_rollout_ref.model.lora_rank": "learner.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "learner.lora.alpha",
    "actor_rollout_ref.model.target_modules": "learner.lora.target_modules",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "learner.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "learner.optimizer_offload",
    "actor_rollout_ref.actor.use_dynamic_bsz": "learner.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "learner.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.clip_ratio_low": "learner.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "learner.clip_high",
    "actor_rollout_ref.actor.grad_clip": "learner.grad_clip",
    "actor_rollout_ref.actor.optim.weight_decay": "learner.weight_decay",
    "actor_rollout_ref.actor.use_kl_loss": "learner.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "learner.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "learner.kl_loss_type",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "learner.ref_param_offload",
    "algorithm.norm_adv_by_std_in_grpo": "learner.scale_adv_by_std",
    "critic.optim.lr": "critic.lr",
    "critic.optim.weight_decay": "critic.weight_decay",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size_per_gpu",
    "critic.ppo_max_token_len_per_gpu": "critic.max_tokens_per_micro_batch",
    "critic.model.path": "critic.model_path",
    "critic.model.fsdp_config.param_offload": "critic.param_offload",
    "critic.model.fsdp_config.optimizer_offload": "critic.optimizer_offload",
    "critic.model.enable_gradient_checkpointing": "critic.activation_checkpointing",
    "trainer.default_local_dir": "cluster.run_dir",
    "ray_init.num_cpus": "cluster.num_cpus",
}


# learner.lora.target_modules the vLLM engine refuses: vLLM puts LoRA layers on the output head and the input
# embeddings of few model families (not Qwen2's, the built-in models'), where its adapter load then fails
VLLM_UNSERVED_LORA = frozenset({"lm_head", "embed_tokens"})
# cluster.actor_silent_s's default: 30 missed beats of an actor's weight-sync thread, far past any CPU starvation
# of a healthy actor on a loaded machine.
ACTOR_SILENT_S = 15.0


@dataclass(kw_only=True)
class ClusterConfig:
    actors: int = 2
    """Number of rollout actor processes."""
    learners: int = 1
    """Number of learner ranks (one process each, one torch.distributed group)."""
    redis_url: str = ""
    """Redis to use; empty = start a local server (AOF on, loopback only) in the run directory."""
    address: str = ""
    """Ray cluster address (`auto` or host:port); empty = start a local Ray."""
    run_dir: str = ""
    """Where outputs go; empty = runs/<run_id>."""
    run_id: str = ""
    """Namespace of this run's Redis keys; empty = generated from the time. Letters, digits, '.', '_', '-'."""
    num_cpus: int = 0
    """CPUs Ray may schedule on (0 = this machine's count)."""
    resume: bool = False
    """Continue the job in run_dir (same run id and Redis data) from its last complete checkpoint."""
    max_restarts: int = 3
    """How often a rollout actor, the ingest, or the local Redis server is restarted after dying
    (each counted separately; Ray restarts the process). The learner group is not restarted: its
    failure fails the job, and `--resume` continues from the last checkpoint."""
    actor_silent_s: float = ACTOR_SILENT_S
    """A rollout actor whose weight-sync thread (it beats every 0.5 s, whatever the engine is doing) has been
    silent this long is stopped or hung: it is killed and handled like a dead one (restarted within
    max_restarts, its leases returned first). Shorter notices a hung actor sooner; too short kills a healthy one
    starved of CPU for that long."""
    actor_stall_s: float = 600.0
    """A rollout actor whose loop has not come round for this long (a reward function or an engine call that
    hangs, while its weight-sync thread still beats) is killed and restarted as a silent one is, its threads'
    stacks at the stall written to logs/<role>.log first; 0 = never. Longer than any one engine step, weight
    swap or scoring of a group."""
    learner_stall_s: float = 600.0
    """The learner spending this long in one phase other than waiting for groups (a step, a publication, an
    evaluation, a checkpoint, an export, its close, reading recorded batches: a held-out reward function or a file
    system that hangs, a stopped process) is reported by the launcher, naming the phase and the weights' version,
    with learner rank 0's stacks written to logs/learner-0.log (not by a stopped process); the job goes on (the
    learner is not restarted: stop it and `--resume` if it is stuck); 0 = never. Longer than any one evaluation
    or checkpoint save of the model."""
    redis_fsync: Literal["always", "everysec"] = "always"
    """AOF fsync policy of the local Redis: `always` makes every acked group survive a server crash;
    `everysec` is faster and may lose the last second of writes."""
    bind_host: str = "auto"
    """Interface the local Redis, the ingest(s), the learner rendezvous and the weight-sync store listen
    on and announce: `auto` = 127.0.0.1 on a one-node Ray, each node's routable IP
    (`ray.util.get_node_ip_address()`) on several; `node` = always the node IP; or an address. Anything
    but 127.0.0.1/localhost requires authentication (Redis password, ZeroMQ CURVE) unless `insecure`."""
    insecure: bool = False
    """Let Redis and the ingest listen off loopback WITHOUT authentication (a warning is printed).
    Only for networks nobody else can reach."""
    placement: Literal["auto", "local", "groups"] = "auto"
    """`groups`: learners in one Ray placement group (a bundle each, `learner_strategy`), actors in
    another (`actor_strategy`), ingests on the launcher's node or `ingest_resources`; `local`: every
    process is free-floating with no resources (one machine); `auto` = `groups` with `address` set."""
    learner_resources: dict[str, float] = field(default_factory=dict)
    """One learner bundle; empty = {GPU: 1} when learners use CUDA, else {CPU: 1}."""
    learner_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the learner bundles: PACK fills nodes one by one (NCCL stays
    intra-node as far as possible); STRICT_PACK requires a single node."""
    actor_resources: dict[str, float] = field(default_factory=dict)
    """One actor bundle; empty = {GPU: actors.tensor_model_parallel_size} when actors use CUDA, else {CPU: 1}."""
    actor_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "SPREAD"
    """Placement-group strategy of the actor bundles: SPREAD puts them on as many nodes as it can."""
    ingest_resources: dict[str, float] = field(default_factory=dict)
    """Ray resources each ingest requires (e.g. a custom {ingest_host: 0.01}) to put it on given hosts;
    empty = on the launcher's node (the head, where the local Redis runs)."""
    dashboard: bool = False
    """Start Ray's dashboard with the local Ray (`address` empty) on 127.0.0.1:`dashboard_port` and print
    its address. Needs `pip install -e '.[dashboard]'` (ray[default]); off by default: it adds processes
    and a few seconds of start-up. A cluster joined with `address` serves its own dashboard."""
    dashboard_port: int = 8265
    """Port of that dashboard (Ray's default); a port in use stops the start, naming it."""
    profile: bool = False
    """Diagnostics: run each process's main thread (learner ranks, actors, evaluator, ingest) under
    cProfile and write `<run_dir>/profiles/<role>.txt` (top functions by own and cumulative time) and
    `.prof` (for pstats/snakeviz) when it ends (returns or fails; a restarted role's last process wins).
    Costs a few percent of host time."""

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", "must be >= 0")
        for name in ("actor_stall_s", "learner_stall_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(name, f"seconds >= 0 (0: never), got {getattr(self, name)}")
        if not self.actor_silent_s > 0:
            raise ConfigError("actor_silent_s", f"seconds > 0, got {self.actor_silent_s}")
        if self.actors < 0:
            raise ConfigError("actors", "must be >= 0 (0 only with buffer.replay_dir)")
        if self.learners < 1:
            raise ConfigError("learners", "must be >= 1")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("redis_url", f"expected redis://HOST:PORT/DB (or rediss://, unix://), got {self.redis_url!r}")
        if self.redis_url.startswith(("redis://", "rediss://")):
            try:  # as redis-py reads it: a port out of range fails there with a bare ValueError
                urllib.parse.urlsplit(self.redis_url).port
            except ValueError as e:
                raise ConfigError("redis_url", f"{self.redis_url!r}: {e}") from None
        if self.run_id and not RUN_ID.fullmatch(self.run_id):
            raise ConfigError("run_id", f"{self.run_id!r}: 1-{RUN_ID_MAX} letters, digits, '.', '_' or '-', the first "
                              "a letter or digit (it names Redis keys and, without cluster.run_dir, the folder "
                              "runs/<run_id>)")
        if self.num_cpus < 0:
            raise ConfigError("num_cpus", "must be >= 0 (0: Ray counts the machine's)")
        if self.dashboard and self.address:
            raise ConfigError("dashboard", "starts the dashboard of a local Ray; the cluster at cluster.address "
                              "serves its own (its address is printed at start)")
        if not 0 < self.dashboard_port < 65536:
            raise ConfigError("dashboard_port", f"expected a TCP port (1-65535), got {self.dashboard_port}")
        if not self.bind_host or any(c.isspace() for c in self.bind_host):
            raise ConfigError("bind_host", f"expected auto, node or an address, got {self.bind_host!r}")
        for name in ("learner_resources", "actor_resources", "ingest_resources"):
            bad = {k: v for k, v in getattr(self, name).items() if v < 0}
            if bad:
                raise ConfigError(name, f"resource amounts must be >= 0, got {bad}")


@dataclass(kw_only=True)
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Processes and where they run."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts, answers and the held-out set of the built-in task (used while data.train_files is empty)."""
    data: DataConfig = field(default_factory=DataConfig)
    """verl-schema parquet datasets (train/val files, chat template, over-long prompts, reward options)."""
    actors: ActorConfig = field(default_factory=ActorConfig)
    """Rollout actors and sampling."""
    env: EpisodesConfig = field(default_factory=EpisodesConfig)
    """Multi-turn episodes: the environment that answers each assistant turn (none: single-turn)."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """Ingest and the staleness rule."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Optimisation."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator (grpo, gae, reinforce_pp) and the in-reward KL penalty."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (used with algorithm.adv_estimator=gae)."""
    weightsync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weight publication."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Length of the run and evaluation."""

    def __post_init__(self):
        import importlib.util  # the standard library's; no vLLM import (it takes seconds)

        self.actors.resolve_engine(importlib.util.find_spec("vllm") is not None)
        if self.weightsync.dtype == "auto":  # resolved once here: every process reads the same dtype
            self.weightsync.dtype = self.actors.dtype
        if self.cluster.actors == 0 and not self.buffer.replay_dir:
            raise ConfigError("cluster.actors", "must be >= 1 (0 only when replaying: buffer.replay_dir)")
        if self.algorithm.adv_estimator == "grpo" and self.actors.n < 2:
            raise ConfigError("actors.n", "GRPO needs at least 2 samples per prompt: its baseline is the group's "
                              "mean (algorithm.adv_estimator=gae or reinforce_pp take 1)")
        rows = self.learner.groups_per_step * self.actors.n
        if rows % self.cluster.learners:
            raise ConfigError("learner.groups_per_step", f"groups_per_step x actors.n = {rows} rows must split "
                              f"equally over cluster.learners = {self.cluster.learners} ranks")
        if not self.data.train_files and self.task.num_val_prompts < 1:  # the job's held-out set is the task's
            raise ConfigError("task.num_val_prompts", "must be >= 1: the held-out evaluation (step 0, every "
                              "trainer.val_every steps, the last step) scores them")
        a = self.actors
        if a.max_model_len and self.data.train_files and a.max_model_len < self.data.max_prompt_length + a.max_tokens:
            raise ConfigError("actors.max_model_len", f"{a.max_model_len} cannot hold a prompt of "
                              f"data.max_prompt_length ({self.data.max_prompt_length}) and actors.max_tokens "
                              f"({a.max_tokens}): answers would be cut short (0: the model's own limit)")
        if self.buffer.max_response_tokens < self.actors.max_tokens:  # an actor's full-length answer: refused
            raise ConfigError("buffer.max_response_tokens", f"must be >= actors.max_tokens ({self.actors.max_tokens})"
                              ": the actors' own answers would be refused")
        if self.env.max_episode_tokens > self.buffer.max_response_tokens:
            raise ConfigError("env.max_episode_tokens", f"{self.env.max_episode_tokens} is more than the buffer takes "
                              f"(buffer.max_response_tokens = {self.buffer.max_response_tokens})")
        self._check_lora()
        if self.buffer.max_staleness < self.weightsync.sync_every - 1:
            raise ConfigError("buffer.max_staleness", "must be >= weightsync.sync_every - 1, or actors can never "
                              "hold a version fresh enough to be trained on")

    def _check_lora(self) -> None:
        """An adapter the vLLM engine cannot serve is refused before any process starts (an actor or evaluator
        would fail on it at each restart)."""
        lora = self.learner.lora
        vllm_users = [k for k, on in (("actors.engine", self.actors.engine == "vllm"),
                                      ("trainer.val_engine", self.trainer.val_engine == "vllm")) if on]
        if not lora.rank or not vllm_users or not isinstance(lora.target_modules, list):
            return   # `all-linear`: the decoder's linear layers, every one of which vLLM serves
        unserved = sorted(set(lora.target_modules) & VLLM_UNSERVED_LORA)
        if unserved:
            raise ConfigError("learner.lora.target_modules", f"{vllm_users[0]}=vllm serves adapters on the "
                              f"decoder's linear layers, not on {unserved} (vLLM has no LoRA layer there for most "
                              f"model families, Qwen2 among them): drop {unserved} from {lora.target_modules}, or use "
                              f"{vllm_users[0]}={'hf' if vllm_users[0] == 'actors.engine' else 'learner'}")


def load_config(config_file: str | None = None, overrides=()) -> Config:
    overrides, deferred = translate(overrides, ALIASES)  # verl knobs beyond plain renames
    cfg = load(Config, DEFAULT_YAML, config_file, overrides, aliases=ALIASES)
    extra = resolve(cfg, deferred)  # e.g. trainer.total_epochs -> total_steps from the dataset size
    return load(Config, DEFAULT_YAML, config_file, [*overrides, *extra], aliases=ALIASES) if extra else cfg
