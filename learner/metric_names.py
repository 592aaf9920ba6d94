"""The one table of metric names: every key of a metrics line, as metrics.jsonl, the Redis `metrics` key,
TensorBoard, wandb and MLflow get it (learner/metrics.py feeds them all from one dict).

Names are `group/name`, so TensorBoard and wandb show one section per group; only `step`, every sink's
x axis, has no group. Writers (learner/train.py, learner/ppo.py, experiments/sync.py) and readers
(bench, experiments, cluster.progress/status, tests) use the constants below, never string literals.
Runs written before the names had groups are read through `read_metrics`/`upgrade` (OLD_NAMES).
No torch here: the launcher and the benchmarks' readers import it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Metric:
    name: str
    """The key on a metrics line."""
    meaning: str
    """One line: what the value is (docs/metrics.md's table shows it)."""
    old: str | None
    """The key runs written before namespacing used for it (None: new since)."""

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0] if "/" in self.name else ""

    def __post_init__(self):
        if self.name != STEP_NAME and self.group not in GROUPS:
            raise ValueError(f"metric {self.name!r}: its group is not one of {', '.join(GROUPS)}")


STEP_NAME = "step"
# group -> what its metrics are about (docs/metrics.md lists them in this order)
GROUPS = {
    "train": "the policy update: rewards and responses of the batch, loss, gradients, KL",
    "critic": "the value model (algorithm.adv_estimator=gae)",
    "mismatch": "behavior (engine) vs learner logprobs of the trained tokens",
    "staleness": "how many versions old the trained samples were, and what was dropped for it",
    "val": "held-out evaluation",
    "weights": "the weight publication to the actors (weightsync)",
    "perf": "wall-clock times and rates",
    "actors": "generation, where the learner's line measures it (the synchronous baseline)",
}
TABLE: dict[str, Metric] = {}


def _m(name: str, meaning: str, old: str | None = None) -> str:
    if name in TABLE:
        raise ValueError(f"metric {name!r} defined twice")
    TABLE[name] = Metric(name, meaning, old)
    return name


STEP = _m(STEP_NAME, "the learner step the line is of (0-based; the sinks' x axis)", "step")

VERSION = _m("train/version", "the weights' version after the step (step + 1; a skipped step: unchanged)", "version")
REWARD_MEAN = _m("train/reward_mean", "mean reward of the batch's samples", "reward_mean")
SAMPLES = _m("train/samples", "samples (responses) trained on", "samples")
GROUPS_TRAINED = _m("train/groups", "the group ids trained on (a list: metrics.jsonl only)", "groups")
RESPONSE_LEN_MEAN = _m("train/response_len_mean", "mean response length (tokens)", "response_len_mean")
RESPONSE_LEN_MAX = _m("train/response_len_max", "longest response (tokens)", "response_len_max")
MODEL_TOKEN_FRAC = _m("train/model_token_frac", "share of the response tokens the model sampled, the ones trained on "
                      "(below 1: multi-turn samples' environment tokens)")
LOSS_NORM = _m("train/loss_norm", "learner.loss_norm, the loss aggregation (a string)", "loss_norm")
LOSS = _m("train/loss", "the policy loss", "loss")
CLIP_FRAC = _m("train/clip_frac", "share of response tokens whose ratio was clipped", "clip_frac")
GRAD_NORM = _m("train/grad_norm", "the policy's gradient norm before clipping", "grad_norm")
MICRO_BATCHES = _m("train/micro_batches", "micro-batches per rank (learner.use_dynamic_bsz)", "micro_batches")
KL_REF = _m("train/kl_ref", "KL of the policy from the reference, per token (with a reference model)", "kl_ref")
KL_IN_REWARD = _m("train/kl_in_reward", "the KL penalty in the reward (algorithm.use_kl_in_reward)", "kl_in_reward")
KL_COEF = _m("train/kl_coef", "the KL controller's coefficient that step", "kl_coef")
SKIPPED = _m("train/skipped", "1 on the line of a step skipped for a non-finite loss or grad norm", "skipped")
SKIP_REASON = _m("train/skip_reason", "why the step was skipped (a string)", "skip_reason")
DEAD_LETTERED = _m("train/dead_lettered", "groups of the skipped step sent to the dead-letter stream", "dead_lettered")
MODE = _m("train/mode", "`sync` on the synchronous baseline's lines (experiments/sync.py)", "mode")

