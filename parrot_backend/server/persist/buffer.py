"""Token events and call ends, buffered per run and written in batches.

Token events are what would make the store expensive: they are buffered and written in
batches by a background flusher (every `flush_interval_s`). Nothing reads tokens from
the manager's memory: SSE streams read the store's log, so a token is streamed only once
its batch committed. Any other event of a run is written in one transaction together
with the run's buffered tokens, placed before it (under a per-run lock), so the log
keeps the manager's order and a call's tokens are durable before its value or its end
are acknowledged. Tokens still buffered when the process dies were never streamed; the
call runs again after recovery.

A call's end (`call_finished`) is buffered like its tokens: it is recorded with the run's
next write (the next call's claim, the run's end) or the next flush, in the same
transaction. Nothing waits on it: its outputs were committed (and acknowledged) before
it, and recovery records the end of a call whose outputs are all set (`settle_calls`)
instead of running it again. That takes one commit per call off the critical path of
every step of a chain.

A write that fails wrote nothing: what it took from the buffers goes back (in order) for
the next write or flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from parrot_backend.store import Store
from parrot_backend.store.columns import utcnow

from ..notify import Notifier
from .meta import RunMeta

log = logging.getLogger(__name__)
T = TypeVar("T")


class WriteBuffer:
    """The buffered events and call ends of every run (`runs`), and their flusher."""

    def __init__(
        self,
        store: Store,
        worker: str,
        runs: dict[str, RunMeta],
        notifier: Notifier,
        db: Callable[..., Awaitable[Any]],
        flush_interval_s: float,
    ) -> None:
        self.store = store
        self.worker = worker
        self.runs = runs
        self.notifier = notifier
        self.db = db  # runs a store call on the writer thread(s)
        self.flush_interval_s = flush_interval_s
        self.dirty = asyncio.Event()

    def add_token(self, meta: RunMeta, payload: dict[str, Any]) -> None:
        """Buffer a token event."""
        meta.buffered.append(("token", payload))
        meta.first_token.setdefault(payload["call"], utcnow())
        self.dirty.set()

    def add_finish(self, meta: RunMeta, payload: dict[str, Any]) -> None:
        """Buffer a `call_finished` event and the call's end."""
        meta.buffered.append(("call_finished", payload))
        meta.finishes.append(self._finish_args(meta, payload))
        self.dirty.set()

    def _finish_args(self, meta: RunMeta, payload: dict[str, Any]) -> dict[str, Any]:
        """`Store.finish_call` arguments for a call that ended now. Its completion tokens
        are the event's: every token the engine generated, EOS included, as OpenAI usage
        counts them (token events leave out tokens with no text of their own)."""
        call = payload["call"]
        return {
            "call_id": meta.call_ids[call],
            "worker": self.worker,
            "outputs": {},
            "completion_tokens": payload["completion_tokens"],
            "first_token_at": meta.first_token.pop(call, None),
            "now": utcnow(),
        }

    def _record_finishes(self, finishes: list[dict[str, Any]]) -> None:
        for args in finishes:  # on the writer thread
            if not self.store.finish_call(**args).accepted:
                log.warning("call %s finished without holding its claim", args["call_id"])

    def batched(self, finishes: list[dict[str, Any]], work: Callable[[], T], single: bool) -> T:
        """Buffered call ends, then `work`, in one transaction (`single`: `work` is one
        store call, already one transaction: no batch is needed when nothing is buffered).
        Runs on the writer thread."""
        if single and not finishes:
            return work()
        with self.store.batch(savepoints=False):
            self._record_finishes(finishes)
            return work()

    async def flush_all(self) -> None:
        """Write every run's buffered events and call ends in one transaction (one commit
        per flush, however many runs are generating: commits, not rows, are what cost)."""
        dirty = sorted(r for r, m in self.runs.items() if m.buffered or m.finishes)
        if not dirty:
            return
        metas = [self.runs[r] for r in dirty]
        async with contextlib.AsyncExitStack() as stack:
            # sorted order; a listener holds one run's lock at a time, so no deadlock
            for meta in metas:
                await stack.enter_async_context(meta.lock)
            batch = [(r, t, p) for r, m in zip(dirty, metas, strict=True) for t, p in m.buffered]
            finishes = [f for m in metas for f in m.finishes]
            taken = [(m.buffered, m.finishes) for m in metas]
            for meta in metas:
                meta.buffered, meta.finishes = [], []
            written = []
            try:
                await self.db(
                    self.batched,
                    finishes,
                    lambda: self.store.append_events(batch),
                    True,
                    on_success=written.append,
                )
            except BaseException:
                if not written:  # nothing was written: back into the buffers
                    for meta, (tokens, ends) in zip(metas, taken, strict=True):
                        meta.buffered[:0] = tokens
                        meta.finishes[:0] = ends
                raise
        for run_id in dirty:
            self.notifier.wake(run_id)

    async def run(self) -> None:
        """The flusher: write what was buffered, `flush_interval_s` after it was."""
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            await asyncio.sleep(self.flush_interval_s)  # let a batch gather
            try:
                await self.flush_all()
            except Exception:  # the batch went back into the buffers: try again later
                log.exception("writing buffered events failed; retrying")
                self.dirty.set()
                await asyncio.sleep(max(self.flush_interval_s, 0.5))
