"""Fake engines for tests and benchmarks: the engine contract without a model.

Tokens are UTF-8 bytes (id 256 is EOS), and a generation emits a canned reply one
character per token. Each fake keeps the real engine's contract (a context forks its
parent's tokens when created, parents outlive children, a generating context cannot be
freed) and records what it served, so tests can count fills, generations and frees.

- `ScriptedEngine`: deterministic, for manager and native-API tests; `reply(prompt)` gives
  each generation's text, and a generation never yields to the event loop unless a test
  holds it with `gate`.
- `FakeEngine`: for the request-level server tests: a fixed or per-request reply, paced
  tokens (`step_delay`), endless streams, failures mid-stream, slow fills, the limits and
  the chat template of a real model.
- `NoopEngine`: does no work at all (every generation ends at once); for the manager
  benchmark, which measures the manager, not an engine.

Nothing here imports torch; nothing in the serving code imports this module.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from parrot_backend.contract.engine import EngineStats, TokenDelta
from parrot_backend.contract.errors import (
    ContextBusy,
    ContextNotFound,
    EngineError,
    InvalidRequest,
)
from parrot_backend.contract.sampling import SamplingParams

EOS_ID = 256
VOCAB = 300  # FakeEngine's vocabulary: the bytes, EOS, a few spare ids


class Fill(NamedTuple):
    """One `fill` an engine served (a tuple: `fill[3]` is the salt)."""

    context_id: Hashable
    parent_id: Hashable | None
    n_tokens: int
    salt: str | None
    text: str = ""
    priority: int = 0


@dataclass(slots=True)
class Generation:
    """One `generate` an engine served: the context's text when it started, the reply,
    and how the stream ended (`closed` once its iterator finished or was closed)."""

    context_id: Hashable
    parent_id: Hashable | None
    sampling: SamplingParams
    salt: str | None = None
    priority: int = 0
    prompt: str = ""
    text: str = ""
    finished: str | None = None  # the finish reason of the last delta
    tokens: int = 0
    closed: bool = False
    closed_at: float | None = None
    last_token_at: float | None = None


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could still grow into a stop string (the
    engine holds them back until it knows)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def byte_tokens(text: str) -> list[int]:
    """UTF-8 bytes: the fakes' tokenizer (no special tokens, so values and template text
    tokenize alike)."""
    return list(text.encode())


def byte_text(token_ids: list[int]) -> str:
    """UTF-8 bytes back to text; EOS and other ids above 255 are dropped."""
    try:
        raw = bytes(token_ids)  # the usual case: every id is a byte
    except (ValueError, TypeError):
        raw = bytes(t for t in token_ids if t < 256)
    return raw.decode(errors="replace")


def block_stats(
    block_size: int, capacity_tokens: int, used_tokens: int, **counts: int
) -> EngineStats:
    """Stats of a fake holding `used_tokens` in blocks of `block_size` (forks are not
    deduplicated); `counts` set the other fields (zero by default)."""
    total = capacity_tokens // block_size
    used = min(total, -(-used_tokens // block_size))
    fields = dict(
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
    fields.update(counts)
    return EngineStats(
        block_size=block_size,
        blocks_total=total,
        blocks_used=used,
        blocks_free=total - used,
        blocks_cached=0,
        **fields,
    )


@dataclass
class ContextTree:
    """The contexts of a fake engine: token lists forked from their parents, with the
    contract's rules for creating and freeing them."""

    contexts: dict[Hashable, list[int]] = field(default_factory=dict)
    parents: dict[Hashable, Hashable] = field(default_factory=dict)
    children: Counter[Hashable] = field(default_factory=Counter)  # live children per context
    generating: set[Hashable] = field(default_factory=set)
    freed: list[Hashable] = field(default_factory=list)
    used_tokens: int = 0  # tokens held by all contexts (forks counted again), for stats()

    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        """UTF-8 bytes (this tokenizer has no special tokens: `data` changes nothing)."""
        return byte_tokens(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return byte_text(token_ids)

    def text_of(self, context_id: Hashable) -> str:
        """The text a context holds now."""
        return self.detokenize(self.contexts[context_id])

    def _open(self, context_id: Hashable, parent_id: Hashable | None) -> list[int]:
        """The tokens of `context_id`, created as a fork of `parent_id` if new."""
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

    def _free(self, context_id: Hashable) -> None:
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


@dataclass
class ScriptedEngine(ContextTree):
    """Deterministic fake engine. `reply(prompt)` gives each generation's text.

    `fail_if(prompt)` true makes a generation raise EngineError after its first token;
    `gate`, when set, must be open (set) for generations to proceed (tests hold calls
    running with it); `capacity_tokens` sizes `stats()`; `record=False` keeps no records.
    """

    model_name: str = "scripted"
    reply: Callable[[str], str] = lambda prompt: "ok"
    fail_if: Callable[[str], bool] = lambda prompt: False
    gate: asyncio.Event | None = None
    capacity_tokens: int = 1 << 20
    block_size: int = 16
    record: bool = True
    fills: list[Fill] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)

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
            text = self.detokenize(list(token_ids))
            self.fills.append(Fill(context_id, parent_id, len(token_ids), salt, text, priority))
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
        return self._generate(Generation(context_id, parent_id, sampling, salt, priority))

    async def _generate(self, rec: Generation) -> AsyncIterator[TokenDelta]:
        context_id, p = rec.context_id, rec.sampling
        if context_id in self.generating:
            raise ContextBusy(f"context {context_id!r} is generating")
        tokens = self._open(context_id, rec.parent_id)
        rec.prompt = prompt = self.detokenize(tokens)
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
                    rec.text, rec.finished = text[: text.index(hit)], "stop"
                    yield TokenDelta(ord(ch), rec.text[sent:], "stop")
                    return
                if i + 1 >= p.max_tokens:
                    rec.text, rec.finished = text, "length"
                    yield TokenDelta(ord(ch), text[sent:], "length")
                    return
                out = text[sent : len(text) - held_back(text, p.stop)]
                sent += len(out)
                yield TokenDelta(ord(ch), out)
            rec.text, rec.finished = text, "stop"
            yield TokenDelta(EOS_ID, text[sent:], "stop")
        finally:
            self.generating.discard(context_id)

    async def free(self, context_id: Hashable) -> None:
        """Release a context that has no live children and is not generating."""
        self._free(context_id)
        if self.record:
            self.freed.append(context_id)

    async def stats(self) -> EngineStats:
        return block_stats(
            self.block_size,
            self.capacity_tokens,
            self.used_tokens,
            contexts=len(self.contexts),
            running=len(self.generating),
        )


