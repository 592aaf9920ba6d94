"""Hugging Face transformers engine (CPU or GPU): batched sampling with behavior logprobs.

Version swaps are atomic for generation by construction: the rollout loop calls
`load_weights` only between `generate` calls on the same thread, and the subscriber hands
over fully received buffers (a double buffer: the next version lands in fresh memory while
the current one keeps generating).
"""
from __future__ import annotations

import numpy as np
import torch

from engines.core import Completion, Engine, SamplingParams
from engines.logprobs import token_logprobs
from engines.lora import adapter_state_dict, apply_lora, enabled, load_adapter
from weightsync.flat import checksum

SCORE_CHUNK_ROWS = 16  # sequences whose full-vocabulary logits may exist at once while scoring


class HFEngine(Engine):
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", lora=None):
        """`lora`: the job's learner.lora; with a rank, the engine serves the base model at `model_path` with the
        learner's adapter on it, and a version is that adapter alone (engines/lora.py)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.lora = enabled(lora)
        if self.lora:
            self.model = apply_lora(self.model, lora)
        self.model.eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = self.model.config.vocab_size
        self.version = 0
        self.checksum = checksum(self.held())

    def held(self) -> dict[str, torch.Tensor]:
        """The tensors a version sets, as the engine holds them: the adapter with LoRA, else every weight."""
        return adapter_state_dict(self.model) if self.lora else self.model.state_dict()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        rows = [p for p in prompts for _ in range(params.n)]
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(rows):  # left padding: generation continues at the right edge
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=attn.to(self.device), do_sample=True,
            temperature=params.temperature, top_p=params.top_p, top_k=0, max_new_tokens=params.max_tokens,
            min_new_tokens=params.max_tokens if params.ignore_eos else 0,
            sequence_bias={(self.eos_id,): params.eos_logit_bias} if params.eos_logit_bias else None,
            eos_token_id=self.eos_id, pad_token_id=self.pad_id)
        tokens = out[:, width:].cpu().numpy().astype(np.int32)
        lengths = []
        for i in range(len(rows)):
            eos = np.nonzero(tokens[i] == self.eos_id)[0]
            lengths.append(int(eos[0]) + 1 if len(eos) and not params.ignore_eos else tokens.shape[1])
        lps = self._score(out, torch.cat([attn.to(self.device), torch.ones_like(out[:, width:])], 1), width,
                          params.temperature, params.eos_logit_bias)
        comps = [Completion(token_ids=tokens[i, :n].copy(), logprobs=lps[i, :n].copy(),
                            finish_reason="stop" if n < tokens.shape[1] or tokens[i, n - 1] == self.eos_id
                            else "length", version_start=self.version, version_end=self.version)
                 for i, n in enumerate(lengths)]
        return [comps[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _score(self, seqs, attn, width: int, temperature: float, eos_bias: float = 0.0) -> np.ndarray:
        """Behavior logprobs of the generated tokens: one prefill over the finished sequences.

        Same weights, same positions as during sampling; done in row chunks so full-vocabulary
        logits exist for only SCORE_CHUNK_ROWS sequences at a time (HF's `output_logits` would
        keep all of them: 40 GB for 256 x 512 tokens of a 150k vocabulary).
        """
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = []
        for i in range(0, seqs.shape[0], SCORE_CHUNK_ROWS):
            sl = slice(i, i + SCORE_CHUNK_ROWS)
            logits = self.model(input_ids=seqs[sl], attention_mask=attn[sl], position_ids=pos[sl]).logits
            if eos_bias:  # as sampling saw it (generate's sequence_bias, applied before temperature)
                logits[..., self.eos_id] += eos_bias
            out.append(token_logprobs(logits[:, width - 1:-1], seqs[sl, width:], temperature).cpu())
        return torch.cat(out).numpy().astype(np.float32)

    def load_weights(self, state_dict, version: int, checksum_: str, *, verified: bool = False) -> None:
        """Load a version; the checksum proven is of the weights as the engine holds them, or, when
        the engine keeps another dtype than the learner (bf16 engine, fp32 learner), of the
        version as delivered (the engine then holds its rounding). With LoRA a version is the adapter:
        every adapter tensor and nothing else (engines/lora.py load_adapter)."""
        own = self.held()
        same_dtype = all(own[k].dtype == v.dtype for k, v in state_dict.items() if k in own)
        if not same_dtype and checksum(state_dict) != checksum_:
            raise RuntimeError(f"version {version} arrived with a checksum other than the publisher's {checksum_}")
        if self.lora:
            load_adapter(self.model, state_dict)
        else:
            self.model.load_state_dict(state_dict, strict=True)
        got = checksum(self.held()) if same_dtype else checksum_
        if got != checksum_:
            raise RuntimeError(f"engine holds checksum {got} after loading version {version}, "
                               f"publisher sent {checksum_}")
        self.version, self.checksum = version, got
