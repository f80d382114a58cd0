"""One admitted request on the engine: its contexts, choices, metrics and guaranteed cleanup.

Every request gets fresh context ids and frees them in `close()`, which every exit path
calls (normal end, error, client disconnect, a response that never started). Closing the
engine's iterator is what cancels the generation, so a vanished client stops decoding at
the engine's next step instead of running to max_tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import anyio

from ..contract.engine import EngineClient, PromptEntry, TokenDelta
from ..contract.errors import ContextNotFound
from ..contract.sampling import SamplingParams
from .limits import Slot
from .metrics import ServerMetrics

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 10.0
_DONE = object()


async def _aclose(iterator: object) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception as exc:  # cleanup must go on to free the context
        log.warning("closing an engine iterator failed: %r", exc)


class RequestRun:
    """Runs `n` choices of one prompt and yields `(choice_index, TokenDelta)`.

    n == 1 generates straight into the prompt's context. n > 1 fills the prompt once and
    forks one child context per choice, so the choices share the prompt's KV blocks.
    With `prompt_logprobs` k the fill also scores the prompt (`EngineClient.fill`): its
    entries are `prompt_entries` once the prefill is done, one scoring for every choice.
    `sampling` None asks for the prompt alone: nothing is generated, and each choice ends
    ("length") with no token.
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        prompt_ids: list[int],
        sampling: SamplingParams | None,
        n: int,
        salt: str | None,
        metrics: ServerMetrics,
        endpoint: str,
        slot: Slot,
        started: float,
        prompt_logprobs: int | None = None,
    ) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.n = n
        self.salt = salt
        self.metrics = metrics
        self.endpoint = endpoint
        self._slot = slot
        self.started = started
        self.prompt_logprobs = prompt_logprobs
        self.prompt_entries: list[PromptEntry | None] | None = None  # the fill's, when asked
        self.root_id = f"oai-{uuid.uuid4().hex}"
        self.child_ids = [self.root_id] if n == 1 else [f"{self.root_id}/{i}" for i in range(n)]
        self.completion_tokens = [0] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.first_token_at: float | None = None
        self._filled = False
        self._iter: AsyncIterator[TokenDelta] | None = None
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue | None = None
        self._live = 0
        self._closed = False
        self._pending: asyncio.Task | None = None  # a prefill the stream started without
        self._ended = 0  # choices ended without a generation (`sampling` None)
        metrics.requests_running.inc()
        metrics.prompt_tokens.inc(len(prompt_ids))

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def total_completion_tokens(self) -> int:
        return sum(self.completion_tokens)

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.finish_reasons)

    def choice_prompt(self, index: int) -> tuple[list[int], list[PromptEntry | None] | None]:
        """Choice `index`'s prompt: its ids and the fill's entries (None unless scored)."""
        return self.prompt_ids, self.prompt_entries

    async def prefill(self) -> None:
        """Compute the prompt's KV. Errors here still reach the client as an HTTP status."""
        self._filled = True  # set first: a fill that fails half-way may have created it
        if self.prompt_logprobs is None:
            await self.engine.fill(self.root_id, None, self.prompt_ids, salt=self.salt)
            return
        scored = await self.engine.fill(
            self.root_id,
            None,
            self.prompt_ids,
            salt=self.salt,
            prompt_logprobs=self.prompt_logprobs,
        )
        self.prompt_entries = scored.prompt_logprobs

    async def start(self, wait_s: float | None = None) -> bool:
        """Prefill the prompt, waiting at most `wait_s` seconds (None: to the end).

        True when the prefill is done (its errors are raised here, for an HTTP status).
        False when it still runs after `wait_s`: the response may start (a stream's
        headers, then pings) while the prompt waits in a busy engine's queue, and the
        first step of iterating awaits the prefill (its errors are raised there). If the
        caller is cancelled (the client left), the prefill is cancelled too.
        """
        if wait_s is None:
            await self.prefill()
            return True
        task = asyncio.ensure_future(self.prefill())
        try:
            await asyncio.wait_for(asyncio.shield(task), wait_s)
        except TimeoutError:
            self._pending = task
            return False
        except BaseException:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise
        return True

    def _sampling_for(self, index: int) -> SamplingParams:
        # With a seed, each choice gets its own (seed + index) so n choices differ but the
        # whole response stays reproducible.
        if self.sampling.seed is None or index == 0:
            return self.sampling
        seed = (self.sampling.seed + index) % 2**63
        return dataclasses.replace(self.sampling, seed=seed)

    def __aiter__(self) -> RequestRun:
        return self

    async def __anext__(self) -> tuple[int, TokenDelta]:
        if self._pending is not None:  # the stream started before the prefill ended
            task, self._pending = self._pending, None
            await task  # (a cancelled iteration cancels the prefill with it)
        if self.sampling is None:  # the prompt alone: each choice ends, nothing generated
            if self._ended == self.n:
                raise StopAsyncIteration
            self._ended += 1
            return self._record(self._ended - 1, TokenDelta(None, "", "length"))
        if self.n == 1:
            if self._iter is None:
                self._iter = aiter(
                    self.engine.generate(self.root_id, None, self.sampling, salt=self.salt)
                )
            delta = await anext(self._iter)
            return self._record(0, delta)
        if self._queue is None:
            self._start_pumps()
        while self._live:
            index, item = await self._queue.get()
            if item is _DONE:
                self._live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return self._record(index, item)
        raise StopAsyncIteration

    def _record(self, index: int, delta: TokenDelta) -> tuple[int, TokenDelta]:
        if delta.token_id is not None:
            self.completion_tokens[index] += 1
            self.metrics.tokens_generated.inc()
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
                self.metrics.ttft.labels(endpoint=self.endpoint).observe(
                    self.first_token_at - self.started
                )
        if delta.finish_reason is not None:
            self.finish_reasons[index] = delta.finish_reason
        return index, delta

    def _start_pumps(self) -> None:
        # Bounded: a slow client backs up into the pumps instead of growing memory.
        self._queue = asyncio.Queue(maxsize=64 * self.n)
        self._live = self.n
        self.metrics.choice_fork_tokens.inc(self.n * self.prompt_tokens)  # each forks it
        for i, child in enumerate(self.child_ids):
            self._tasks.append(asyncio.create_task(self._pump(i, child)))

    async def _pump(self, index: int, child_id: str) -> None:
        assert self._queue is not None
        iterator = self.engine.generate(
            child_id, self.root_id, self._sampling_for(index), salt=self.salt
        )
        try:
            async for delta in iterator:
                await self._queue.put((index, delta))
            await self._queue.put((index, _DONE))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._queue.put((index, exc))
        finally:
            await _aclose(iterator)

    async def close(self) -> None:
        """Stop generating and free every context; idempotent, safe under cancellation."""
        if self._closed:
            return
        self._closed = True
        # Shielded: this often runs while the request's scope is being cancelled (client
        # gone), and an unshielded await there would be cancelled before freeing anything.
        with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True) as scope:
            if self._pending is not None:  # a prefill nobody waits for any more
                self._pending.cancel()
                await asyncio.gather(self._pending, return_exceptions=True)
                self._pending = None
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._iter is not None:
                await _aclose(self._iter)
            if self._filled:
                ids = self.child_ids[:] if self._tasks else []  # forks made by the pumps
                for ctx in [*ids, self.root_id]:  # children before their parent
                    await self._free(ctx)
        if scope.cancel_called:
            log.error("cleanup of %s timed out after %ss", self.root_id, CLEANUP_TIMEOUT_S)
        self._slot.release()
        self.metrics.requests_running.dec()
        outcome = "finished" if self.finished else "aborted"
        self.metrics.requests.labels(endpoint=self.endpoint, outcome=outcome).inc()
        self.metrics.latency.labels(endpoint=self.endpoint).observe(
            time.perf_counter() - self.started
        )

    async def _free(self, ctx: str) -> None:
        try:
            await self.engine.free(ctx)
        except ContextNotFound:
            pass  # never created (a child that did not start) or already gone
        except Exception as exc:
            log.error("freeing context %s failed: %r", ctx, exc)


