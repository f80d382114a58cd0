"""Drafts: guess a generation's next tokens from its context (or its grammar).

A generation that copies from its context (a summary repeating its document's phrases,
an engineer's code naming the design's functions) can take several tokens in one step:
the engine appends a few *draft* tokens after the last sampled one, computes them all in
one forward pass (a step of d + 1 tokens costs little more than a step of one on a CPU
or a GPU at a small batch: the weights are read once), and then picks tokens position
by position with the generation's own sampler (`accept`): the token picked after the
context, then, while each pick equals the draft token at its place, the token picked
after that draft token. A draft token equal to the pick is the token plain decoding
would have appended, so the logits computed after it are the ones plain decoding would
compute next; the first pick that differs ends the row.

This is exact for greedy and for sampled generations alike, penalties and constraints
included: the sampler is called once per token it yields, in order, so its random
generator and its penalty counts advance exactly as in plain decoding, and a seeded
generation yields the same tokens with or without drafts (up to the floating-point
differences that batching already brings). A constrained row samples each position
under its grammar's mask after the drafts before it (`sampler.grammar_masks`). For a
drafter that proposes one fixed token this is speculative sampling's rule: the draft is
kept with probability p(draft), and a rejected position yields a token drawn from p
without the draft. A wrong draft costs only the extra rows of that step.

A constrained row drafts the tokens its grammar forces (a JSON schema's keys, quotes and
colons: `GrammarState.forced`) when there are any, else the prompt-lookup guess below,
cut where the grammar stops allowing it (`scheduler._draft`).

The drafts come from the context: the most recent earlier place where the context's
last `n` tokens (n = `MAX_NGRAM` down to `MIN_NGRAM`) also occur, and the tokens that
followed them there (prompt lookup, as vLLM's "ngram" speculator and transformers'
`prompt_lookup_num_tokens` do). No second model is involved.

`Drafter` keeps an index of the context's n-grams (the latest position after each),
extended as tokens are appended, so a proposal costs a dictionary lookup per n, not a
scan of the context. It also keeps a running rate of the drafts kept (`record`): a
generation that does not copy (a chat answer keeps ~1% of its drafts) stops drafting
while the rate is under `MIN_RATE`, and tries again every `RETRY_AFTER` proposals, since
its drafts' rows cost a step time (two rows with 4 drafts each: ~1.26x a plain step on a
CPU) and bring nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_NGRAM = 3
MIN_NGRAM = 1
# the running rate of drafts kept: weight of the latest check, the rate under which a
# generation stops drafting, the proposals it then skips before it tries once more
RATE_WEIGHT = 0.3
MIN_RATE = 0.1
RETRY_AFTER = 8


class Drafter:
    """Proposes draft tokens for one generation from its context's own tokens."""

    __slots__ = ("_index", "_indexed", "rate", "_skipped")

    def __init__(self) -> None:
        # n-gram -> the position just after its latest occurrence whose continuation is
        # known (an n-gram ending at the context's last token is indexed once a token
        # follows it)
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are indexed
        self.rate = 0.5  # running fraction of drafts kept (`record`)
        self._skipped = 0  # proposals not made since the rate fell under MIN_RATE

    def record(self, drafted: int, kept: int) -> None:
        """A check of `drafted` tokens kept `kept` of them."""
        if drafted > 0:
            self.rate += RATE_WEIGHT * (kept / drafted - self.rate)

    def _extend(self, tokens: Sequence[int]) -> None:
        index = self._index
        # the n-grams ending at position e - 1 for every e whose continuation (position e)
        # exists: e runs up to len(tokens) - 1
        for e in range(max(self._indexed, 1), len(tokens)):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if e - n < 0:
                    break
                index[tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the context's
        longest matching suffix (`MAX_NGRAM` tokens down to `MIN_NGRAM`); [] if none."""
        if k <= 0 or len(tokens) < 2:
            return []
        if self.rate < MIN_RATE:  # its drafts have not been kept lately
            self._skipped += 1
            if self._skipped <= RETRY_AFTER:
                return []
            self._skipped = 0  # try once more
        if len(tokens) < self._indexed:  # the context was cut back: index it again
            self._index.clear()
            self._indexed = 0
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
            at = self._index.get(tuple(tokens[end - n :]))
            if at is not None:
                return list(tokens[at : at + k])
        return []


def accept(draft: Sequence[int], pick: Callable[[int], int]) -> list[int]:
    """The tokens a checked row yields. `pick(i)` is the generation's token at the row's
    i-th position (after the context plus `draft[:i]`), called in order and only while
    the drafts before it were kept: each draft token equal to its pick is kept, and the
    pick after the last kept one ends the list (1 to len(draft) + 1 tokens)."""
    out = [pick(0)]
    for i, token in enumerate(draft):
        if token != out[-1]:
            break
        out.append(pick(i + 1))
    return out
