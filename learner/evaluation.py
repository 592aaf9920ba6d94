"""The learner's held-out evaluation, one interface over its two engines (trainer.val_engine): `learner`
evaluates on rank 0's own HF engine inside the loop (the step waits); `vllm` asks the evaluator process
(actors/evaluator.py), which receives every version as an actor does, and logs its answers on the step they
arrive, waiting only for the first and the last. Each owns its cadence (trainer.val_every, val_every_s) and
the policy's Hugging Face form for exports."""
from __future__ import annotations

import json
import logging
import time

import torch

from engines.evaluate import evaluate_prompts
from engines.hf_engine import HFEngine  # transformers itself is imported when an engine is built
from engines.lora import apply_lora, enabled, load_adapter, published_state
from learner import metric_names as M
from learner.config import LearnerView
from learner.model import full_state_dict
from learner.phases import PhaseReport
from weightsync.flat import checksum

log = logging.getLogger(__name__)

EVALUATOR_WAIT_S = 900.0    # an evaluation the learner waits for (the first and the last): covers the
                            # evaluator's vLLM start-up (compilation, CUDA graphs) beside the actors'
EVALUATOR_POLL_S = 0.05    # the learner's look at the evaluator's answers while it waits for one (~0.5 s each)
ADAPTER_SUFFIX = "-adapter"  # with learner.lora, an export <out> has PEFT's adapter folder beside it: <out>-adapter


class Evaluation:
    """What both engines share: the cadence, the held-out accuracy per version, the metrics line's fields and
    the weights held for an export. Collective where it says so; results live on rank 0."""

    def __init__(self, view: LearnerView, *, model, rank: int, device: torch.device, model_path: str,
                 run_dir: str, report: PhaseReport, r=None, keys=None):
        self.view, self.tc, self.model, self.rank, self.device = view, view.trainer, model, rank, device
        self.model_path, self.run_dir, self.report, self.r, self.keys = model_path, run_dir, report, r, keys
        self.lora = view.learner.lora  # with a rank, a version (held, evaluated, exported) is the adapter
        self.accuracy: dict[int, float] = {}  # version -> share of held-out samples fully right (rank 0)
        self.held: int | None = None  # the version whose weights are held for an export (alike on every rank)
        self.clock = time.monotonic()  # when the last evaluation was asked for (trainer.val_every_s)
        self.val, self.score = [], None

    def held_out(self, val, score) -> None:
        """Rank 0: the held-out prompts and the job's scorer (built once the tokenizer is there)."""
        self.val, self.score = val, score

    def start_clock(self) -> None:
        """trainer.val_every_s counts from here (the first trained step)."""
        self.clock = time.monotonic()

    def clock_due(self) -> bool:
        """Rank 0, as a step starts: trainer.val_every_s has passed since the last evaluation was asked for."""
        every = self.tc.val_every_s
        return self.rank == 0 and bool(every) and time.monotonic() - self.clock >= every

    def evaluate_first(self, version: int):
        """Collective: the weights the run starts from (`version`), scored if trainer.val_before_train (the
        curve's baseline, waited for); None when not."""
        if not self.tc.val_before_train:
            return None
        self.report.phase("evaluate", version)
        return self.evaluate(version)

    def evaluate_if_due(self, version: int, *, timed: bool, last: bool):
        """Collective: `version` evaluated every trainer.val_every and at the `last` step (waited for), or when
        rank 0's clock said so (`timed`); the held-out reward if it is known now (rank 0), else None."""
        if not (self.tc.evaluates_at(version) or timed):
            return None
        self.clock = time.monotonic()
        self.report.phase("evaluate", version)
        return self.evaluate(version, wait=last)

    def evaluate(self, version: int, *, wait: bool = True):
        """Collective: the held-out reward of the learner's current weights (on rank 0), or None when it is not
        known yet (an evaluation elsewhere not waited for)."""
        raise NotImplementedError

    def line_fields(self, version: int, val, *, start: int | None = None, start_val=None) -> dict:
        """Rank 0: the evaluation fields of a step's metrics line: this step's own evaluation (`val` of
        `version`), else the newest result that arrived since the last line; on the run's first line also the
        evaluation before the first step (`start`, the version it was of, and `start_val`, its reward)."""
        start = start if start in self.accuracy else None   # trainer.val_before_train=false: no baseline
        extra = {M.VAL_REWARD_INITIAL: start_val} if start is not None else {}
        if val is not None:
            extra[M.VAL_REWARD] = val
            extra[M.VAL_ACCURACY] = self.accuracy[version]
        else:
            extra.update(self._arrived())
        if start is not None:
            extra[M.VAL_ACCURACY_INITIAL] = self.accuracy[start]
        return extra

    def _arrived(self) -> dict:
        """Results that came in since the last line, for a step without an evaluation of its own."""
        return {}

    def hold(self, version: int) -> bool:
        """Collective: the learner's current weights held on rank 0 for an evaluation or an export (once per
        version: an export right after an evaluation reuses them), as a version is published (the adapter
        alone with learner.lora); True on rank 0."""
        if self.held != version:
            sd = full_state_dict(self.model)
            if self.rank == 0:
                self._take(published_state(self.model, sd), version)
            self.held = version
        return self.rank == 0

    def _take(self, sd: dict, version: int) -> None:
        raise NotImplementedError

    def save_policy(self, out: str) -> str:
        """Rank 0: the held weights as a Hugging Face folder at `out` (save_pretrained), with the tokenizer."""
        raise NotImplementedError


