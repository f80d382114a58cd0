"""The dispatcher: rounds that start ready calls on engines.

A round runs whenever the ready queue changes (or, with calls waiting, every
`aging_s / 2`, since waiting calls age):

1. ask every engine for its stats (one that cannot answer takes no work this round);
2. take the calls the dispatch window offers for the free batch slots
   (`dispatch_window.py`);
3. render those offered for the first time: the prompt tokenized as one text, and its
   shareable prefixes (`render.py`, `prefix.py`); a call that cannot be rendered fails;
4. pick which prefixes to share (`sharing.shareable`);
5. ask the policy for engines (`policy.schedule`) and start each assigned call as its own
   task (`call_task.run_call`), counting its load on the engine until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from parrot_backend.program import InputRef, Text

from .call_task import run_call
from .dispatch_window import dispatch_window
from .policy import PendingCall, schedule
from .ready_queue import ReadyCall
from .render import render_call
from .sharing import shareable

if TYPE_CHECKING:
    from .manager import Manager

log = logging.getLogger(__name__)


class Dispatcher:
    """The dispatch loop of one manager (`start`/`stop` with it)."""

    def __init__(self, manager: Manager) -> None:
        self.m = manager
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="parrot-dispatch")

    async def stop(self) -> None:
        """Stop the loop (calls already started go on)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        m = self.m
        queue, wake = m.queue, m.wake
        while True:
            if queue.calls:
                # queued calls age: look again in a while even if nothing changes
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(m.config.policy.aging_s / 2):
                        await wake.wait()
            else:
                await wake.wait()
            wake.clear()
            if queue.calls:
                try:
                    await self.round()
                except Exception:  # a bug must not stop every run: log, retry next round
                    log.exception("dispatcher round failed")
                    await asyncio.sleep(0.1)
                    wake.set()

    def window(self, slots: int) -> list[ReadyCall]:
        """The queued calls this round offers the policy (`dispatch_window.py`)."""
        m = self.m
        return dispatch_window(m.queue, slots, m.clock() - m.config.policy.aging_s)

    async def round(self) -> None:
        """One round: offer, render, share, schedule, start (the module doc)."""
        m = self.m
        began = time.perf_counter()
        members = m.engine_set
        stats = {eid: await members.stats(eid) for eid in m.engines}
        cap = m.config.policy.max_batch
        slots = sum(cap - members.load[eid].batch if st else 0 for eid, st in stats.items())
        ready = self.window(max(0, slots))
        ready = await self._render(ready)
        statics = {r.static_key for r in ready if r.static_key is not None}
        # engines that keep a token-level prefix cache keep a lone static prefix's blocks
        # for the next run themselves (sharing.py)
        cached = bool(stats) and all(st and st.prefix_cache_enabled for st in stats.values())
        shared = shareable(
            (r.prefixes for r in ready),
            m.sharing.table,
            m.config.static_prefix_min_tokens,
            lambda p: p.key in statics,
            lambda i, p: later_reader(ready[i], p.n_segments),
            lone_static=not cached,
        )
        biggest = max(members.capacity.values(), default=1 << 62)
        pending: list[PendingCall] = []
        for r, prefixes in zip(ready, shared, strict=True):
            r.shared = prefixes
            gid = None if r.group is None else f"{r.run.run_id}/{r.group}"
            n = min(r.plan.n_tokens, biggest)  # never more than an empty engine offers
            pending.append(PendingCall(r.call_id, r.objective, n, r.enqueued_at, prefixes, gid))
        needed = sum(c.n_tokens for c in pending)
        keys = {p.key for r in ready for p in r.shared}
        table = m.sharing.table
        snapshots = [
            members.snapshot(eid, st, needed, keys, table, cap) for eid, st in stats.items()
        ]
        for a in schedule(pending, snapshots, m.clock(), m.config.policy):
            r = m.queue.calls.get(a.call_id)
            if r is not None and r.run.state == "running":
                m.queue.remove(r.run, r.name, started=True)
                self._start(r, a.engine_id)
        m.round_durations.append(time.perf_counter() - began)

    async def _render(self, ready: list[ReadyCall]) -> list[ReadyCall]:
        """Render the calls not rendered yet (`ReadyCall`); returns those that rendered. A
        call that cannot be rendered fails (with what depends on it)."""
        m = self.m
        out: list[ReadyCall] = []
        failed: list[tuple[ReadyCall, str]] = []
        model, tokens = m.model, m.tokens
        for r in ready:
            if r.plan is None:
                run = r.run
                call = run.program.calls[r.name]
                try:
                    # the plan and the prefix keys in one pass; each value tokenized once
                    r.plan, prefixes = render_call(call, run.values, tokens, model, run.salt)
                except Exception as exc:  # e.g. a tokenizer giving ids out of range
                    failed.append((r, f"{type(exc).__name__}: {exc}"))
                    continue
                r.prefixes = prefixes
                if prefixes and prefixes[0].n_segments == 1 and isinstance(call.segments[0], Text):
                    r.static_key = prefixes[0].key
            out.append(r)
        for r, error in failed:  # (fail_calls takes each off the queue)
            await m.transitions.fail_calls(r.run, {r.name: f"rendering the call failed: {error}"})
        return out

    def _start(self, r: ReadyCall, engine_id: str) -> None:
        """Start `r` on `engine_id` as a task; its load counts on the engine until it ends."""
        m = self.m
        now = m.clock()
        m.dispatch_delays.append(now - r.enqueued_at)
        m.calls_dispatched += 1
        objective, group = r.objective, r.group
        status = r.run.calls[r.name]
        status.state, status.engine = "running", engine_id
        load = m.engine_set.load[engine_id]
        counted_latency = objective == "latency" and group is None
        load.batch += 1
        load.tokens += r.plan.n_tokens
        load.latency += counted_latency
        task = asyncio.create_task(run_call(m, r, engine_id, objective, group))
        r.run.tasks[r.name] = task
        queue, wake = m.queue, m.wake

        def done(_: asyncio.Task[None]) -> None:
            load.batch -= 1
            load.tokens -= r.plan.n_tokens
            load.latency -= counted_latency
            queue.ended(r.run.tenant)
            if r.run.tasks.get(r.name) is task:  # a re-dispatched call has a new task
                del r.run.tasks[r.name]
            if queue.calls:
                wake.set()

        task.add_done_callback(done)


def later_reader(r: ReadyCall, n_segments: int) -> bool:
    """Whether a call of `r`'s run that has not started yet opens with the same first
    `n_segments` segments as `r`'s call, the last variable among them included: it will
    have the same prefix there once ready (the values never change). False for a static
    prefix (no variable): those follow their own rule."""
    program = r.run.program
    segments = program.calls[r.name].segments
    head = segments[:n_segments]
    last = None
    for seg in reversed(head):
        if isinstance(seg, InputRef):
            last = seg.name
            break
    if last is None:
        return False
    statuses = r.run.calls
    for other in program.variables[last].consumers:
        if other == r.name:
            continue
        status = statuses.get(other)
        if status is not None and status.state not in ("waiting", "ready"):
            continue  # started or over: it forks from nothing new
        if program.calls[other].segments[:n_segments] == head:
            return True
    return False