VF_LOSS = _m("critic/vf_loss", "the clipped value loss, mean over critic.ppo_epochs", "vf_loss")
VF_CLIPFRAC = _m("critic/vf_clipfrac", "share of tokens whose value was clipped", "vf_clipfrac")
CRITIC_GRAD_NORM = _m("critic/grad_norm", "the critic's gradient norm (first epoch)", "critic_grad_norm")
VALUES_MEAN = _m("critic/values_mean", "mean value estimate per token", "values_mean")
RETURNS_MEAN = _m("critic/returns_mean", "mean return per token", "returns_mean")

MISMATCH_ABS = _m("mismatch/abs", "mean absolute difference of learner and behavior logprobs per token", "mismatch_abs")
MISMATCH_KL = _m("mismatch/kl", "k3 estimate of the KL of behavior from learner, per token", "mismatch_kl")
FRESH_TOKENS = _m("mismatch/fresh_tokens", "tokens of staleness-0 rows (same weights on both sides)", "fresh_tokens")
ENGINE_MISMATCH_ABS = _m("mismatch/engine_abs", "mismatch/abs over staleness-0 rows: the engine's numerical noise",
                         "engine_mismatch_abs")
ENGINE_MISMATCH_KL = _m("mismatch/engine_kl", "mismatch/kl over staleness-0 rows", "engine_mismatch_kl")

STALENESS_MEAN = _m("staleness/mean", "mean staleness of the trained samples (versions)", "staleness_mean")
STALENESS_MAX = _m("staleness/max", "largest staleness trained on", "staleness_max")
STALENESS_HIST = _m("staleness/hist", "samples per staleness 0..buffer.max_staleness (a list)", "staleness_hist")
DROPPED_STALE = _m("staleness/dropped", "groups dropped as too stale while this batch was sampled", "dropped_stale")
ABORTED_STALE = _m("staleness/aborted_in_flight", "groups actors aborted in flight as too stale to be trained, "
                   "counted as stale drops (actors.abort_stale; total so far in the run)")
VERSION_START_MIN = _m("staleness/version_start_min", "oldest weights version a trained group started under",
                       "version_start_min")
VERSION_END_MAX = _m("staleness/version_end_max", "newest weights version a trained group ended under",
                     "version_end_max")
MIXED_VERSION_GROUPS = _m("staleness/mixed_version_groups", "groups whose generation spanned a weight update",
                          "mixed_version_groups")

VAL_REWARD = _m("val/reward", "held-out mean reward (after an evaluation)", "val_reward")
VAL_REWARD_INITIAL = _m("val/reward_initial", "held-out mean reward before the first step (first line)",
                        "val_reward_initial")
VAL_ACCURACY = _m("val/accuracy", "share of held-out samples scoring 1", "val/accuracy")
VAL_ACCURACY_INITIAL = _m("val/accuracy_initial", "val/accuracy before the first step (first line)",
                          "val/accuracy_initial")
VAL_VERSION = _m("val/version", "the version an evaluator's result is of (trainer.val_engine=vllm)", "val/version")
VAL_EVAL_S = _m("val/eval_s", "the evaluator's own time for that evaluation", "val_eval_s")
VAL_LEN_MEAN = _m("val/response_len_mean", "mean held-out response length in tokens (the evaluator's)")
VAL_LEN_MAX = _m("val/response_len_max", "longest held-out response in tokens: the decode steps an evaluation takes")

WS_PUBLISH_S = _m("weights/publish_s", "the last publication's time: gather, send, every member's ack",
                  "ws_publish_s")
WS_ACKS_S = _m("weights/acks_s", "of weights/publish_s, the wait for the members once every bucket was handed over")
WS_MEMBERS = _m("weights/members", "members the last publication went to", "ws_members")
WS_EPOCH = _m("weights/epoch", "the weight-sync group's membership epoch", "ws_epoch")
WS_JOINS = _m("weights/joins", "versions the join server sent to members that joined late", "ws_joins")
# a publisher's `stats` (weightsync/core.py) -> their names on the learner's line
WS_BYTES = _m("weights/bytes", "bytes of one published version as it travels (weightsync.dtype)")
WS_DIGEST_S = _m("weights/digest_s", "of weights/acks_s, the publisher's wait for its own fingerprints of the "
                 "version (cuda_ipc: the trailer waits for them)")
PUBLISHER_STATS = {"publish_s": WS_PUBLISH_S, "acks_s": WS_ACKS_S, "members": WS_MEMBERS, "epoch": WS_EPOCH, "bytes": WS_BYTES,
                   "digest_s": WS_DIGEST_S}

