"""The per-request sampler: picks the next token from a logits row.

Every finite, in-range setting yields a valid token (no NaN or infinity reaches
`torch.multinomial`): temperatures below `SamplingParams.GREEDY_BELOW` decode greedily
(dividing float32 logits by them overflows), temperatures above `MAX_TEMPERATURE` are
clamped to it (the distribution is uniform long before), and top-p always keeps the most
likely token (a tiny top-p such as 1e-300 rounds to 0 in float32).
"""

from __future__ import annotations

import torch

from .sampling import SamplingParams

MAX_TEMPERATURE = 1e4


class Sampler:
    """Picks the next token for one request; owns that request's random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """Sample from a 1-D logits row (any float dtype)."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits).item())
        logits = logits.float() / min(p.temperature, MAX_TEMPERATURE)
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # keep the smallest set whose mass reaches top_p, and always the first token
            drop = cumulative - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            # logits that were not finite to begin with (a broken model): greedy
            return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))).item())
        return int(torch.multinomial(probs, 1, generator=self.generator).item())