@dataclass
class FakeEngine(ContextTree):
    """A fake engine for the request-level server: canned replies, one character per token.

    `reply` is a string or `reply(prompt, sampling)`; every token yields to the event loop
    (`step_delay` seconds, 0 by default). `endless` repeats the reply forever (disconnect
    tests); `fail_after` tokens raises `fail_with` (mid-stream errors); `fill_delay` makes
    a fill wait as in a busy engine's queue. It validates sampling and lengths as the real
    engine does, and has its limits, special tokens and (optionally) a chat template.
    """

    model_name: str = "fake-model"
    max_model_len: int = 512
    vocab_size: int = VOCAB
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=lambda: {"bos": "<s>", "eos": "</s>"})
    reply: str | Callable[[str, SamplingParams], str] = "Hello from the fake engine."
    endless: bool = False
    step_delay: float = 0.0
    fail_after: int | None = None
    fail_with: Exception | None = None
    fill_delay: float = 0.0
    fills_cancelled: int = 0
    fills: list[Fill] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    tokens_generated: int = 0
    started: bool = False
    stopped: bool = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def fill(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        token_ids: list[int],
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> int:
        if context_id in self.generating:
            raise ContextBusy(f"context {context_id} is generating")
        tokens = self._open(context_id, parent_id)
        if len(tokens) + len(token_ids) > self.max_model_len:
            raise InvalidRequest("prompt longer than max_model_len")
        tokens.extend(token_ids)  # like the real engine: the context exists while it waits
        self.used_tokens += len(token_ids)
        self.fills.append(Fill(context_id, parent_id, len(token_ids), salt, "", priority))
        if self.fill_delay:
            try:
                await asyncio.sleep(self.fill_delay)
            except asyncio.CancelledError:
                self.fills_cancelled += 1
                raise
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
        sampling.validate(self.vocab_size)
        record = Generation(context_id, parent_id, sampling, salt, priority)
        self.generations.append(record)
        return self._generate(record)

    async def _generate(self, rec: Generation) -> AsyncIterator[TokenDelta]:
        ctx = rec.context_id
        if ctx not in self.contexts and (
            rec.parent_id is None or rec.parent_id not in self.contexts
        ):
            raise ContextNotFound(f"context {ctx} not found")
        if ctx in self.generating:
            raise ContextBusy(f"context {ctx} is generating")
        tokens = self._open(ctx, rec.parent_id)
        self.generating.add(ctx)
        rec.prompt = prompt = self.detokenize(tokens)
        reply = self.reply(prompt, rec.sampling) if callable(self.reply) else self.reply
        stops = rec.sampling.stop
        text = ""  # generated so far
        sent = 0  # characters of `text` already emitted
        try:
            i = 0
            while True:
                if not self.endless and i >= len(reply):
                    yield self._emit(rec, EOS_ID, text[sent:], "stop")
                    return
                await asyncio.sleep(self.step_delay)
                if self.fail_after is not None and rec.tokens >= self.fail_after:
                    raise self.fail_with or RuntimeError("fake engine failure")
                ch = reply[i % len(reply)]
                i += 1
                text += ch
                tokens.append(ord(ch) % 256)
                self.used_tokens += 1
                hit = next((s for s in stops if s in text), None)
                if hit is not None:
                    cut = text.index(hit)
                    yield self._emit(rec, ord(ch) % 256, text[sent:cut], "stop")
                    return
                if rec.tokens + 1 >= rec.sampling.max_tokens:
                    yield self._emit(rec, ord(ch) % 256, text[sent:], "length")
                    return
                out = text[sent : len(text) - held_back(text, stops)]
                sent += len(out)
                yield self._emit(rec, ord(ch) % 256, out, None)
        finally:
            self.generating.discard(ctx)
            rec.closed = True
            rec.closed_at = time.monotonic()

    def _emit(self, rec: Generation, token_id: int, text: str, finish: str | None) -> TokenDelta:
        rec.tokens += 1
        rec.last_token_at = time.monotonic()
        rec.finished = finish
        rec.text += text
        self.tokens_generated += 1
        return TokenDelta(token_id, text, finish)

    async def free(self, context_id: Hashable) -> None:
        self._free(context_id)
        self.freed.append(context_id)

    async def stats(self) -> EngineStats:
        return block_stats(
            16,
            16_000,
            self.used_tokens,
            contexts=len(self.contexts),
            running=len(self.generating),
            prefix_cache_enabled=True,
            prefix_cache_hits=42,
            prefix_cache_queries=100,
            waiting=3,
            tokens_generated=self.tokens_generated,
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
        self._stats = block_stats(16, capacity_tokens, 0)

    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        """UTF-8 bytes (as ScriptedEngine)."""
        return byte_tokens(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return byte_text(token_ids)

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
