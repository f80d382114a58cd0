"""The per-request sampler: picks the next token from a logits row.

Every finite, in-range setting yields a valid token (no NaN or infinity reaches
`torch.multinomial`): temperatures below `SamplingParams.GREEDY_BELOW` decode greedily
(dividing float32 logits by them overflows), temperatures above `MAX_TEMPERATURE` are
clamped to it (the distribution is uniform long before), and top-p always keeps the most
likely token (a tiny top-p such as 1e-300 rounds to 0 in float32).

A constrained request (`SamplingParams.constraint`) also has a grammar state; before each
step the engine writes every constrained row's mask of disallowed tokens in one batch
(`grammar_masks`), one per position the row samples at (a row with draft tokens samples
after each kept draft: `speculate.py`), and the sampler sets those logits to -inf before
it samples as usual. An unconstrained sampler never looks at a mask.

Penalties (`presence_penalty`, `frequency_penalty`, OpenAI's definition) count the tokens
this sampler has picked, in a vocabulary-sized row made at the first penalized step; they
are applied after the grammar mask and before temperature, top-k and top-p, greedy
included. A sampler without penalties keeps no counts. `logit_bias` is added to its
tokens' logits at the same place (after the mask, before the penalties); its ids and
values become tensors once, at the first biased step.

Log probabilities (`SamplingParams.logprobs`, not None): each call also records, in
`logprobs`, the picked token's log probability and the top `logprobs` alternatives, from
the log-softmax of the logits row it was given, before the grammar mask, penalties,
temperature, top-k and top-p (the model's own distribution, as OpenAI and vLLM report
it). A row with drafts calls the sampler once per token it yields, on the logits of the
step that checked them, so drafted tokens get the same numbers. The step loop empties the
list before each step and hands its entries out with the tokens, in order. A sampler
without logprobs does none of this work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parrot_backend.contract.sampling import SamplingParams

from .grammar import GrammarError, GrammarState

MAX_TEMPERATURE = 1e4
_SHIFTS = torch.arange(32, dtype=torch.int32)


def grammar_masks(
    states: Sequence[GrammarState],
    vocab_size: int,
    drafts: Sequence[Sequence[int] | None] | None = None,
) -> list[list[torch.Tensor] | GrammarError]:
    """Each state's disallowed tokens as bool rows of `vocab_size` (True: banned), computed
    into one bitmask for the batch: one row for its next position, and with `drafts[i]`
    one more after each of those draft tokens (the state itself is left as it was); a
    state whose matcher fails gets its error instead."""
    words = (vocab_size + 31) // 32
    ahead = [len(d or ()) for d in drafts] if drafts is not None else [0] * len(states)
    starts = [0]
    for n in ahead:
        starts.append(starts[-1] + 1 + n)
    bits = torch.zeros((starts[-1], words), dtype=torch.int32)
    errors: dict[int, GrammarError] = {}
    for i, state in enumerate(states):
        try:
            if ahead[i]:
                state.fill_masks_ahead(drafts[i], bits[starts[i]].data_ptr(), words * 4)
            else:
                state.fill_mask(bits[starts[i]].data_ptr(), words * 4)
        except GrammarError as exc:
            errors[i] = exc
    # bit j of word w allows token 32 * w + j (an arithmetic shift keeps the sign bit's 1)
    banned = ((bits.unsqueeze(-1) >> _SHIFTS) & 1).eq(0).reshape(starts[-1], -1)
    banned = banned[:, :vocab_size]
    return [
        errors[i] if i in errors else list(banned[starts[i] : starts[i + 1]])
        for i in range(len(states))
    ]


def token_logprobs(
    logits: torch.Tensor, token: int, k: int
) -> tuple[float, list[tuple[int, float]]]:
    """`token`'s log probability under the log-softmax of a raw logits row, and the `k`
    most likely tokens as (token id, logprob), most likely first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(lp[token]), top


class Sampler:
    """Picks the next token for one request; owns that request's random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.grammar: GrammarState | None = None  # bound by the engine when the request starts
        # this step's masks, one per position it samples at, in order (`grammar_masks`)
        self.banned: list[torch.Tensor] | GrammarError | None = None
        self.generator: torch.Generator | None = None
        self.counts: torch.Tensor | None = None  # tokens picked so far, with penalties only
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values), lazily
        # with logprobs: (logprob, [(token id, logprob)] top alternatives) per token picked
        # in the current step, in order (`token_logprobs`)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = (
            [] if params.logprobs is not None else None
        )
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    @property
    def plain_greedy(self) -> bool:
        """Its pick is the logits' argmax: greedy, no penalties, no constraint, no logprobs
        (the batched argmax of a row with drafts skips the sampler)."""
        p = self.params
        return (
            p.greedy
            and not p.penalized
            and not p.logit_bias
            and self.grammar is None
            and p.logprobs is None
        )

    def __call__(self, logits: torch.Tensor) -> int:
        """Sample from a 1-D logits row (any float dtype)."""
        token = self._sample(logits)
        if self.logprobs is not None:
            self.logprobs.append(token_logprobs(logits, token, self.params.logprobs or 0))
        return token

    def _sample(self, logits: torch.Tensor) -> int:
        if self.grammar is not None:
            logits = self._constrain(logits)
        if self.params.logit_bias:
            logits = self._bias(logits)
        if not self.params.penalized:
            return self._pick(logits)
        if self.counts is None:
            self.counts = torch.zeros(logits.numel(), dtype=torch.float32)
        token = self._pick(self._penalize(logits))
        self.counts[token] += 1
        return token

    def _bias(self, logits: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            pairs = self.params.logit_bias
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
            self.bias = ids, torch.tensor([b for _, b in pairs], dtype=torch.float32)
        ids, values = self.bias
        out = logits.float().clone()  # (never the caller's row: it serves other positions)
        out[ids] += values  # ids are distinct (validated)
        return out

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        p, counts = self.params, self.counts
        assert counts is not None
        out = logits.float()
        if p.frequency_penalty:
            out = out - counts * p.frequency_penalty
        if p.presence_penalty:
            out = out - (counts > 0).float() * p.presence_penalty
        return out

    def _pick(self, logits: torch.Tensor) -> int:
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

    def _constrain(self, logits: torch.Tensor) -> torch.Tensor:
        if isinstance(self.banned, GrammarError):
            raise self.banned
        if not self.banned:
            raise GrammarError("constrained row sampled without its mask")
        banned = self.banned.pop(0)  # a mask is good for one position only
        if bool(banned.all()):
            raise GrammarError("the constraint allows no next token")
        return logits.masked_fill(banned, float("-inf"))
