"""Shared prefixes on engines: choose which to materialize, fill each once, fork calls from it.

Which prefixes are worth a context of their own (`shareable`):

- a prefix that two or more calls waiting for an engine have (equal keys: same model,
  salt and tokens), e.g. a dynamic prefix holding an agent's output that many agents read;
- a prefix already filled on some engine (a hot prefix that outlived its run);
- a dynamic prefix that a call of the same run still to start will have too (`readers`):
  the same template text and variables up to the boundary, e.g. reviewers that each
  become ready at their own time but all open with the architect's generated design.
  Filled by the first of them, it is in the table when the others come;
- a static prefix (the constant text before a call's first variable) of at least
  `static_min_tokens` tokens, even when only one call has it now: system prompts recur
  across runs, and the next run finds it filled. Not when every engine keeps a
  token-level prefix cache (`lone_static=False`): there the engine keeps the prompt's
  blocks for the next run anyway, and filling the prefix on its own first cost the call
  one engine step where a fork starts once its parent's tokens are computed (one user on
  a ~270-token prompt: 18 steps against request-level's 17, 53-58 ms more).

On an engine whose forks join their parent's fill step (`joins_forks`: the in-process
engine) the call that fills a prefix does not wait for the fill: it submits its own fork
at once, the calls waiting for that prefix fork at once too, and the engine computes the
fill and the forks in one step. The fill's outcome is checked before the filler's first
token (`Attached.settle`): a failed fill fails that call, as before; a waiter's fork is
computed from what the fill did compute (or fails with it in the step they shared).

A call forks from the longest shareable prefix the engine holds or can fill. Prefixes are
chained: filling a dynamic prefix forks it from the static one when that is filled on the
same engine, so only the new tokens are computed. The `PrefixTable` keeps refcounts; idle
prefixes stay filled until an engine runs short of KV, then go least recently used first.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from parrot_backend.contract.engine import EngineClient
from parrot_backend.contract.errors import ContextNotFound, EngineError

from .prefix import Prefix, PrefixEntry, PrefixTable


class PrefixUnavailable(RuntimeError):
    """A prefix a call waited for could not be filled (its filler failed or was cancelled)."""


@dataclass(slots=True)
class Attached:
    """Where a call forks: `context_id` (None: from scratch) holding `n_tokens` of its prompt.

    `keys` are the prefixes the call holds a reference to; release them when it is done.
    `pending`: fills of those prefixes this call started and did not wait for (an engine
    that `joins_forks`); `settle` before the call's first token, `abandon` when it ends.
    """

    context_id: str | None
    n_tokens: int
    keys: list[str] = field(default_factory=list)
    pending: list[asyncio.Task[None]] = field(default_factory=list)

    async def settle(self) -> None:
        """Wait for the pending fills; raises the first one's error."""
        while self.pending:
            task = self.pending[0]
            try:
                await asyncio.shield(task)  # raises its error
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not task.cancelled() or (current is not None and current.cancelling()):
                    raise  # this call is being cancelled
                # the fill's task was cancelled (not this call): the call must not end
                # as if it were cancelled, with nothing recorded
                raise PrefixUnavailable("filling the prefix was cancelled") from None
            self.pending.pop(0)

    async def abandon(self) -> None:
        """Cancel the pending fills (the call ends without them) and wait for them."""
        for task in self.pending:
            task.cancel()
        if self.pending:
            await asyncio.wait(self.pending)
        self.pending.clear()


def _retrieve(task: asyncio.Task[None]) -> None:
    """A pending fill's error is raised by `settle`; one nobody settles is not logged."""
    if not task.cancelled():
        task.exception()


