"""Learner and model configuration."""
from __future__ import annotations

from envs.config import EpisodesConfig
from envs.episode import EpisodePlayer
from dataclasses import dataclass, field
from typing import Literal

from data.tiny_model import BUILTIN_PREFIX
from learner import loggers
from runbase.configload import ConfigError, local_path
from weightsync.backends import BACKENDS
from weightsync.config import WeightSyncConfig


def check_optimizer(weight_decay: float, grad_clip: float) -> None:
    """Invariants shared by the policy's and the critic's optimizer keys."""
    if weight_decay < 0:
        raise ConfigError("weight_decay", "must be >= 0 (AdamW refuses a negative decay)")
    if grad_clip < 0:  # a negative max norm flips every gradient: training would climb the loss
        raise ConfigError("grad_clip", "must be >= 0 (0 = no clipping)")


@dataclass(kw_only=True)
class ModelConfig:
    path: str = "builtin:tiny-reverse"
    """A local Hugging Face model folder (`~` expanded, relative to the launcher's directory), or
    `builtin:tiny-reverse` (built and cached offline)."""

    def __post_init__(self):
        if not self.path.startswith(BUILTIN_PREFIX):
            self.path = local_path(self.path)   # loaded by every learner and actor, in their own cwd


@dataclass(kw_only=True)
class LoraConfig:
    """learner.lora: train a LoRA adapter (PEFT) on the frozen base model instead of every weight. The learner
    publishes only the adapter's tensors and the engines serve the base with it (HF; vLLM on the linear layers)."""

    rank: int = 0
    """The adapter's rank r (verl: actor_rollout_ref.model.lora_rank); 0 = off, every weight trains."""
    alpha: float = 16.0
    """LoRA's scale numerator: the update is (alpha / rank) x B A (verl: lora_alpha, default 16)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while the learner trains (engines never drop): above 0 the learner's
    logprobs are noisier than the behavior policy's, so RL usually keeps it 0."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Modules that get an adapter: PEFT's names (e.g. [q_proj, v_proj]) or `all-linear`, every linear layer but
    the output head (verl: target_modules). Name the head (lm_head) in a list to give it one too (with dropout 0):
    the answers' sharpness lives in the head, and the embedded job's gain triples with it (docs/tuning.md)."""

    def __post_init__(self):
        if self.rank < 0:
            raise ConfigError("rank", f"must be >= 0 (0: off), got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError("alpha", f"must be > 0 (it scales the adapter's update), got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, list) and (not self.target_modules or not all(self.target_modules)):
            raise ConfigError("target_modules", f"a non-empty list of module names or `all-linear`, "
                                                f"got {self.target_modules!r}")


@dataclass(kw_only=True)
class LearnerConfig:
    lr: float = 1e-3
    """AdamW learning rate (0 freezes the policy: the control run)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Max global grad norm (0 = no clipping)."""
    groups_per_step: int = 8
    """Prompt groups per optimizer step (verl: data.train_batch_size)."""
    micro_batch_size_per_gpu: int = 32
    """Rows per forward/backward on one rank; gradients accumulate over micro-batches."""
    clip_low: float = 0.2
    """PPO clip: ratio lower bound is 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip: ratio upper bound is 1 + clip_high."""
    correction: Literal["ppo_clip", "decoupled", "tis", "none"] = "ppo_clip"
    """Off-policy correction (learner/losses.py): `ppo_clip` on the ratio to the behavior policy;
    `decoupled` PPO (clip to the learner's pre-update policy, behavior->proximal weight capped at
    `decoupled_cap`); `tis` truncated importance sampling (weight capped at `tis_cap`); `none`
    plain policy gradient (assumes on-policy samples)."""
    decoupled_cap: float = 5.0
    """Decoupled PPO: truncation of the behavior->proximal importance weight (AReaL's default)."""
    tis_cap: float = 2.0
    """Truncated IS: cap of the importance weight pi/pi_behavior (verl's TIS default)."""
    loss_norm: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    """How the summed loss is normalised; always by counts over the whole step batch."""
    scale_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group std."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of forward/backward compute (FSDP2 mixed precision); master weights, optimizer state
    and gradient reduction stay float32. `bfloat16` is what GPUs run fast."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the learner's own weights, their gradients and AdamW's state. `bfloat16` halves what a
    model needs (8 instead of 16 bytes a parameter: a 7B model's 122 GB becomes 61 GB, which one host holds
    with `param_offload`), at the price of updates below bf16's resolution (~1/256 of a weight) being lost;
    needs param_dtype bfloat16. Checkpoints hold the weights in this dtype."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them."""
    compile: Literal["off", "inductor", "aot_eager"] = "off"
    """torch.compile each decoder layer of the policy (backend name): fused norms, rotary embeddings
    and activations, for GPU throughput. The first steps compile (a minute or more on a large model);
    `aot_eager` compiles nothing to kernels (a check of the plumbing)."""
    param_offload: bool = False
    """FSDP2 CPUOffloadPolicy: the sharded fp32 parameters and their gradients live in CPU memory and
    each layer is copied to the device only while it computes; the optimizer then steps on CPU, so
    its state is in CPU memory too (whatever `optimizer_offload` says). Saves params + grads +
    Adam state (16 bytes/parameter) of device memory, costs host<->device copies every step."""
    optimizer_offload: bool = False
    """Keep the AdamW state (8 bytes/parameter) in CPU memory between optimizer steps, moved to the
    device for the step only (verl's optimizer_offload): lowers the peak of forward/backward, which no
    longer shares the device with the optimizer state. Implied by `param_offload`."""
    use_dynamic_bsz: bool = False
    """Micro-batches by a token budget (`max_tokens_per_micro_batch`) instead of a row count; every
    rank still runs the same number of micro-batches (the largest any rank needs)."""
    max_tokens_per_micro_batch: int = 16384
    """With use_dynamic_bsz: padded tokens (rows x longest row) per micro-batch on one rank
    (verl: ppo_max_token_len_per_gpu). A longer single row still trains, alone."""
    use_kl_loss: bool = False
    """Add kl_loss_coef x KL(pi || pi_ref) to the policy loss (a frozen copy of the initial policy is
    kept in the learner group as the reference)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term (verl's default)."""
    kl_loss_type: Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator of the loss term (learner/advantages.py kl_penalty)."""
    ref_param_offload: bool = False
    """Keep the reference policy's shards in CPU memory (FSDP2 CPUOffloadPolicy); it only runs forward."""
    pack_sequences: bool = False
    """Micro-batches without padding: rows back to back in one sequence, attention kept within each
    row (learner/batching.py collate; verl: use_remove_padding). With use_dynamic_bsz, the token
    budget then counts real tokens. Pays off with an attention that skips other rows' blocks
    (attn_implementation flex_attention or flash_attention_2); sdpa attends through a dense mask."""
    pack_multiple: int = 0
    """With pack_sequences: round every packed micro-batch's length up to a multiple of this many
    tokens (a masked filler sequence). flex_attention is compiled per sequence length; without this
    every micro-batch has a new length and recompiles (1024 wastes < 1024 tokens per micro-batch).
    0: exact lengths."""
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2", "varlen"] = "sdpa"
    """transformers attention of the learner's models (policy, reference, critic). flex_attention
    trains on CUDA only (no CPU backward); flash_attention_2 needs the flash-attn package; `varlen`
    (needs pack_sequences) is torch's own variable-length flash attention over packed rows, no mask and
    no padding (learner/attention.py; row-by-row SDPA on CPU)."""
    kernels: Literal["none", "liger", "liger_head"] = "none"
    """Fused kernels: `liger` (liger-kernel, Triton, GPU only) swaps in its RMSNorm, SwiGLU and rotary
    embedding and computes the logprob head by its fused linear cross-entropy (no vocabulary logits);
    `liger_head` only the head, for layers compiled by `compile` (Inductor fuses the rest itself)."""
    plain_one_rank: bool = False
    """With one learner rank: train the plain module (fp32 weights, autocast to param_dtype) instead of
    wrapping it in FSDP2, whose per-layer hooks and copies a single rank does not need."""
    plain_compute: Literal["autocast", "shadow"] = "autocast"
    """How the plain one-rank module computes in a param_dtype below float32: `autocast` runs the fp32 module
    under autocast (a cast per weight and activation, every forward and backward: measured as the learner's
    largest host cost inside the SmolLM2 run); `shadow` runs forward and backward on a param_dtype copy of
    the weights without autocast (as FSDP's mixed precision computes), its gradients copied to the fp32
    weights, which the optimizer steps and the checkpoint, publication and evaluation read as before."""
    logprob_chunk_tokens: int = 2048
    """Response tokens per chunk of the output head's logprob computation (learner/model.py
    response_logprobs: only response tokens, fp32 logits one chunk at a time, recomputed in
    backward; 2048 x a 152k vocabulary is 1.2 GB of fp32 logits). 0: plain logits over the batch."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: cuda when available, else cpu (the process-group backend follows: nccl/gloo)."""
    torch_threads: int = 1
    """Intra-op threads per learner process on CPU."""
    seed: int = 0
    """Seed of the learner's RNG."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """A LoRA adapter instead of full fine-tuning (rank 0: off)."""

    def __post_init__(self):
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", "two numbers in [0, 1)")
        if self.lr < 0:
            raise ConfigError("lr", "must be >= 0")
        check_optimizer(self.weight_decay, self.grad_clip)
        if self.groups_per_step < 1:
            raise ConfigError("groups_per_step", "must be >= 1")
        if self.micro_batch_size_per_gpu < 1:
            raise ConfigError("micro_batch_size_per_gpu", "must be >= 1")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError("clip_low", "need 0 <= clip_low < 1 and clip_high >= 0")
        # a cap below 1 would down-weight even exactly on-policy tokens (weight 1)
        if self.decoupled_cap < 1:
            raise ConfigError("decoupled_cap", "must be >= 1")
        if self.tis_cap < 1:
            raise ConfigError("tis_cap", "must be >= 1")
        if self.max_tokens_per_micro_batch < 1:
            raise ConfigError("max_tokens_per_micro_batch", "must be >= 1")
        if self.kl_loss_coef < 0:
            raise ConfigError("kl_loss_coef", "must be >= 0")
        if self.pack_multiple < 0 or (self.pack_multiple and not self.pack_sequences):
            raise ConfigError("pack_multiple", "must be >= 0, and only applies with pack_sequences=true")
        if self.attn_implementation == "flex_attention" and self.device == "cpu":
            raise ConfigError("attn_implementation", "flex_attention has no backward on CPU; use sdpa there")
        if self.attn_implementation == "varlen" and not self.pack_sequences:
            raise ConfigError("attn_implementation", "varlen attends packed rows: set learner.pack_sequences=true")
        if self.kernels != "none" and self.device == "cpu":
            raise ConfigError("kernels", "liger's kernels are Triton (GPU only); use kernels=none on CPU")
        if self.logprob_chunk_tokens < 0:
            raise ConfigError("logprob_chunk_tokens", "must be >= 0 (0: plain logits)")
        if self.master_dtype == "bfloat16" and (self.param_dtype != "bfloat16" or self.plain_compute == "shadow"):
            raise ConfigError("master_dtype", "bfloat16 weights compute in bfloat16: set learner.param_dtype=bfloat16 "
                              "(and learner.plain_compute=autocast: there is no lower copy to shadow them with)")
        if self.plain_compute == "shadow" and not (self.plain_one_rank and self.param_dtype != "float32"):
            raise ConfigError("plain_compute", "shadow is the plain one-rank path computing below float32: set "
                                               "learner.plain_one_rank=true and learner.param_dtype=bfloat16")

    def on_cuda(self, gpu_present: bool) -> bool:
        """Whether the learner computes on CUDA: `device: cuda`, or `auto` where a GPU is present."""
        return self.device == "cuda" or (self.device == "auto" and gpu_present)


@dataclass(kw_only=True)
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """`fixed` keeps kl_coef; `adaptive` moves it towards target_kl (Ziegler et al.; verl's kl_ctrl)."""
    kl_coef: float = 0.001
    """KL-in-reward coefficient (the initial one when adaptive)."""
    target_kl: float = 0.1
    """adaptive: the KL per token the coefficient steers towards."""
    horizon: int = 10000
    """adaptive: samples over which a 20% correction of the coefficient is spread."""

    def __post_init__(self):
        if self.kl_coef < 0:
            raise ConfigError("kl_coef", "must be >= 0")
        if self.target_kl <= 0 or self.horizon < 1:
            raise ConfigError("target_kl", "target_kl > 0 and horizon >= 1")


@dataclass(kw_only=True)
class AlgorithmConfig:
    adv_estimator: Literal["grpo", "gae", "reinforce_pp"] = "grpo"
    """`grpo`: group-relative outcome advantages (no critic); `gae`: PPO with a critic (critic.*) and
    generalised advantage estimation over response tokens; `reinforce_pp`: REINFORCE++, discounted
    token returns whitened over the batch (no critic). Advantages of gae/reinforce_pp are computed at
    learn time (values from the current critic), so they hold under any staleness."""
    gamma: float = 1.0
    """Discount over response tokens (gae, reinforce_pp)."""
    lam: float = 1.0
    """GAE lambda (1 = Monte-Carlo returns minus the value baseline)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef x KL(behavior || ref) per token from the token rewards (gae,
    reinforce_pp); the KL is estimated with `kl_penalty`."""
    kl_penalty: Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"] = "kl"
    """KL estimator of the in-reward penalty (learner/advantages.py kl_penalty)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient of the in-reward KL penalty."""

    def __post_init__(self):
        if not 0 <= self.gamma <= 1:
            raise ConfigError("gamma", "must be in [0, 1]")
        if not 0 <= self.lam <= 1:
            raise ConfigError("lam", "must be in [0, 1]")
        if self.use_kl_in_reward and self.adv_estimator == "grpo":
            raise ConfigError("use_kl_in_reward", "token-level KL rewards need adv_estimator gae or reinforce_pp; "
                              "with grpo use learner.use_kl_loss (actor_rollout_ref.actor.use_kl_loss)")


@dataclass(kw_only=True)
class CriticConfig:
    model_path: str = ""
    """The value model's starting weights (a causal-LM folder: backbone loaded, a scalar head added; `~` expanded,
    relative to the launcher's directory); empty = the policy's model.path. Used only with
    algorithm.adv_estimator=gae."""
    lr: float = 1e-3
    """AdamW learning rate of the critic (verl's default is 1e-5, for real models)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the critic."""
    grad_clip: float = 1.0
    """Max global grad norm of the critic (0 = no clipping)."""
    cliprange_value: float = 0.5
    """Value clipping: the new value may move at most this far from the learn-time value before the
    loss stops rewarding it (binds from the second critic epoch on; see ppo_epochs)."""
    ppo_epochs: int = 1
    """Critic optimizer steps on each batch (the policy always takes one)."""
    micro_batch_size_per_gpu: int = 32
    """Rows per critic forward/backward on one rank."""
    max_tokens_per_micro_batch: int = 0
    """With learner.use_dynamic_bsz: the critic's token budget per micro-batch (0 = twice the policy's,
    as verl: no vocabulary-sized logits)."""
    param_offload: bool = False
    """As learner.param_offload, for the critic."""
    optimizer_offload: bool = False
    """As learner.optimizer_offload, for the critic."""
    activation_checkpointing: bool = False
    """As learner.activation_checkpointing, for the critic."""

    def __post_init__(self):
        self.model_path = local_path(self.model_path)   # loaded by the learner, in its own cwd
        if self.lr < 0:
            raise ConfigError("lr", "must be >= 0")
        check_optimizer(self.weight_decay, self.grad_clip)
        if self.cliprange_value <= 0:
            raise ConfigError("cliprange_value", "must be > 0")
        if self.ppo_epochs < 1:
            raise ConfigError("ppo_epochs", "must be >= 1")
        if self.micro_batch_size_per_gpu < 1:
            raise ConfigError("micro_batch_size_per_gpu", "must be >= 1")
        if self.max_tokens_per_micro_batch < 0:
            raise ConfigError("max_tokens_per_micro_batch", "must be >= 0 (0 = twice learner's)")


@dataclass(kw_only=True)
class TrainerConfig:
    total_steps: int = 100
    """Optimizer steps to run before the job exits 0."""
    val_every: int = 0
    """Evaluate the held-out set every this many steps (0 = only at step 0 and at the end)."""
    val_every_s: float = 0.0
    """Also evaluate the weights of the first step that starts this many seconds (wall clock, counted from
    the first trained step) after the last evaluation was asked for; 0: off. A cadence in seconds, as peers
    that evaluate by time use (bench/trl_vllm.py: every 15 s of training), so accuracy-against-time curves
    have comparable points; with trainer.val_engine=vllm the evaluation costs the learner nothing."""
    val_samples: int = 4
    """Samples per held-out prompt; sampling settings and seed are fixed across evaluations."""
    val_seed: int = 4321
    """Seed of held-out sampling, so the same weights always score the same."""
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    """Where metrics go besides metrics.jsonl (verl's key; learner/loggers.py): `console` (verl's
    `step:N - key:value` line per step in the learner's log), `tensorboard` (<run_dir>/tb), `wandb`
    (<run_dir>/wandb; WANDB_MODE=offline needs no account), `mlflow` (MLFLOW_TRACKING_URI or <run_dir>/mlruns)."""
    tensorboard: bool | None = None
    """The older switch, kept as an alias: true adds `tensorboard` to `logger`, false removes it; once
    loaded it says whether `logger` has it."""
    project_name: str = "asyncrl"
    """verl's key: the wandb project, the MLflow experiment."""
    experiment_name: str = ""
    """verl's key: the run's name in wandb and MLflow; empty = the run id."""
    checkpoint_every: int = 0
    """Save a DCP checkpoint (model, optimizer, RNG, step) every this many steps (0 = never). With
    checkpoints, trained groups are acked only once a checkpoint covering them is complete, so a
    learner crash loses no step that a resume could not redo."""
    keep_checkpoints: int = 0
    """Keep only this many newest complete checkpoints, removing older ones (and unfinished saves) once a new
    one is complete (verl's `trainer.max_actor_ckpt_to_keep`); 0 = keep all. A checkpoint holds the fp32
    weights and both Adam moments (12 bytes a parameter: 1.6 GB for a 135M model), so a long run fills a
    disk without it."""
    record_batches: bool = False
    """Write every step's batch (the validated payloads, as trained) to <run_dir>/batches, so a
    later run can replay it (`buffer.replay_dir`): debugging, resume-parity checks, ablations."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last]: the learner's loop iterations first..last (whole iterations: batch, step,
    publication, log line) run under torch.profiler; a summary (kernel time against wall time, top
    operators) and a Chrome trace go to <run_dir>/profiles/ (learner/profiling.py). [] = none."""
    val_before_train: bool = True
    """Score the held-out set with the weights the run starts from (step 0, or a resumed run's first), the
    baseline of its curve (verl: trainer.val_before_train). false: the first evaluation is the first one due
    (val_every, val_every_s, the last step), and launch -> first step holds no held-out generation (minutes for
    a random model's long answers on the learner's HF engine)."""
    val_engine: Literal["learner", "vllm"] = "learner"
    """Where held-out evaluation runs. `learner`: on rank 0's HF engine inside the learner's loop (the
    step waits). `vllm`: in a process of its own (actors/evaluator.py) with a vLLM engine that receives
    every version as an actor does; the learner asks for an evaluation and logs the result on the step
    it arrives (`val/version` says which version it is of), waiting only for the final one."""
    val_gpu_memory_utilization: float = 0.1
    """With val_engine=vllm on a GPU: the evaluator engine's share of GPU memory."""
    export_hf: bool = True
    """At the end, save the final policy with `save_pretrained` to <run_dir>/policy (loadable by
    transformers and vLLM)."""

    def evaluates_at(self, version: int) -> bool:
        """The held-out cadence after training starts: every val_every-th version and the last one (the
        base model, version 0 or a resumed run's first, is evaluated before the first step)."""
        return version > 0 and (version == self.total_steps or bool(self.val_every and version % self.val_every == 0))

    def __post_init__(self):
        if self.total_steps < 1:
            raise ConfigError("total_steps", "must be >= 1")
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every", "must be >= 0")
        if self.keep_checkpoints < 0:
            raise ConfigError("keep_checkpoints", f"must be >= 0 (0: keep all), got {self.keep_checkpoints}")
        if self.profile_steps and not (len(self.profile_steps) == 2 and 0 <= self.profile_steps[0] <= self.profile_steps[1]):
            raise ConfigError("profile_steps", f"[first, last] with 0 <= first <= last, or [] (got {self.profile_steps})")
        if self.val_every < 0:
            raise ConfigError("val_every", f"must be >= 0 (0: only the first and last versions), got {self.val_every}")
        if self.val_samples < 1:
            raise ConfigError("val_samples", f"must be >= 1 (answers scored per held-out prompt), "
                                             f"got {self.val_samples}")
        if not self.val_every_s >= 0:
            raise ConfigError("val_every_s", f"seconds >= 0 (0: off), got {self.val_every_s}")
        if not 0 < self.val_gpu_memory_utilization <= 1:
            raise ConfigError("val_gpu_memory_utilization", "must be in (0, 1]")
        if self.tensorboard and "tensorboard" not in self.logger:
            self.logger = [*self.logger, "tensorboard"]
        elif self.tensorboard is False:
            self.logger = [n for n in self.logger if n != "tensorboard"]
        self.logger = list(dict.fromkeys(self.logger))  # each sink once, in the order given
        self.tensorboard = "tensorboard" in self.logger
        loggers.check(self.logger)  # an unknown sink, or one whose package is missing, names trainer.logger


@dataclass(frozen=True, kw_only=True)
class LearnerView:
    """What a learner process reads of the job's root configuration, taken once as it starts (`of`): its
    own sections, and the few keys of the actors', the buffer's and the cluster's sections it needs."""

    learner: LearnerConfig
    """learner.*: optimisation."""
    trainer: TrainerConfig
    """trainer.*: the run's length, evaluation, checkpoints, exports."""
    weightsync: WeightSyncConfig
    """weightsync.*, resolved: `backend` a transport's name (the launcher resolves `auto` once for every
    process, weightsync/backends.py; a learner built elsewhere is handed it resolved by its builder) and
    `dtype` the engines' (the root configuration resolves `auto`)."""
    temperature: float
    """actors.temperature: the behavior policy's; the learner's logprobs and its held-out sampling use it."""
    max_tokens: int
    """actors.max_tokens: the longest held-out answer."""
    stop: tuple[str, ...] = ()
    """actors.stop: the held-out answers on the learner's own engine end at these strings, as the actors' do."""
    eos_logit_bias: float = 0.0
    """actors.eos_logit_bias: part of the policy, in the learner's logprobs and its held-out sampling alike."""
    max_staleness: int
    """buffer.max_staleness: the sampler's hard filter, and the prompts kept queued for admission."""
    replay_dir: str = ""
    """buffer.replay_dir: train on recorded batches instead of the buffer ("" = the buffer)."""
    deadletter_maxlen: int
    """buffer.deadletter_maxlen: the cap of the dead-letter stream the sampler writes to."""
    resume: bool = False
    """cluster.resume: start from the newest complete checkpoint in the run directory."""
    stall_s: float = 0.0
    """cluster.learner_stall_s: rank 0 arms a stack dump when a phase of its loop lasts this long (0: off)."""
    bind_host: str = "127.0.0.1"
    """cluster.bind_host as the launcher resolved it: where the weight-sync store listens."""
    env: EpisodesConfig | None = None
    """env.* (envs/config.py EpisodesConfig): with a multi-turn environment the held-out samples are episodes."""
    episode_tokens: int = 0
    """The response tokens a held-out episode may hold (env.max_episode_tokens or buffer.max_response_tokens)."""

    def episodes(self):
        """The held-out evaluation's episode player, or None for single-turn samples."""
        if self.env is None or not self.env.multi_turn:
            return None
        return EpisodePlayer(self.env, self.episode_tokens)

    @classmethod
    def of(cls, cfg) -> "LearnerView":
        """The view of the root configuration `cfg` (cluster/config.py Config)."""
        a, b, c = cfg.actors, cfg.buffer, cfg.cluster
        return cls(learner=cfg.learner, trainer=cfg.trainer, weightsync=cfg.weightsync, temperature=a.temperature,
                   max_tokens=a.max_tokens, stop=tuple(a.stop), eos_logit_bias=a.eos_logit_bias,
                   max_staleness=b.max_staleness,
                   replay_dir=b.replay_dir, deadletter_maxlen=b.deadletter_maxlen, resume=c.resume,
                   stall_s=c.learner_stall_s, bind_host=c.bind_host, env=cfg.env,
                   episode_tokens=cfg.env.episode_tokens(b))

    def __post_init__(self):
        if self.weightsync.backend not in BACKENDS:
            raise ConfigError("weightsync.backend", f"a learner takes a resolved transport ({', '.join(BACKENDS)}), "
                              f"got {self.weightsync.backend!r}: its launcher or builder resolves `auto` "
                              "(weightsync/backends.py resolve)")
        if self.weightsync.dtype == "auto":
            raise ConfigError("weightsync.dtype", "a learner takes the engines' dtype, resolved by the root "
                              "configuration (auto = actors.dtype)")
        if self.temperature <= 0 or self.max_tokens < 1 or self.max_staleness < 0 or self.stall_s < 0:
            raise ConfigError("learner view", f"temperature > 0, max_tokens >= 1, max_staleness >= 0 and "
                              f"learner_stall_s >= 0, got {self.temperature}, {self.max_tokens}, "
                              f"{self.max_staleness}, {self.stall_s}")
