"""The per-call task: one ready call run on the engine the dispatcher chose.

`run_call` is the task's whole life: `call_started` (recorded while the engine starts; the
call's first token waits for it); attach the call's shared prefixes
(`sharing.py`: filled once, pinned while the call runs); make room by evicting idle
prefixes; run the plan (`CallRunner`); `call_finished`; and always free what it created.
How it ends:

- the engine errs for this request: the call fails, and everything downstream of it;
- the engine is gone (`EngineUnavailable`): not the call's fault; the engine is taken out
  of service and the call, like the others running there, is **requeued** for another;
- another manager sharing the store holds the call (`RunOwnedElsewhere`): the run is
  theirs, and this manager **abandons** its copy without recording anything;
- cancelled (the run was cancelled, the manager stops): it frees and stops.

`CallRunner` runs one call's plan on an engine: fill, generate each output, fill what
follows. The call gets its own context, forked from a shared prefix context when it has
one (`parent_id`), so the prefix's KV is shared, never copied or recomputed.

Stop strings: a generation that stops on a stop string leaves the stop text's tokens in
its context, although the variable's value excludes them. When more of the template
follows such an output, the output is generated in a child context; if it stopped with
`finish_reason == "stop"` and the output has stop strings, the manager forks another
child from the context before the output and fills the value's tokens (as data, like
any value), so the context holds exactly the template with the value substituted. (An EOS
stop needs no re-fill, but the two cannot be told apart from the stream, so both re-fill:
the rule is the same in every path and tests' reference path follows it.) Otherwise the
next segments are filled straight into the generating context.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parrot_backend.contract.engine import EngineClient, TokenDelta
from parrot_backend.contract.errors import ContextNotFound, EngineUnavailable
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.program import Criterion, GenerationConfig

from .identity_cache import IdentityCache
from .ready_queue import ReadyCall
from .render import CallPlan, Step
from .runs import RunOwnedElsewhere
from .sharing import Attached

if TYPE_CHECKING:
    from .manager import Manager

log = logging.getLogger(__name__)

PRIORITY = {"latency": 0, "throughput": 1}  # engine priority: lower runs first

_ids = itertools.count()

OnToken = Callable[[Step, TokenDelta], Awaitable[None]]
OnValue = Callable[[Step, str], Awaitable[None]]


class EmptyPrompt(ValueError):
    """A call has nothing before its first output: the engine cannot generate from nothing."""


_NAMESPACE = uuid.uuid4().hex[:12]  # engines outlive processes: ids must not collide


def new_context_id(prefix: str = "call") -> str:
    """A context id unique across processes sharing an engine."""
    return f"{prefix}:{_NAMESPACE}:{next(_ids)}"


# `config.to_sampling()`, made once per config object: configs are frozen and shared
# across runs (`ingest.py`), and so is the SamplingParams engines are given.
sampling_of: IdentityCache[GenerationConfig, SamplingParams] = IdentityCache(
    GenerationConfig.to_sampling
)


@dataclass(slots=True, eq=False)
class _Ctx:
    """A context of this call; created on the engine by its first fill or generate."""

    id: str
    parent: Hashable | None
    created: bool = False
    owned: bool = False  # in the runner's `owned` list

    def child(self) -> _Ctx:
        # a context not created yet holds exactly its parent's tokens: fork from that
        return _Ctx(new_context_id(), self.id if self.created else self.parent)


class CallRunner:
    """Runs a plan on one engine and frees every context it created, children first."""

    def __init__(
        self,
        engine: EngineClient,
        salt: str | None,
        priority: int,
        tokenize: Callable[[str], list[int]],
    ) -> None:
        self.engine = engine
        self.salt = salt
        self.priority = priority
        self.tokenize = tokenize
        self.owned: list[_Ctx] = []
        self.tokens = 0  # tokens generated (every delta carrying a token id)
        self.output_tokens: dict[str, int] = {}  # output -> tokens generated for it
        self.finishes: dict[str, str | None] = {}  # output -> why its generation ended

    async def run(
        self,
        plan: CallPlan,
        fork_from: str | None,
        skip: int,
        known: dict[str, str],
        on_token: OnToken,
        on_value: OnValue,
    ) -> None:
        """Run `plan`, its first `skip` prompt tokens already in context `fork_from`.

        Outputs in `known` (recovered values) are filled, not generated.
        """
        cur = _Ctx(new_context_id(), fork_from)
        rest = plan.prompt[skip:]  # a new list: the engine may keep it
        if rest:
            await self._fill(cur, rest, copy=False)
        elif fork_from is None:
            raise EmptyPrompt("the call's template has no text or value before its first output")
        for i, step in enumerate(plan.steps):
            if step.output in known:
                await self._fill(cur, self.tokenize(known[step.output]))
            else:
                cur = await self._generate(cur, step, i + 1 < len(plan.steps), on_token, on_value)
            if step.then:
                await self._fill(cur, step.then)

    async def _generate(
        self, cur: _Ctx, step: Step, more: bool, on_token: OnToken, on_value: OnValue
    ) -> _Ctx:
        fork = more and bool(step.config.stop)
        target = cur.child() if fork else cur
        parent, salt = self._request(target)
        stream = self.engine.generate(
            target.id, parent, sampling_of(step.config), salt=salt, priority=self.priority
        )
        target.created = True
        parts: list[str] = []
        finish = None
        before = self.tokens
        try:  # what contextlib.aclosing does, without its objects and awaits
            async for delta in stream:
                if delta.token_id is not None:
                    self.tokens += 1
                if delta.text:
                    parts.append(delta.text)
                    await on_token(step, delta)
                finish = delta.finish_reason
        except BaseException:
            await stream.aclose()  # (a stream that ran to its end has nothing to close)
            raise
        value = "".join(parts)
        self.output_tokens[step.output] = self.tokens - before
        self.finishes[step.output] = finish
        await on_value(step, value)
        if fork and finish == "stop":
            target = cur.child()
            await self._fill(target, self.tokenize(value))
        return target

    async def _fill(self, ctx: _Ctx, tokens: list[int], copy: bool = True) -> None:
        """Fill `tokens` into `ctx`; copied first unless `copy` is false (a list of the
        caller's own: plans and cached tokens are shared and must not reach the engine)."""
        if not tokens:
            return  # an uncreated context stays lazy: the next request forks it
        parent, salt = self._request(ctx)
        await self.engine.fill(
            ctx.id, parent, list(tokens) if copy else tokens, salt=salt, priority=self.priority
        )
        ctx.created = True

    def _request(self, ctx: _Ctx) -> tuple[Hashable | None, str | None]:
        """The parent and salt of a request to `ctx`; the runner owns `ctx` from then on
        (it frees what it owns)."""
        if not ctx.owned:
            ctx.owned = True
            self.owned.append(ctx)
        if ctx.created:
            return None, None  # it exists: no parent, and its salt was given at creation
        # a new context: forked from its parent (whose salt it inherits), or salted
        return ctx.parent, self.salt if ctx.parent is None else None

    async def free(self) -> None:
        """Free the contexts this call created, newest (children) first."""
        for ctx in reversed(self.owned):
            try:
                await self.engine.free(ctx.id)
            except ContextNotFound:
                pass
        self.owned.clear()


async def run_call(
    m: Manager, r: ReadyCall, engine_id: str, objective: Criterion, group: int | None
) -> None:
    """Run the ready call `r` on `engine_id` to its end (the module doc says which ends)."""
    run, name = r.run, r.name
    events = m.transitions
    priority = PRIORITY[objective]
    runner = CallRunner(m.engines[engine_id], run.salt, priority, m.tokens.value)
    attached = Attached(None, 0)  # (until attach returns: no prefix, nothing pending)
    error: str | None = None
    claim: asyncio.Task[object] | None = None
    try:
        started = {"call": name, "engine": engine_id, "objective": objective, "group": group}
        if m.listeners:
            # `call_started` is recorded (in a store: this process's claim on the call)
            # while the engine starts: the call's first token and value wait for it, so no
            # one sees the call before its start. Awaiting it first held the engine back
            # by a commit, and a fan-out's calls by one commit each in turn (the run's
            # events are written in order): 8 calls' last one started ~50 ms late
            claim = asyncio.ensure_future(events.emit(run, "call_started", started))
        else:  # what `emit` does without listeners, without a coroutine
            run.log.append("call_started", started)
        try:
            # attach first: it pins the prefixes this call uses, so making room for the
            # rest of the call cannot evict them
            if r.shared:
                attached = await m.sharing.attach(
                    engine_id, r.shared, r.plan.prompt, run.salt, priority
                )
            else:  # what attach gives for no prefixes, without its coroutine
                attached = Attached(None, 0)
            if m.sharing.table.has_idle(engine_id):  # make_room's own first test
                await m.sharing.make_room(engine_id, r.plan.n_tokens - attached.n_tokens)

            async def on_token(step: Step, delta: TokenDelta) -> None:
                if attached.pending:  # a prefix fill it did not wait for: failed, it fails
                    await attached.settle()
                if claim is not None:
                    await claim  # (done after the first token: no wait)
                await events.emit(
                    run,
                    "token",
                    {
                        "call": name,
                        "variable": step.output,
                        "text": delta.text,
                        "token_id": delta.token_id,
                    },
                )

            async def on_value(step: Step, value: str) -> None:
                if attached.pending:
                    await attached.settle()
                if claim is not None:
                    await claim
                await events.set_value(run, step.output, value, source="call", call=name)

            known: dict[str, str] = {}  # outputs recovered (a store's resume) are filled
            values = run.values
            for o in run.program.calls[name].outputs:
                if o in values:
                    known[o] = values[o]
            await runner.run(
                r.plan, attached.context_id, attached.n_tokens, known, on_token, on_value
            )
            await attached.settle()
            if claim is not None:
                await claim
        except Exception:
            # the call's own error, unless its start could not be recorded because another
            # manager holds the call: then the run is theirs (below)
            if claim is not None and await _claimed_elsewhere(claim):
                await claim  # raises RunOwnedElsewhere
            raise
        finished = {
            "call": name,
            "prompt_tokens": len(r.plan.prompt),
            "completion_tokens": runner.tokens,
            "output_tokens": runner.output_tokens,
            "finish_reasons": runner.finishes,
        }
    except asyncio.CancelledError:
        if claim is not None:
            claim.cancel()  # as cancelling the awaited emit did (its write runs to its end)
        await _cleanup(m, runner, engine_id, attached)
        raise
    except RunOwnedElsewhere:
        # another manager sharing the store holds this call: the run is theirs
        await _cleanup(m, runner, engine_id, attached)
        run.tasks.pop(name, None)
        log.info("run %s is run by another manager; dropping it here", run.run_id)
        await m.abandon(run.run_id)
        return
    except EngineUnavailable:
        # the engine is gone, not the call's fault: retire it and run the call elsewhere
        await _cleanup(m, runner, engine_id, attached)
        log.warning("engine %s unavailable; dispatching its calls elsewhere", engine_id)
        run.tasks.pop(name, None)  # this task ends here: not one for remove_engine to cancel
        await m.remove_engine(engine_id)
        events.requeue(run, name)
        return
    except Exception as exc:  # an engine error fails this call only
        error = f"{type(exc).__name__}: {exc}"
    await _cleanup(m, runner, engine_id, attached)
    try:
        if error is None:
            if m.listeners:
                await events.emit(run, "call_finished", finished)
            else:
                run.log.append("call_finished", finished)
            run.calls[name].state = "finished"
            if run.can_finish():  # (without a coroutine when it cannot)
                await events.maybe_finish(run)
            return
    except Exception as exc:  # e.g. a listener that cannot record the end
        error = f"{type(exc).__name__}: {exc}"
    try:
        await events.fail_calls(run, {name: error})
    except Exception:  # the failure itself cannot be recorded: keep the state honest
        log.exception("run %s: recording the failure of call %r failed", run.run_id, name)
        run.calls[name].state, run.calls[name].error = "failed", error


async def _claimed_elsewhere(claim: asyncio.Task[object]) -> bool:
    """Wait for a call's `call_started` to be recorded; whether it failed because another
    manager holds the call."""
    await asyncio.wait([claim])
    return not claim.cancelled() and isinstance(claim.exception(), RunOwnedElsewhere)


async def _cleanup(m: Manager, runner: CallRunner, engine_id: str, attached: Attached) -> None:
    """Count the call's tokens, free its contexts and release its prefixes (a prefix
    fill it started and did not wait for, still going when it ends, is cancelled)."""
    m.tokens_generated += runner.tokens
    runner.tokens = 0
    try:
        if attached.pending:
            await attached.abandon()
        await runner.free()
        if attached.keys:
            await m.sharing.release(engine_id, attached.keys)
    except EngineUnavailable:  # a dead engine holds nothing any more
        log.info("engine %s unavailable during cleanup", engine_id)