def shareable(
    candidates: Iterable[Sequence[Prefix]],
    table: PrefixTable,
    static_min_tokens: int,
    is_static: Callable[[Prefix], bool],
    readers: Callable[[int, Prefix], bool] | None = None,
    lone_static: bool = True,
) -> list[tuple[Prefix, ...]]:
    """For each call's prefixes (shortest first), those worth sharing (see module doc).

    `readers(i, prefix)`: whether a call still to start will have call `i`'s `prefix`
    (asked last, only for prefixes no other rule keeps). `lone_static`: whether a static
    prefix that only one call has is kept (False where every engine caches prefixes)."""
    calls = [tuple(c) for c in candidates]
    counts = Counter([p.key for c in calls for p in c])
    out: list[tuple[Prefix, ...]] = []
    for i, c in enumerate(calls):  # loops, not a generator per call: runs for every call
        kept = []
        for p in c:
            key = p.key
            if (
                counts[key] >= 2
                or key in table
                or (lone_static and p.n_tokens >= static_min_tokens and is_static(p))
                or (readers is not None and readers(i, p))
            ):
                kept.append(p)
        out.append(tuple(kept) if len(kept) != len(c) else c)
    return out


class SharedPrefixes:
    """Fills, forks from, refcounts and evicts prefix contexts across engines."""

    def __init__(
        self,
        engines: Mapping[str, EngineClient],
        clock: Callable[[], float],
    ) -> None:
        self.table = PrefixTable()
        self.engines = engines
        self.clock = clock
        self.fills: Counter[str] = Counter()  # engine id -> prefix contexts filled
        self.forks: Counter[str] = Counter()  # engine id -> calls forked from a prefix
        # engine id -> prompt tokens a fork took from a prefix's context (a call's, or a
        # longer prefix's filled on a shorter one) instead of computing them
        self.fork_tokens: Counter[str] = Counter()
        self._ready: dict[str, asyncio.Future[None]] = {}  # key -> its fill finished
        self._broken: set[str] = set()  # keys whose fill failed; dropped when released
        # engines outlive managers (remote engines, restarts): ids carry this manager's
        # namespace so another manager never appends to a context it did not create
        self.namespace = uuid.uuid4().hex[:12]

    def context_id(self, key: str) -> str:
        """The engine context id that holds prefix `key`."""
        return f"pfx:{self.namespace}:{key}"

    async def close(self) -> None:
        """Free every idle prefix context (at shutdown; no call may hold one)."""
        for engine_id in list(self.engines):
            try:
                await self._free(engine_id, self.table.evict(engine_id, 1 << 62))
            except EngineError:  # an engine that is gone holds nothing
                pass

    async def attach(
        self,
        engine_id: str,
        prefixes: Sequence[Prefix],
        prompt: Sequence[int],
        salt: str | None,
        priority: int,
    ) -> Attached:
        """Make the call's shareable `prefixes` (shortest first) available on `engine_id`
        and return the longest one to fork from. Raises when a prefix this call fills
        fails (the call then fails; its references are already released); a prefix another
        call was filling and failed is skipped (its tokens are filled with the call's)."""
        out = Attached(None, 0)
        try:
            for prefix in prefixes:
                entry = self.table.get(prefix.key)
                if prefix.key in self._broken or (entry and entry.engine_id != engine_id):
                    continue  # lives elsewhere (or failed): fill the tokens in the call
                if entry is None:
                    parent = out.keys[-1] if out.keys else None
                    entry = self.table.insert(
                        prefix.key,
                        engine_id,
                        self.context_id(prefix.key),
                        prefix.n_tokens,
                        self.clock(),
                        parent=parent,
                    )
                    self._ready[prefix.key] = asyncio.get_running_loop().create_future()
                    self.table.acquire(prefix.key, self.clock())
                    out.keys.append(prefix.key)
                    if getattr(self.engines[engine_id], "joins_forks", False):
                        above = Attached(out.context_id, out.n_tokens)
                        task = asyncio.ensure_future(
                            self._fill(engine_id, prefix, above, prompt, salt, priority)
                        )
                        task.add_done_callback(_retrieve)
                        out.pending.append(task)
                        # the task runs before this one goes on (tasks run in the order
                        # they were scheduled): its fill is submitted, so the engine knows
                        # the context before anything forks from it
                        await asyncio.sleep(0)
                        ready = self._ready[prefix.key]
                        if not task.done() and not ready.done():
                            # the calls waiting for it fork now too and join the fill's
                            # step; if the fill fails, their forks compute what it did not
                            # (the engine attaches a fork to what its parent computed)
                            ready.set_result(None)
                    else:
                        await self._fill(engine_id, prefix, out, prompt, salt, priority)
                else:
                    self.table.acquire(prefix.key, self.clock())
                    out.keys.append(prefix.key)
                    ready = self._ready[prefix.key]
                    try:
                        if ready.done():  # filled (or failed) before: no shield to wait on
                            ready.result()
                        else:
                            await asyncio.shield(ready)
                    except PrefixUnavailable:
                        # its filler failed or was cancelled: this call fills those tokens
                        out.keys.pop()
                        await self.release(engine_id, [prefix.key])
                        continue
                # the entry's context: `context_id(key)`, made when it was inserted
                out.context_id, out.n_tokens = entry.context_id, prefix.n_tokens
        except BaseException:
            await out.abandon()
            await self.release(engine_id, out.keys)
            raise
        if out.context_id is not None:
            self.forks[engine_id] += 1
            self.fork_tokens[engine_id] += out.n_tokens
        return out

    async def _fill(
        self,
        engine_id: str,
        prefix: Prefix,
        above: Attached,
        prompt: Sequence[int],
        salt: str | None,
        priority: int,
    ) -> None:
        ready = self._ready[prefix.key]
        try:
            await self.engines[engine_id].fill(
                self.context_id(prefix.key),
                above.context_id,
                list(prompt[above.n_tokens : prefix.n_tokens]),
                salt=salt,
                priority=priority,
            )
        except BaseException as exc:
            self._broken.add(prefix.key)
            if not ready.done():
                # not `exc` itself: a CancelledError would look like the waiter's own
                ready.set_exception(PrefixUnavailable(f"filling prefix failed: {exc!r}"))
                ready.exception()  # no "never retrieved" warning when nobody waits
            raise
        self.fills[engine_id] += 1
        if above.context_id is not None:
            self.fork_tokens[engine_id] += above.n_tokens
        if not ready.done():
            ready.set_result(None)

    async def release(self, engine_id: str, keys: Sequence[str]) -> None:
        """The call that attached `keys` is done (its own contexts already freed)."""
        now = self.clock()
        for key in reversed(keys):
            self.table.release(key, now)
            entry = self.table.get(key)
            if key in self._broken and entry is not None and entry.refcount == 0:
                # a failed prefix must not be found again: drop it now, first in LRU order
                entry.last_used = float("-inf")
                await self._free(engine_id, self.table.evict(engine_id, 1))

    async def make_room(self, engine_id: str, n_tokens: int) -> None:
        """Evict idle prefixes (LRU) on `engine_id` until it has `n_tokens` free, if it can.

        The engine's stats are asked for only when something could be evicted: with no
        idle prefix on the engine `evict` drops nothing whatever the engine says, so the
        round trip is skipped (a remote engine that went away shows up at the call's next
        request instead)."""
        if not self.table.has_idle(engine_id):
            return
        stats = await self.engines[engine_id].stats()
        short = n_tokens - stats.free_tokens
        if short > 0:
            await self._free(engine_id, self.table.evict(engine_id, short))

    async def _free(self, engine_id: str, dropped: list[PrefixEntry]) -> None:
        for entry in dropped:  # children come before their parents
            self._ready.pop(entry.key, None)
            self._broken.discard(entry.key)
            try:
                await self.engines[engine_id].free(entry.context_id)
            except ContextNotFound:
                pass  # its fill failed before the engine created it
