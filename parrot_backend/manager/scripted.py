"""A scripted, deterministic EngineClient: for manager tests and the manager benchmark.

Tokens are UTF-8 bytes (id 256 is EOS); a generation emits `reply(prompt_text)` one
character per token. It keeps the real engine's contract (a context forks its parent's
tokens when created, parents outlive children, a generating context cannot be freed) and
records every fill, generation and free so tests can count them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field

from parrot_backend.engine.errors import ContextBusy, ContextNotFound, EngineError
from parrot_backend.engine.interface import EngineStats, TokenDelta
from parrot_backend.engine.sampling import SamplingParams

EOS_ID = 256


@dataclass(slots=True)
class Fill:
    """One `fill` the engine served."""

    context_id: Hashable
    parent_id: Hashable | None
    text: str
    priority: int


@dataclass(slots=True)
class Generation:
    """One `generate` the engine served: the context's text when it started, and the reply."""

    context_id: Hashable
    parent_id: Hashable | None
    prompt: str
    priority: int
    text: str = ""
    finish: str | None = None


@dataclass
class ScriptedEngine:
    """Deterministic fake engine. `reply(prompt)` gives each generation's text.

    `fail_if(prompt)` true makes a generation raise EngineError after its first token;
    `gate`, when set, must be open (set) for generations to proceed (tests hold calls
    running with it); `capacity_tokens` sizes `stats()`.
    """

    model_name: str = "scripted"
    reply: Callable[[str], str] = lambda prompt: "ok"
    fail_if: Callable[[str], bool] = lambda prompt: False
    gate: asyncio.Event | None = None
    capacity_tokens: int = 1 << 20
    block_size: int = 16
    record: bool = True
    contexts: dict[Hashable, list[int]] = field(default_factory=dict)
    parents: dict[Hashable, Hashable] = field(default_factory=dict)
    generating: set[Hashable] = field(default_factory=set)
    fills: list[Fill] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    freed: list[Hashable] = field(default_factory=list)
    children: Counter[Hashable] = field(default_factory=Counter)  # live children per context
    used_tokens: int = 0  # tokens held by all contexts (forks counted again), for stats()

    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        """UTF-8 bytes (this tokenizer has no special tokens: `data` changes nothing)."""
        return list(text.encode())

    def detokenize(self, token_ids: list[int]) -> str:
        """UTF-8 bytes back to text; EOS and other ids above 255 are dropped."""
        try:
            raw = bytes(token_ids)  # the usual case: every id is a byte
        except (ValueError, TypeError):
            raw = bytes(t for t in token_ids if t < 256)
        return raw.decode(errors="replace")

    def text_of(self, context_id: Hashable) -> str:
        """The text a context holds now."""
        return self.detokenize(self.contexts[context_id])

    def _open(self, context_id: Hashable, parent_id: Hashable | None) -> list[int]:
        if context_id in self.contexts:
            if parent_id is not None and self.parents.get(context_id) != parent_id:
                raise EngineError(f"context {context_id!r} exists with a different parent")
            return self.contexts[context_id]
        if parent_id is not None and parent_id not in self.contexts:
            raise ContextNotFound(f"parent context {parent_id!r} not found")
        tokens = list(self.contexts[parent_id]) if parent_id is not None else []
        self.used_tokens += len(tokens)
        self.contexts[context_id] = tokens
        if parent_id is not None:
            self.parents[context_id] = parent_id
            self.children[parent_id] += 1
        return tokens

    async def fill(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        token_ids: list[int],
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> int:
        """Append tokens (creating the context, forked from `parent_id`, if new)."""
        if context_id in self.generating:
            raise ContextBusy(f"context {context_id!r} is generating")
        tokens = self._open(context_id, parent_id)
        tokens.extend(token_ids)
        self.used_tokens += len(token_ids)
        if self.record:
            self.fills.append(
                Fill(context_id, parent_id, self.detokenize(list(token_ids)), priority)
            )
        return len(tokens)

    def generate(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        sampling: SamplingParams,
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[TokenDelta]:
        """Emit the scripted reply one character per token; stops like the real engine
        (EOS not kept in the context; a stop string's tokens are kept, its text is not)."""
        if context_id not in self.contexts and parent_id is None:
            raise ContextNotFound(f"unknown context {context_id!r}")
        return self._generate(context_id, parent_id, sampling, priority)

    async def _generate(
        self, context_id: Hashable, parent_id: Hashable | None, p: SamplingParams, priority: int
    ) -> AsyncIterator[TokenDelta]:
        if context_id in self.generating:
            raise ContextBusy(f"context {context_id!r} is generating")
        tokens = self._open(context_id, parent_id)
        prompt = self.detokenize(tokens)
        rec = Generation(context_id, parent_id, prompt, priority)
        if self.record:
            self.generations.append(rec)
        reply = self.reply(prompt)
        self.generating.add(context_id)
        try:
            text, sent = "", 0
            for i, ch in enumerate(reply):
                if self.gate is not None:
                    await self.gate.wait()
                if i == 1 and self.fail_if(prompt):
                    raise EngineError(f"scripted failure on context {context_id!r}")
                piece = ch.encode()
                tokens.extend(piece)
                self.used_tokens += len(piece)
                text += ch
                hit = next((s for s in p.stop if s in text), None)
                if hit is not None:
                    rec.text, rec.finish = text[: text.index(hit)], "stop"
                    yield TokenDelta(ord(ch), rec.text[sent:], "stop")
                    return
                if i + 1 >= p.max_tokens:
                    rec.text, rec.finish = text, "length"
                    yield TokenDelta(ord(ch), text[sent:], "length")
                    return
                # hold back a tail that could still grow into a stop string
                hold = max(
                    (k for s in p.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                    default=0,
                )
                out = text[sent : len(text) - hold]
                sent += len(out)
                yield TokenDelta(ord(ch), out)
            rec.text, rec.finish = text, "stop"
            yield TokenDelta(EOS_ID, text[sent:], "stop")
        finally:
            self.generating.discard(context_id)

    async def free(self, context_id: Hashable) -> None:
        """Release a context that has no live children and is not generating."""
        if context_id not in self.contexts:
            raise ContextNotFound(f"unknown context {context_id!r}")
        if context_id in self.generating:
            raise ContextBusy(f"context {context_id!r} is generating")
        if self.children[context_id]:
            raise ContextBusy(f"context {context_id!r} has live children")
        self.used_tokens -= len(self.contexts.pop(context_id))
        parent = self.parents.pop(context_id, None)
        if parent is not None:
            self.children[parent] -= 1
        if self.record:
            self.freed.append(context_id)

    async def stats(self) -> EngineStats:
        """Blocks as if every context held its own tokens (forks are not deduplicated)."""
        used = self.used_tokens
        total = self.capacity_tokens // self.block_size
        used_blocks = min(total, -(-used // self.block_size))
        return EngineStats(
            block_size=self.block_size,
            blocks_total=total,
            blocks_used=used_blocks,
            blocks_free=total - used_blocks,
            blocks_cached=0,
            prefix_cache_enabled=False,
            prefix_cache_hits=0,
            prefix_cache_queries=0,
            contexts=len(self.contexts),
            running=len(self.generating),
            waiting=0,
            tokens_computed=0,
            tokens_generated=0,
            preemptions=0,
            steps=0,
        )


_EOS = TokenDelta(EOS_ID, "", "stop")


class NoopEngine:
    """An engine that does no work: every generation ends at once with EOS (an empty
    value). For the manager benchmark, which measures the manager, not an engine.

    It keeps only the set of live context ids, so that the contract's errors still show
    (a fork of an unknown parent, a free of an unknown context) and a benchmark can check
    that every context was freed (`live` is empty at the end).
    """

    def __init__(self, model_name: str = "noop", capacity_tokens: int = 1 << 30) -> None:
        self.model_name = model_name
        self.live: set[Hashable] = set()
        self._stats = EngineStats(
            block_size=16,
            blocks_total=capacity_tokens // 16,
            blocks_used=0,
            blocks_free=capacity_tokens // 16,
            blocks_cached=0,
            prefix_cache_enabled=False,
            prefix_cache_hits=0,
            prefix_cache_queries=0,
            contexts=0,
            running=0,
            waiting=0,
            tokens_computed=0,
            tokens_generated=0,
            preemptions=0,
            steps=0,
        )

    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        """UTF-8 bytes (as ScriptedEngine)."""
        return list(text.encode())

    def detokenize(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")

    def _open(self, context_id: Hashable, parent_id: Hashable | None) -> None:
        if parent_id is not None and parent_id not in self.live:
            raise ContextNotFound(f"parent context {parent_id!r} not found")
        self.live.add(context_id)

    async def fill(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        token_ids: list[int],
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> int:
        self._open(context_id, parent_id)
        return len(token_ids)

    def generate(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        sampling: SamplingParams,
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[TokenDelta]:
        self._open(context_id, parent_id)
        return _eos()

    async def free(self, context_id: Hashable) -> None:
        try:
            self.live.remove(context_id)
        except KeyError:
            raise ContextNotFound(f"unknown context {context_id!r}") from None

    async def stats(self) -> EngineStats:
        return self._stats


async def _eos() -> AsyncIterator[TokenDelta]:
    yield _EOS
