"""A scripted EngineClient for server tests: canned replies, one character per token.

It enforces the contract the real engine does (contexts must exist, parents outlive
children, busy contexts cannot be freed) and records what happened, so tests can prove
that the server frees every context and stops generating when a client leaves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from parrot_backend.engine.errors import ContextBusy, ContextNotFound, InvalidRequest
from parrot_backend.engine.interface import EngineStats, TokenDelta
from parrot_backend.engine.sampling import SamplingParams

EOS_ID = 256
VOCAB = 300


@dataclass
class GenRecord:
    """What one `generate` call did."""

    context_id: object
    parent_id: object
    sampling: SamplingParams
    salt: str | None
    tokens: int = 0
    finished: str | None = None
    closed: bool = False
    closed_at: float | None = None
    last_token_at: float | None = None


@dataclass
class FakeEngine:
    model_name: str = "fake-model"
    max_model_len: int = 512
    vocab_size: int = VOCAB
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=lambda: {"bos": "<s>", "eos": "</s>"})
    reply: str | Callable[[str, SamplingParams], str] = "Hello from the fake engine."
    endless: bool = False  # repeat the reply forever (disconnect tests)
    step_delay: float = 0.0
    fail_after: int | None = None  # raise after this many tokens (mid-stream error tests)
    fail_with: Exception | None = None
    fill_delay: float = 0.0  # as if the prefill waited in a busy engine's queue
    fills_cancelled: int = 0
    contexts: dict = field(default_factory=dict)  # id -> token ids
    parents: dict = field(default_factory=dict)  # child id -> parent id
    generating: set = field(default_factory=set)
    fills: list = field(default_factory=list)  # (context_id, parent_id, n_tokens, salt)
    generations: list[GenRecord] = field(default_factory=list)
    freed: list = field(default_factory=list)
    tokens_generated: int = 0
    started: bool = False
    stopped: bool = False

    # ---- tokenizer: UTF-8 bytes ----
    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    # ---- lifecycle ----
    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    # ---- contract ----
    async def fill(self, context_id, parent_id, token_ids, *, salt=None) -> int:
        if context_id in self.generating:
            raise ContextBusy(f"context {context_id} is generating")
        if context_id not in self.contexts:
            base = []
            if parent_id is not None:
                if parent_id not in self.contexts:
                    raise ContextNotFound(f"parent {parent_id} not found")
                base = list(self.contexts[parent_id])
                self.parents[context_id] = parent_id
            self.contexts[context_id] = base
        tokens = self.contexts[context_id]
        if len(tokens) + len(token_ids) > self.max_model_len:
            raise InvalidRequest("prompt longer than max_model_len")
        tokens.extend(token_ids)  # like the real engine: the context exists while it waits
        self.fills.append((context_id, parent_id, len(token_ids), salt))
        if self.fill_delay:
            try:
                await asyncio.sleep(self.fill_delay)
            except asyncio.CancelledError:
                self.fills_cancelled += 1
                raise
        return len(tokens)

    def generate(self, context_id, parent_id, sampling: SamplingParams, *, salt=None
                 ) -> AsyncIterator[TokenDelta]:
        sampling.validate(self.vocab_size)
        record = GenRecord(context_id, parent_id, sampling, salt)
        self.generations.append(record)
        return self._generate(record)

    async def _generate(self, rec: GenRecord) -> AsyncIterator[TokenDelta]:
        ctx = rec.context_id
        if ctx not in self.contexts:
            if rec.parent_id is None or rec.parent_id not in self.contexts:
                raise ContextNotFound(f"context {ctx} not found")
            self.contexts[ctx] = list(self.contexts[rec.parent_id])
            self.parents[ctx] = rec.parent_id
        if ctx in self.generating:
            raise ContextBusy(f"context {ctx} is generating")
        self.generating.add(ctx)
        tokens = self.contexts[ctx]
        prompt = self.detokenize(tokens)
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
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                else:
                    await asyncio.sleep(0)
                if self.fail_after is not None and rec.tokens >= self.fail_after:
                    raise self.fail_with or RuntimeError("fake engine failure")
                ch = reply[i % len(reply)]
                i += 1
                text += ch
                tokens.append(ord(ch) % 256)
                hit = next((s for s in stops if s in text), None)
                if hit is not None:
                    cut = text.index(hit)
                    yield self._emit(rec, ord(ch) % 256, text[sent:cut], "stop")
                    return
                if rec.tokens + 1 >= rec.sampling.max_tokens:
                    yield self._emit(rec, ord(ch) % 256, text[sent:], "length")
                    return
                # hold back a tail that could still become a stop string
                hold = max((k for s in stops for k in range(1, len(s))
                            if text.endswith(s[:k])), default=0)
                out = text[sent:len(text) - hold]
                sent += len(out)
                yield self._emit(rec, ord(ch) % 256, out, None)
        finally:
            self.generating.discard(ctx)
            rec.closed = True
            rec.closed_at = time.monotonic()

    def _emit(self, rec: GenRecord, token_id: int, text: str, finish: str | None) -> TokenDelta:
        rec.tokens += 1
        rec.last_token_at = time.monotonic()
        rec.finished = finish
        self.tokens_generated += 1
        return TokenDelta(token_id, text, finish)

    async def free(self, context_id) -> None:
        if context_id not in self.contexts:
            raise ContextNotFound(f"context {context_id} not found")
        if context_id in self.generating:
            raise ContextBusy(f"context {context_id} is generating")
        if any(p == context_id for p in self.parents.values()):
            raise ContextBusy(f"context {context_id} has live children")
        del self.contexts[context_id]
        self.parents.pop(context_id, None)
        self.freed.append(context_id)

    async def stats(self) -> EngineStats:
        used = sum(len(t) for t in self.contexts.values())
        blocks_used = (used + 15) // 16
        return EngineStats(
            block_size=16, blocks_total=1000, blocks_used=blocks_used,
            blocks_free=1000 - blocks_used, blocks_cached=0, prefix_cache_enabled=True,
            prefix_cache_hits=42, prefix_cache_queries=100, contexts=len(self.contexts),
            running=len(self.generating), waiting=3, tokens_computed=0,
            tokens_generated=self.tokens_generated, preemptions=0, steps=0,
        )