SAMPLES_PER_S = _m("perf/samples_per_s", "samples trained per wall second since the last line", "samples_per_s")
TOKENS_PER_S = _m("perf/tokens_per_s", "tokens (prompt + response) trained per wall second", "tokens_per_s")
WAIT_S = _m("perf/wait_s", "the learner's wait for the batch (the sync baseline: its generation)", "wait_s")
TRAIN_S = _m("perf/train_s", "scatter, forward/backward and optimizer step", "train_s")
PUBLISH_S = _m("perf/publish_s", "the learner's wait on the publication (0: none that step)", "publish_s")
EVAL_S = _m("perf/eval_s", "the learner's wait on evaluation", "eval_s")
READ_S = _m("perf/read_s", "reading the step's batch from the buffer: perf/wait_s plus decoding (and recording)")
OTHER_S = _m("perf/other_s", "the rest of the step's wall time: control flags, prompt feeding, metrics, acks")
TIME = _m("perf/time", "wall-clock time the line was written (unix seconds)", "time")

GEN_S = _m("actors/gen_s", "the sync baseline's generation time for the step", "gen_s")
GEN_BATCHES = _m("actors/gen_batches", "per generate call: [seconds, decode steps, rows] (a list)", "gen_batches")

OLD_NAMES = {m.old: m.name for m in TABLE.values() if m.old is not None and m.old != m.name}


def upgrade(line: dict) -> dict:
    """A metrics line with its pre-namespacing keys renamed (a line with the new names is unchanged)."""
    return {OLD_NAMES.get(k, k): v for k, v in line.items()}


def json_lines(path) -> list[dict]:
    """The JSON objects of a .jsonl file, one a line. A last line that does not parse is one being written and
    is left out; a bad line before it, or a line that is not an object, is an error naming the line."""
    path = Path(path)
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    out = []
    for i, raw in enumerate(lines):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object (a {type(obj).__name__})")
        out.append(obj)
    return out


def read_metrics(path, *, skipped: bool = False) -> list[dict]:
    """The lines of a metrics.jsonl (old or new names) with the new names (json_lines: a half-written last line
    left out). Lines of skipped steps (train/skipped: nothing applied, no step metrics) only with `skipped`."""
    out = [upgrade(m) for m in json_lines(path)]
    return out if skipped else [m for m in out if not m.get(SKIPPED)]


def require(lines: list[dict], keys) -> None:
    """ValueError naming the first line without one of `keys`: a file that is not a learner's metrics.jsonl (a
    tool reading it would fail on a bare KeyError, after printing part of its answer)."""
    if bad := next(((i, k) for i, m in enumerate(lines) for k in keys if k not in m), None):
        raise ValueError(f"line {bad[0] + 1} has no {bad[1]!r}: not a learner's metrics.jsonl")


def superseded_dropped(lines: list[dict]) -> list[dict]:
    """The lines of the steps that count in a resumed run's metrics: each learner incarnation starts with a line
    carrying `val/reward_initial`, and a resumed one redoes the steps from its checkpoint on, superseding the
    earlier incarnation's lines of those steps (tests/chaos/ledger.py `counted_steps` counts them the same way)."""
    out: list[dict] = []
    for i, m in enumerate(lines):
        if i and VAL_REWARD_INITIAL in m and STEP in m:
            out = [c for c in out if c.get(STEP, -1) < m[STEP]]
        out.append(m)
    return out


def step_start(m: dict) -> float:
    """When a line's step began: its time less its wait for groups and its training."""
    return m[TIME] - m.get(WAIT_S, 0) - m.get(TRAIN_S, 0)


def downtime(lines: list[dict]) -> list[float]:
    """Per line (superseded_dropped's), the seconds before it that no learner incarnation trained: from the last
    line kept before a resumed incarnation's first one (it carries `val/reward_initial`) to that step's start,
    i.e. the crash, the restart and the redone steps' first try, summed over the resumes so far."""
    down, out = 0.0, []
    for i, m in enumerate(lines):
        if i and VAL_REWARD_INITIAL in m:
            down += max(step_start(m) - lines[i - 1][TIME], 0.0)
        out.append(down)
    return out


def markdown() -> str:
    """docs/metrics.md's table, one row per metric, grouped (a test keeps the page equal to it)."""
    rows = ["| name | meaning |", "|---|---|", f"| `{STEP}` | {TABLE[STEP].meaning} |"]
    for g, about in GROUPS.items():
        rows.append(f"| **{g}/** | {about} |")
        rows += [f"| `{m.name}` | {m.meaning} |" for m in TABLE.values() if m.group == g]
    return "\n".join(rows)
