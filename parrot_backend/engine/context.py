"""Contexts (a tree of KV sequences) and the requests that work on them."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from parrot_backend.contract.sampling import SamplingParams

from .block_pool import chain_hash, root_hash
from .detokenizer import Detokenizer
from .grammar import GrammarState
from .sampler import Sampler
from .speculate import Drafter


class Context:
    """A token sequence whose KV lives in paged blocks.

    A child forked from a parent starts with the parent's tokens and shares its blocks by
    refcount; it appends its own. `num_computed` tokens have KV in the blocks; the rest
    (e.g. the last sampled token) are computed by the next request on this context.
    """

    def __init__(
        self, cid: Hashable, parent: Context | None, salt: str | None, block_size: int
    ) -> None:
        self.id = cid
        self.block_size = block_size
        self.parent = parent
        self.children: set[Hashable] = set()
        self.salt = parent.salt if parent is not None and salt is None else salt
        self.tokens: list[int] = list(parent.tokens) if parent is not None else []
        self.fork_len = len(self.tokens)
        self.blocks: list[int] = []
        self.num_computed = 0
        self.kept_blocks = 0  # leading full blocks shared with the parent; kept on preemption
        self.attached = parent is None  # blocks inherited from the parent yet?
        self.queue: deque[Request] = deque()  # pending requests; the head one is active
        self.freed = False
        self.last_used = 0  # scheduler clock at its last step; idle KV is evicted LRU
        self._hashes: list[int] = []  # chain hash after each full block
        # the grammar state of the last constrained generation, while the context still ends
        # where it left off (`GrammarState.end`): a generation under the same constraint, on
        # this context or on a fork of it, continues it (the fork gets a copy when it attaches)
        self.grammar: GrammarState | None = None
        # (n, h): the final hidden state at position n - 1, kept by the fill that computed
        # it; while the context is n tokens long, a generation samples its first token from
        # h instead of recomputing the last token (a step less before the first token).
        # A fork of exactly those tokens inherits it (the state depends on the tokens only),
        # also one made before the parent's fill computed it (`kept_hidden`).
        self.last_hidden: tuple[int, object] | None = None
        if parent is not None and parent.last_hidden is not None:
            if parent.last_hidden[0] == self.fork_len:
                self.last_hidden = parent.last_hidden

    def kept_hidden(self) -> tuple[int, object] | None:
        """The kept final hidden state of the context's last token, or None. A fork with no
        tokens of its own takes its parent's when the parent kept one for those tokens: the
        users of one prompt are forks of it made as soon as it was sent, before its fill
        computed the state (without it each recomputed the prompt's last token)."""
        kept = self.last_hidden
        n = len(self.tokens)
        if kept is not None and kept[0] == n:
            return kept
        parent = self.parent
        if parent is not None and self.fork_len == n:
            kept = parent.last_hidden
            if kept is not None and kept[0] == n:
                self.last_hidden = kept
                return kept
        return None

    def block_hash(self, k: int) -> int:
        """Chain hash of the first k full blocks (the salt starts the chain)."""
        if k == 0:
            return root_hash(self.salt)
        bs = self.block_size
        while len(self._hashes) < k:
            j = len(self._hashes)
            prev = self._hashes[-1] if self._hashes else root_hash(self.salt)
            self._hashes.append(chain_hash(prev, tuple(self.tokens[j * bs : (j + 1) * bs])))
        return self._hashes[k - 1]

    @property
    def busy(self) -> bool:
        return bool(self.queue)


_ids = itertools.count()


@dataclass(eq=False, slots=True)
class PromptScores:
    """A scoring fill's log probabilities (`fill(..., prompt_logprobs=k)`), filled in by
    the steps that compute its tokens: `entries[i]` is token `start + i`'s (logprob, top
    `k` as (token id, logprob)), from the logits at position `start + i - 1`; `entries[0]`
    stays None (that position is not the fill's). `tokens` is a copy of the tokens it
    appended, so the compute thread never reads the context; a position computed again
    (a preempted or retried step) overwrites its entry."""

    start: int
    tokens: tuple[int, ...]
    k: int
    entries: list[tuple[float, list[tuple[int, float]]] | None]


@dataclass(eq=False)
class Request:
    """A fill or a generate on one context, queued until the scheduler runs it."""

    kind: str  # "fill" | "generate"
    ctx: Context
    sampling: SamplingParams | None = None
    sampler: Sampler | None = None
    detok: Detokenizer | None = None
    future: asyncio.Future | None = None  # fill: resolved with the context length
    out: asyncio.Queue | None = None  # generate: TokenDelta items, or an exception
    seq: int = field(default_factory=lambda: next(_ids))
    priority: int = 0  # lower runs first (latency-critical work)
    generated: int = 0
    prompt_end: int | None = None  # a generate's context length when it was first admitted
    matched: bool = False  # asked the prefix cache since it was (re)admitted
    done: bool = False
    eos_ids: frozenset[int] = frozenset()
    drafter: Drafter | None = None  # a greedy generation that may check draft tokens
    # a fill that scores the tokens it appends: their entries while they are computed
    scores: PromptScores | None = None

    @property
    def pending(self) -> int:
        """Tokens still to compute before this request can finish or sample."""
        return len(self.ctx.tokens) - self.ctx.num_computed
