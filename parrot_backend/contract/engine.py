"""The engine interface the manager and the servers use: fill, generate, free, stats.

Implementations: the in-process engine (`parrot_backend.engine.engine.Engine`), the remote
engine over HTTP (`parrot_backend.engines.remote.RemoteEngine`), and the fake engines of
`parrot_backend.testing.fake_engine`. The manager never touches torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .sampling import SamplingParams

ContextId = Hashable  # ints or strings chosen by the caller (only those survive HTTP)


@dataclass(slots=True)
class TokenDelta:
    """One step of a generation: the new token and the text it completes.

    `text` may be empty (a token that ends mid-way through a UTF-8 character, or text
    held back because it could be the start of a stop string). The last delta has
    `finish_reason` set: "stop" (EOS, stop token or stop string) or "length".

    With `SamplingParams.logprobs` set, `logprob` is the token's log probability and
    `top_logprobs` the `logprobs` most likely tokens at its position as (token id,
    logprob), most likely first: the model's log-softmax of the raw logits there (before
    penalties, temperature, top-k/top-p and any grammar mask), for drafted tokens too
    (their logits come from the step that checked them), and for the token that ends a
    generation without being part of its text (EOS, a stop token id: the last delta,
    `finish_reason` "stop"): legacy completions list it, chat leaves it out, as OpenAI's
    answers do. Otherwise both are None.
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


# a scored token's entry (`fill(..., prompt_logprobs=k)`): its logprob given the tokens
# before it, and the k most likely tokens at its position as (token id, logprob)
PromptEntry = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class ScoredFill:
    """What `fill(..., prompt_logprobs=k)` returns: the context's length, and one entry per
    token the fill appended, in order. The first is None (the fill does not compute the
    position before it: for a new context nothing predicts its first token); each later
    one is that token's `PromptEntry`, from the model's log-softmax of the raw logits at
    the position before it (the k alternatives most likely first)."""

    length: int
    prompt_logprobs: list[PromptEntry | None]


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's state, for schedulers, metrics and tests."""

    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int  # free blocks that still hold a reusable prefix
    prefix_cache_enabled: bool
    prefix_cache_hits: int  # tokens served from the token-level prefix cache
    prefix_cache_queries: int  # tokens looked up in it
    contexts: int
    running: int
    waiting: int
    # tokens whose KV the model computed and kept (prefill + decode; a decode step's draft
    # tokens count here once kept, and all of them in `draft_tokens`)
    tokens_computed: int
    tokens_generated: int
    preemptions: int
    steps: int
    # of tokens_computed, the prompt tokens (what fills and prompts added, not the tokens
    # generations fed back); None: the engine does not tell them from decode tokens
    prefill_tokens_computed: int | None = None
    # draft tokens checked in decode steps (prompt lookup, `engine/speculate.py`) and how
    # many of them were kept; None: the engine does not draft
    draft_tokens: int | None = None
    draft_tokens_accepted: int | None = None
    # prompt tokens whose scores (logprob and top k, for `prompt_logprobs`) were copied from
    # the scores a scoring fill kept with a cached block, not computed; None: the engine
    # keeps no scores
    prompt_scores_reused: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def free_tokens(self) -> int:
        return self.blocks_free * self.block_size


@runtime_checkable
class EngineClient(Protocol):
    """What the manager (and the HTTP engine API) needs from an engine.

    `priority` orders an engine's queue: lower runs first (the manager sends latency calls
    at 0 and throughput calls at 1). An engine that does not order requests accepts it
    and ignores it.
    """

    model_name: str

    async def fill(
        self,
        context_id: ContextId,
        parent_id: ContextId | None,
        token_ids: list[int],
        *,
        salt: str | None = None,
        priority: int = 0,
        prompt_logprobs: int | None = None,
    ) -> int | ScoredFill:
        """Append tokens to a context (creating it, forked from `parent_id`, if new) and
        compute their KV. Returns the context's length in tokens.

        With `prompt_logprobs` k (0..`MAX_LOGPROBS`), the fill also scores the tokens it
        appends and returns a `ScoredFill`: it computes each of them (none is taken from
        a prefix cache; its blocks are still cached for later requests) and the logits at
        each of their positions. An engine that cannot raises InvalidRequest; engines that
        can say so with `supports_prompt_logprobs = True`."""
        ...

    def generate(
        self,
        context_id: ContextId,
        parent_id: ContextId | None,
        sampling: SamplingParams,
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[TokenDelta]:
        """Generate into a context (creating it from `parent_id` if new); the generated
        tokens stay in the context. Closing the iterator early cancels the generation."""
        ...

    async def free(self, context_id: ContextId) -> None:
        """Release a context. Blocks shared with other contexts stay alive."""
        ...

    async def stats(self) -> EngineStats: ...

    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        """Token ids of text (no special tokens added). `data`: the text is a value
        substituted into a template, so special-token spellings in it stay plain text."""
        ...

    def detokenize(self, token_ids: list[int]) -> str: ...
