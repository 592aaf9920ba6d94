"""Hugging Face transformers engine (CPU or GPU): batched sampling with behavior logprobs.

Version swaps are atomic for generation by construction: the rollout loop calls
`load_weights` only between `generate` calls on the same thread, and the subscriber hands
over fully received buffers (a double buffer: the next version lands in fresh memory while
the current one keeps generating).
"""
from __future__ import annotations

import numpy as np
import torch

from actors.core import Completion, Engine, SamplingParams
from learner.losses import token_logprobs
from weightsync.flat import checksum


class HFEngine(Engine):
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = self.model.config.vocab_size
        self.version = 0
        self.checksum = checksum(self.model.state_dict())

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
            eos_token_id=self.eos_id, pad_token_id=self.pad_id, return_dict_in_generate=True,
            output_logits=True)
        tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1)[:, :tokens.shape[1]]   # raw, before warpers
        lps = token_logprobs(logits, tokens, params.temperature).cpu().numpy().astype(np.float32)
        tokens = tokens.cpu().numpy().astype(np.int32)
        comps = []
        for i in range(len(rows)):
            eos = np.nonzero(tokens[i] == self.eos_id)[0]
            n = int(eos[0]) + 1 if len(eos) else tokens.shape[1]
            comps.append(Completion(token_ids=tokens[i, :n].copy(), logprobs=lps[i, :n].copy(),
                                    finish_reason="stop" if len(eos) else "length"))
        return [comps[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def load_weights(self, state_dict, version: int, checksum_: str) -> None:
        self.model.load_state_dict(state_dict, strict=True)
        self.version = version
        self.checksum = checksum(self.model.state_dict())
        if self.checksum != checksum_:
            raise RuntimeError(f"engine holds checksum {self.checksum} after loading version {version}, "
                               f"publisher sent {checksum_}")