class LocalEvaluation(Evaluation):
    """trainer.val_engine=learner: rank 0's own HF engine, loaded with each version it evaluates."""

    def __init__(self, view: LearnerView, **kw):
        super().__init__(view, **kw)
        self.policy_sd: dict | None = None  # the weights held for an export, where the engine rounds them
        if self.rank == 0:
            # in the engines' dtype: it evaluates the policy the actors serve, at their memory cost (bf16 on a GPU)
            self.engine = HFEngine(self.model_path, device=str(self.device), dtype=view.weightsync.dtype,
                                   lora=self.lora)
            self.tokenizer = self.engine.tokenizer
            self.episodes = view.episodes()

    def evaluate(self, version: int, *, wait: bool = True):
        if not self.hold(version):
            return None
        tc, v = self.tc, self.view
        res = evaluate_prompts(self.engine, self.val, self.score, samples=tc.val_samples, temperature=v.temperature,
                               max_tokens=v.max_tokens, seed=tc.val_seed, stop=v.stop, eos_logit_bias=v.eos_logit_bias,
                               episodes=self.episodes)
        if self.device.type == "cuda":  # the generation's KV cache back to the driver: engines beside us need it
            torch.cuda.empty_cache()
        val = res["reward"]
        self.accuracy[version] = res["accuracy"]
        # a publication's checksum (of the weights in weightsync.dtype, as the engines hold them) stands; this
        # engine's (the learner's own dtype) is the record only of a version nobody was sent (the initial one)
        self.r.hsetnx(self.keys.checksums, version, self.engine.checksum)
        self.r.hset(self.keys.val, version, val)
        log.info("held-out reward at version %d: %.4f (accuracy %.4f)", version, val, res["accuracy"])
        return val

    def _take(self, sd: dict, version: int) -> None:
        self.engine.load_weights(sd, version, checksum(sd))
        # an engine in a lower dtype than the learner's weights rounds them: an export keeps the learner's own;
        # an adapter is kept whatever its dtype (small): the export merges it into a base model of its own
        lower = any(t.is_floating_point() and t.dtype != self.engine.model.dtype for t in sd.values())
        self.policy_sd = sd if lower or enabled(self.lora) else None

    def save_policy(self, out: str) -> str:
        if self.policy_sd is not None:
            return export_state_dict(self.model_path, self.policy_sd, self.tokenizer, out, lora=self.lora)
        self.engine.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        log.info("policy exported to %s", out)
        return out


