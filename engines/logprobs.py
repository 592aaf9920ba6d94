"""Per-token logprobs from logits: the one op the engines (HF scoring) and the learner (losses, the
logprob head) share, kept below both."""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), [.., V] x [..] -> [..].

    Uses logsumexp instead of materialising a full log_softmax copy of the logits.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