class BatchRun:
    """Several prompts of one request (legacy completions' batch), each its own
    `RequestRun` with `n` choices, run concurrently so the engine batches them. Yields
    `(choice_index, TokenDelta)` with prompt i's choice j at index `i * n + j`, the
    prompts' deltas interleaved as they come. A failure of any run ends the iteration with
    its error; `close()` closes every run (each frees its contexts and its slot).
    """

    def __init__(self, runs: list[RequestRun], n: int) -> None:
        self.runs = runs
        self.per_prompt = n
        self.n = len(runs) * n
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._live = 0
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.runs)

    @property
    def total_completion_tokens(self) -> int:
        return sum(r.total_completion_tokens for r in self.runs)

    @property
    def finish_reasons(self) -> list[str | None]:
        return [reason for r in self.runs for reason in r.finish_reasons]

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.runs)

    def choice_prompt(self, index: int) -> tuple[list[int], list[PromptEntry | None] | None]:
        return self.runs[index // self.per_prompt].choice_prompt(index % self.per_prompt)

    async def start(self, wait_s: float | None = None) -> bool:
        """Every run's `start` at once (the engine fills the prompts together). The first
        error cancels the other prefills and is raised (`close()` frees what they made);
        True when every prefill is done."""
        tasks = [asyncio.ensure_future(r.start(wait_s)) for r in self.runs]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return all(done)

    def __aiter__(self) -> BatchRun:
        return self

    async def __anext__(self) -> tuple[int, TokenDelta]:
        if self._queue is None:
            self._queue = asyncio.Queue(maxsize=64 * self.n)
            self._live = len(self.runs)
            for i, run in enumerate(self.runs):
                self._tasks.append(asyncio.create_task(self._pump(i * self.per_prompt, run)))
        while self._live:
            index, item = await self._queue.get()
            if item is _DONE:
                self._live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item
        raise StopAsyncIteration

    async def _pump(self, base: int, run: RequestRun) -> None:
        assert self._queue is not None
        try:
            async for index, delta in run:
                await self._queue.put((base + index, delta))
            await self._queue.put((base, _DONE))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._queue.put((base, exc))

    async def close(self) -> None:
        """Stop every run and free all their contexts; idempotent, safe under
        cancellation (each `RequestRun.close` shields its own cleanup)."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            for run in self.runs:
                await run.close()