class RemoteEvaluation(Evaluation):
    """trainer.val_engine=vllm: the evaluator process, asked through Redis (`<run>:val:requests`), answering
    in `<run>:val:results` once it holds the version asked for (or `skipped` once it holds a newer one)."""

    def __init__(self, view: LearnerView, **kw):
        super().__init__(view, **kw)
        self.pending: set[int] = set()       # versions asked of the evaluator, not answered yet
        self.reward: dict[int, float] = {}   # version -> held-out reward (evaluator results)
        self.arrived: dict[int, dict] = {}   # evaluator results not yet on a metrics line
        self.policy_sd: dict | None = None   # the weights held for an export (no HF engine here)
        if self.rank == 0:
            from transformers import AutoTokenizer  # lazy: the learner's only use of it without its own engine

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)

    def evaluate(self, version: int, *, wait: bool = True):
        """Ask the evaluator for `version`; with `wait`, its held-out reward (rank 0)."""
        if self.rank != 0:
            return None
        self.r.sadd(self.keys.val_requests, version)
        self.pending.add(version)
        deadline = time.monotonic() + EVALUATOR_WAIT_S
        while wait and version in self.pending:  # (other answers arriving meanwhile stay in `arrived`)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the evaluator did not evaluate version {version} in {EVALUATOR_WAIT_S:.0f} s "
                                   f"(its log: {self.run_dir}/logs/evaluator.log)")
            if not self._collect():
                time.sleep(EVALUATOR_POLL_S)
        if not wait:
            return None
        self.arrived.pop(version, None)  # returned here, so logged as this step's own evaluation
        return self.reward.get(version)

    def _collect(self) -> dict:
        """Rank 0: the evaluator's answers to pending requests, recorded as the learner's own would be."""
        arrived = {}
        for v in sorted(self.pending):
            if (raw := self.r.hget(self.keys.val_results, v)) is None:
                continue
            self.pending.discard(v)
            res = json.loads(raw)
            if "skipped" in res:
                log.warning("held-out evaluation of version %d skipped: %s", v, res["skipped"])
                continue
            self.reward[v], self.accuracy[v] = res["reward"], res["accuracy"]
            self.r.hset(self.keys.val, v, res["reward"])
            self.r.hsetnx(self.keys.checksums, v, res["checksum"])  # as the learner's own evaluation does
            arrived[v] = res
        self.arrived.update(arrived)
        return arrived

    def _arrived(self) -> dict:
        """The newest answer since the last line (all are in <run>:val), with the version it is of."""
        self._collect()
        if not self.arrived:
            return {}
        v = max(self.arrived)
        res, self.arrived = self.arrived[v], {}
        return {M.VAL_REWARD: res["reward"], M.VAL_ACCURACY: res["accuracy"], M.VAL_VERSION: v,
                M.VAL_EVAL_S: res["eval_s"], M.VAL_LEN_MEAN: res.get("len_mean"), M.VAL_LEN_MAX: res.get("len_max")}

    def _take(self, sd: dict, version: int) -> None:
        self.policy_sd = sd

    def save_policy(self, out: str) -> str:
        return export_state_dict(self.model_path, self.policy_sd, self.tokenizer, out, lora=self.lora)


def export_state_dict(model_path: str, sd: dict, tokenizer, out: str, lora=None) -> str:
    """The base model's folder with the learner's weights `sd` loaded into it, in their own dtype. With `lora`
    (learner.lora) `sd` is the adapter: written as PEFT's adapter folder beside `out` (<out>-adapter) and merged
    into the base, so `out` is a plain model folder that transformers (and vLLM) load without PEFT."""
    from transformers import AutoModelForCausalLM  # lazy: only an export builds a model here

    dtype = next(t.dtype for t in sd.values() if t.is_floating_point())
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if enabled(lora):
        model = merged(model, sd, lora, out + ADAPTER_SUFFIX)
    else:
        model.load_state_dict(sd)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info("policy exported to %s", out)
    return out


def merged(model, adapter: dict, lora, adapter_dir: str):
    """`model` with the `adapter` (PEFT's names) merged into its weights; the adapter is saved to `adapter_dir`
    first (PEFT's save_pretrained: loadable with PeftModel.from_pretrained over the base)."""
    peft = apply_lora(model, lora)
    load_adapter(peft, adapter)
    peft.save_pretrained(adapter_dir)
    log.info("adapter exported to %s", adapter_dir)
    return peft.merge_and_unload()


def build_evaluation(view: LearnerView, **kw) -> Evaluation:
    """The evaluation trainer.val_engine names (keywords: Evaluation's)."""
    return (LocalEvaluation if view.trainer.val_engine == "learner" else RemoteEvaluation)(view, **kw)
