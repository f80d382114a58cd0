"""The step loop: continuous batching of an engine's requests, one step at a time.

Each iteration asks the scheduler for the step's work (prefill chunks and decode steps
under a token budget, preempting when blocks run out), binds the grammar states of
constrained requests, computes the step on the compute thread, and hands each request
its result: a fill finishes when its tokens have KV, a generation gets its next token
(`TokenDelta`) and ends on EOS, a stop token or string, its grammar's end, or its length.

Every torch operation of the engines in a process runs on one thread
(`compute_executor`). A step's inputs are copied out of the contexts before it runs
(`ModelRunner.prepare`), so a context freed or cancelled meanwhile changes nothing it
computes. A failing step is retried one sequence at a time (`StepLoop._step`).

A step with only less urgent work (throughput calls) runs layer by layer where
`EngineConfig.pause_steps` is on (CPU by default): when a more urgent request arrives
while it runs, it stops after the current layer (`runner.Paused`), its blocks pinned, and
the loop plans and runs steps of the more urgent work; the paused step goes on from that
layer once nothing more urgent can run (or after `background_wait` seconds paused, then
without pausing again), and its rows get their results as if it had never paused. A
CPU throughput step is up to ~0.4 s (512 prefill tokens); a latency call arriving during
it waited ~0.2 s on average for it, now one layer (~15 ms of 30).

`StepLoop` is the part of `Engine` that runs the loop; it uses the engine's scheduler,
runner, pool, thread tuner, grammar compiler and counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from parrot_backend.contract.engine import TokenDelta
from parrot_backend.contract.errors import EngineDead, EngineError, StepFailed

from .block_pool import BlockPool
from .context import Request
from .grammar import GrammarCompiler, GrammarError
from .runner import Batch, ModelRunner, Paused, StepResult
from .sampler import grammar_masks
from .scheduler import Scheduler, Work
from .threads import ThreadTuner

log = logging.getLogger(__name__)

# After requests end, the loop gives up event-loop passes before it plans the next step,
# until this many passes in a row brought no new request: a task awaiting a resolved
# future runs a pass or two later, and one woken through `asyncio.shield` (the calls that
# wait for another call's prefix fill) two passes after that. Measured on the shared-
# prompt workload: the call that filled the prefix submits its fork on the 2nd pass, the
# 7 calls waiting for that fill on the 4th; a fixed 3 passes planned a step of the first
# fork alone (~65 ms on 2 cores) and then a decode step for it next to the others' first
# tokens (~65 ms where sampling from kept states alone takes ~10 ms).
YIELDS_AFTER_END = 3
# ... and never more than this many passes in all (a steady stream of new requests would
# otherwise hold the step back)
MAX_YIELDS_AFTER_END = 16

_compute: ThreadPoolExecutor | None = None


def compute_executor() -> ThreadPoolExecutor:
    """The one thread that runs every torch operation of the engines in this process.

    On CPU, torch parallelises with OpenMP, and each calling thread gets its own team of
    worker threads. Once two threads have run torch code, the teams outnumber the cores
    and OpenMP stops spin-waiting: every matmul then wakes threads from sleep and runs
    about 1.8x slower (measured here on 2 cores), in every thread. Loading and computing
    on one dedicated thread keeps one team.
    """
    global _compute
    if _compute is None:
        _compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parrot-compute")
    return _compute


@dataclass(slots=True)
class PausedStep:
    """A step paused for more urgent work, and what its results need when it ends."""

    work: list[Work]
    state: Paused
    joined: dict  # the scheduler's `joined` of the plan that made it
    pinned: list[int]  # blocks it reads or writes, held until it ends
    since: float  # when it first paused


class StepLoop:
    """The batching loop of an `Engine` (see the module doc); `Engine` sets these."""

    scheduler: Scheduler
    runner: ModelRunner
    pool: BlockPool
    threads: ThreadTuner
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    steps: int
    tokens_computed: int
    prefill_tokens_computed: int
    tokens_generated: int
    drafted: int  # draft tokens checked (`speculate.py`)
    draft_accepted: int  # of those, kept
    ended: int  # requests finished (or failed) so far
    submitted: int  # requests submitted so far
    _seen_ended: int  # `ended` when the last step was planned
    error: BaseException | None
    _grammars: GrammarCompiler | None
    _wake: asyncio.Event
    _stopping: bool
    _fail_at_step: int | None
    pause_steps: bool  # run less urgent steps so that they can pause (the module doc)
    steps_paused: int  # pauses so far
    _paused: PausedStep | None
    # while a pausable step runs: the priority a request must be under to pause it
    _pause_below: int | None
    _pause_flag: threading.Event  # read by the compute thread between layers

    def _bind_grammar(self, req: Request) -> None:
        """Give a constrained request its grammar state when it first runs: the context's
        own state if it continues one (same constraint, nothing filled since, not finished;
        a fork's copy of its parent's counts), else a fresh one."""
        ctx, constraint = req.ctx, req.sampling.constraint
        state = ctx.grammar
        if (
            state is None
            or state.key != constraint.key
            or state.end != len(ctx.tokens)
            or state.stopped
        ):
            state = self._grammars.start(constraint, len(ctx.tokens))
            ctx.grammar = state
        req.sampler.grammar = state

    def _submit(self, req: Request) -> None:
        self.submitted += 1
        req.ctx.queue.append(req)
        self.scheduler.add(req)
        if (
            self._pause_below is not None
            and req.priority < self._pause_below
            and req.ctx.queue[0] is req
            and (req.ctx.attached or not req.ctx.parent.busy)
        ):
            # the running step stops after its current layer (not for a request that must
            # wait anyway: behind another on its context, or a fork of a busy parent)
            self._pause_flag.set()
        self._wake.set()

    def _cancel(self, req: Request) -> None:
        if req.done:
            return
        req.done = True
        self.scheduler.remove(req)
        if req in req.ctx.queue:
            req.ctx.queue.remove(req)
        if req.future is not None and not req.future.done():
            req.future.cancel()  # its caller was cancelled: nobody waits for an error
        self._wake.set()

    def _finish(self, req: Request) -> None:
        self.ended += 1
        req.done = True
        self.scheduler.remove(req)
        if req in req.ctx.queue:
            req.ctx.queue.remove(req)
        self._wake.set()  # the next request on this context (or a child) may run now

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.done:
            return
        self._finish(req)
        if req.future is not None and not req.future.done():
            req.future.set_exception(exc)
        if req.out is not None:
            req.out.put_nowait(exc)

    async def _loop(self) -> None:
        try:
            while not self._stopping:
                if self.ended != self._seen_ended:
                    # requests ended since the last plan: let their callers run before the
                    # next one, so that a call's next request (the fork after its prefix's
                    # fill, the generation after its prompt's) is in it, with its priority,
                    # instead of a step of less urgent work planned without it (a future
                    # resolved here wakes its awaiting task a loop pass or two later)
                    self._seen_ended = self.ended
                    await self._let_callers_run()
                    if self._stopping:  # stop() set the wake-up meanwhile: clearing it
                        break  # below would lose it
                if self._paused is not None and self._paused_too_long():
                    await self._resume(pausable=False)  # less urgent work's turn
                    continue
                work, finished, failed = self.scheduler.schedule()
                for req in finished:
                    self._finish(req)
                    req.future.set_result(len(req.ctx.tokens))
                for req, exc in failed:
                    self._fail(req, exc)
                if not work:
                    if finished or failed:
                        continue
                    if self.scheduler.resume_paused:
                        await self._resume(pausable=True)
                        continue
                    self._wake.clear()
                    if self.scheduler.wake_at is None:
                        await self._wake.wait()
                    else:  # less urgent work is held back for a moment (`urgent_hold`)
                        held = self.scheduler.wake_at - time.monotonic()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), max(held, 0.0))
                    # woken from idle by a request: let its caller's next ones in too (a
                    # fork submitted just after its parent's fill joins the fill's step)
                    await self._let_callers_run()
                    continue
                if self._fail_at_step is not None and self.steps >= self._fail_at_step:
                    raise RuntimeError(f"injected fault at step {self.steps}")
                work = self._bind_grammars(work)
                results = await self._step(work)
                if isinstance(results, Paused):
                    self._pause(work, results)
                    continue
                self._postprocess(work, results)
        except Exception as exc:  # a device failure or a bug: no request is at fault
            log.exception("engine loop died")
            self.error = exc
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._fail(req, EngineDead(f"engine failed: {exc!r}"))
        finally:
            if self._paused is not None:  # stopped with a step paused: it never ends
                self._unpause()

    def _pause(self, work: list[Work], state: Paused) -> None:
        """Keep a step that paused between layers: its requests leave the plans, and its
        blocks are pinned (a context freed meanwhile must not hand them to another
        request, which the rest of the step would overwrite)."""
        pinned = sorted({b for table in state.batch.tables for b in table})
        for b in pinned:
            self.pool.incref(b)
        s = self.scheduler
        s.paused = {id(w.req) for w in work}
        s.paused_priority = min(w.req.priority for w in work)
        self._paused = PausedStep(work, state, s.joined, pinned, time.monotonic())
        s.joined = {}
        self.steps_paused += 1

    def _unpause(self) -> None:
        paused, self._paused = self._paused, None
        for b in paused.pinned:
            self.pool.decref(b)
        self.scheduler.paused = set()
        self.scheduler.paused_priority = None

    def _paused_too_long(self) -> bool:
        wait = self.scheduler.background_wait
        return bool(wait) and time.monotonic() - self._paused.since >= wait

    async def _resume(self, *, pausable: bool) -> None:
        """Go on with the paused step (it may pause again if `pausable`); when it ends,
        its rows get their results. A request that ended while it was paused (cancelled,
        its context freed) gets nothing, and its context counts none of the step's KV."""
        paused = self._paused
        if all(w.req.done for w in paused.work):  # nobody waits for the rest of it
            self._unpause()
            return
        loop = asyncio.get_running_loop()
        self._pause_flag.clear()
        self._pause_below = self.scheduler.paused_priority if pausable else None
        try:
            results = await loop.run_in_executor(
                compute_executor(), self._compute_resume, paused.state, pausable
            )
        except Exception as exc:
            log.warning("a paused step failed when resumed (%r); retrying its rows", exc)
            self._unpause()
            # every row: one that ended meanwhile gets StepFailed, so work that depends
            # on it in the step fails too
            results = await self._retry_rows(paused.work)
            self._postprocess(paused.work, results, paused.joined, resumed=True)
            return
        finally:
            self._pause_below = None
        if isinstance(results, Paused):
            self.steps_paused += 1
            return  # paused again, where it now stands
        self._unpause()
        self._postprocess(paused.work, results, paused.joined, resumed=True)

    async def _let_callers_run(self) -> None:
        """Yield event-loop passes until `YIELDS_AFTER_END` in a row bring no new request
        (at most `MAX_YIELDS_AFTER_END`): the callers of requests that just ended, and the
        tasks waiting on them, submit their next requests into the step about to be planned.
        """
        quiet = passes = 0
        while quiet < YIELDS_AFTER_END and passes < MAX_YIELDS_AFTER_END:
            seen = self.submitted
            await asyncio.sleep(0)
            passes += 1
            quiet = 0 if self.submitted != seen else quiet + 1

    def _bind_grammars(self, work: list[Work]) -> list[Work]:
        """Bind the grammar states of constrained requests starting in this step (on the loop
        thread, between steps: the compute thread never sees a state change under it)."""
        keep = work
        for w in work:
            req = w.req
            if req.sampler is None or req.sampler.grammar is not None:
                continue
            if req.sampling.constraint is None:
                continue
            try:
                self._bind_grammar(req)
            except GrammarError as exc:  # evicted from the cache and now refused: unlikely
                self._fail(req, exc)
                keep = [x for x in keep if x.req is not req]
        return keep

    async def _step(self, work: list[Work]) -> list[StepResult] | Paused:
        """Compute one step; returns each sequence's token, error or nothing (or the step
        paused between layers: the module doc).

        The step's inputs are copied out of the contexts before it runs (`prepare`), so a
        context freed or cancelled while it runs changes nothing it computes. A forward
        pass that fails is retried one sequence at a time: a request that breaks it fails
        alone (`StepFailed`) and the others go on. When every sequence fails alone too,
        a probe of the device decides: if the device is broken the loop dies (requests
        end with `EngineDead` and the manager keeps their calls), else the requests fail.
        """
        loop = asyncio.get_running_loop()
        runner = self.runner
        # not while another step is paused (one paused step at a time), nor with forks that
        # joined a fill of this step: a fork without work of its own in it holds the
        # fill's blocks, which a plan made during the pause would read half written
        pausable = (
            self.pause_steps
            and self._paused is None
            and not self.scheduler.joined
            and any(w.n for w in work)
        )
        self._pause_flag.clear()
        self._pause_below = min(w.req.priority for w in work) if pausable else None
        try:
            return await loop.run_in_executor(
                compute_executor(), self._compute, runner.prepare(work), pausable
            )
        except Exception as exc:
            log.warning(
                "a step of %d sequence(s) failed (%r); retrying them one by one", len(work), exc
            )
        finally:
            self._pause_below = None
        return await self._retry_rows(work)

    async def _retry_rows(self, work: list[Work]) -> list[StepResult]:
        """A failed step's rows, computed one at a time (`_step`)."""
        loop = asyncio.get_running_loop()
        runner = self.runner
        results: list[StepResult] = []
        for w in work:
            if w.req.done or w.req.ctx.freed:  # cancelled or freed meanwhile: nothing to do
                # (not None: its tokens are not computed, and must not be marked so)
                results.append(StepFailed("cancelled while its step was retried"))
                continue
            try:
                results.extend(
                    await loop.run_in_executor(
                        compute_executor(), self._compute, runner.prepare([w])
                    )
                )
            except Exception as exc:
                results.append(StepFailed(f"computing this request failed: {exc!r}"))
        if all(isinstance(r, BaseException) for r in results):
            await loop.run_in_executor(compute_executor(), self._probe_device)
        return results

    def _compute(self, batch: Batch, pausable: bool = False) -> list[StepResult] | Paused:
        """One step on the compute thread, with the thread count the tuner picks."""
        samplers = [s for s in batch.samplers if s is not None] + [s for _, _, s in batch.kept]
        for s in samplers:
            if s.logprobs:  # a retried step's rows sample again: this step's entries only
                s.logprobs.clear()
        constrained = [s for s in samplers if s.grammar is not None]
        if constrained:  # one bitmask for every constrained row of the step (and its drafts)
            drafts = {id(s): d for s, d in zip(batch.samplers, batch.drafts, strict=True) if s}
            masks = grammar_masks(
                [s.grammar for s in constrained],
                self.vocab_size,
                [drafts.get(id(s)) for s in constrained],
            )
            for sampler, mask in zip(constrained, masks, strict=True):
                sampler.banned = mask
        threads = self.threads.before_step(len(batch.ids))
        began = time.perf_counter()
        out = self.runner.execute(batch, self._pause_flag.is_set if pausable else None)
        if not isinstance(out, Paused):  # a paused step's time is not a step's time
            self.threads.after_step(threads, time.perf_counter() - began, len(batch.ids))
        return out

    def _compute_resume(self, state: Paused, pausable: bool) -> list[StepResult] | Paused:
        """The rest of a paused step, on the compute thread."""
        self.threads.before_step(len(state.batch.ids))
        return self.runner.resume(state, self._pause_flag.is_set if pausable else None)

    def _probe_device(self) -> None:
        """Raise if the device itself is broken (a CUDA error poisons every later op)."""
        x = torch.ones(8, device=self.device, dtype=self.dtype)
        if float((x * 2).sum().item()) != 16.0:
            raise EngineError("device probe computed a wrong result")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _postprocess(
        self,
        work: list[Work],
        sampled: list[StepResult],
        joined: dict | None = None,
        *,
        resumed: bool = False,
    ) -> None:
        """Hand each row of a step its result; `joined`: the forks that joined the plan's
        fills (the scheduler's last plan's); `resumed`: the step paused and went on."""
        self.steps += 1
        bs = self.pool.block_size
        joined = self.scheduler.joined if joined is None else joined
        broken: set[int] = set()  # requests whose work in this step failed
        for w, token in zip(work, sampled, strict=True):
            req, ctx = w.req, w.req.ctx
            pair = joined.get(id(req))
            if pair is not None and id(pair[1]) in broken:
                # a fork that joined its parent's step read the parent's KV of this step
                token = StepFailed("its parent's tokens, computed in the same step, failed")
            if isinstance(token, BaseException):
                broken.add(id(req))
                # this request's computation failed (the step ran without it): its KV is
                # not trusted, so nothing is marked computed
                if not isinstance(token, EngineError):
                    token = StepFailed(f"sampling this request failed: {token!r}")
                self._fail(req, token)
                continue
            self.tokens_computed += w.n  # and a row's kept drafts (`_emit_checked`)
            if req.kind == "fill" or req.prompt_end is None:
                self.prefill_tokens_computed += w.n
            else:  # positions before the generation began are prompt (a recompute too)
                self.prefill_tokens_computed += max(0, min(w.n, req.prompt_end - w.start))
            if ctx.freed or (resumed and req.done):
                # (a request that ended while its step was paused: its context may have
                # run other requests or dropped its KV meanwhile, so the step's KV of it
                # is not counted)
                continue
            before = ctx.num_computed
            ctx.num_computed = w.start + w.n
            if isinstance(token, list):  # a row with drafts: its kept tokens, in order
                self._emit_checked(req, w, token)
                token = None
            for k in range(before // bs, ctx.num_computed // bs):
                # publish blocks that just became full for the token-level prefix cache
                h = self.pool.register(
                    ctx.blocks[k], ctx.block_hash(k), tuple(ctx.tokens[k * bs : (k + 1) * bs])
                )
                if req.scores is not None:
                    self._keep_scores(req, k, h)
            if req.done:
                continue  # cancelled while the step ran
            if req.kind == "fill":
                if isinstance(token, torch.Tensor):  # the last hidden state of its context
                    ctx.last_hidden = (ctx.num_computed, token)
                if req.pending == 0:
                    self._finish(req)
                    req.future.set_result(len(ctx.tokens))
                continue
            if token is None:
                continue
            self._emit(req, token)
        for fork, fill in joined.values():
            if id(fill) in broken:
                if not fork.ctx.freed:
                    self.scheduler.unjoin(fork.ctx)
                self._fail(fork, StepFailed("its parent's fill failed in the step it joined"))

    def _keep_scores(self, req: Request, k: int, h: int) -> None:
        """A scoring fill's just-full block k: keep its tokens' entries with the cached
        block (`BlockPool.keep_scores`), from its first token after the fill's first on
        (the fill's first token and those before have none)."""
        scores, bs = req.scores, self.pool.block_size
        s, lo = scores.start, k * bs
        first = max(0, s + 1 - lo)
        if first >= bs:
            return
        entries = [scores.entries[p - s] if p > s else None for p in range(lo, lo + bs)]
        if all(e is not None for e in entries[first:]):
            self.pool.keep_scores(h, scores.k, first, entries)

    def _emit_checked(self, req: Request, w: Work, tokens: list[int]) -> None:
        """Hand a request the tokens of its row with drafts (`speculate.accept`): the
        drafts it kept, then the model's next token. The kept drafts' KV, computed in the
        step, is good: the context counts it as computed once they are its tokens."""
        self.drafted += len(w.draft)
        self.draft_accepted += len(tokens) - 1
        req.drafter.record(len(w.draft), len(tokens) - 1)
        if req.done:
            return  # cancelled while the step ran
        end = w.start + w.n
        for token in tokens:
            self._emit(req, token)
            if req.done:
                break
        # the drafts' KV, up to the ones now in the context (not past an EOS, a stop or
        # the length, where the generation ended); drafts not kept count only as drafts
        req.ctx.num_computed = min(end + len(tokens) - 1, len(req.ctx.tokens))
        self.tokens_computed += req.ctx.num_computed - end

    def _emit(self, req: Request, token: int) -> None:
        ctx, p = req.ctx, req.sampling
        req.generated += 1
        self.tokens_generated += 1
        finish = None
        grammar = req.sampler.grammar
        # this token's entry of the step's logprobs (`Sampler.logprobs`), in order
        entries = req.sampler.logprobs
        logprob, top = entries.pop(0) if entries else (None, None)
        if token in req.eos_ids or token in p.stop_token_ids:
            text = req.detok.flush()
            finish = "stop"  # (not part of the text; its logprob still goes with it)
        else:
            ctx.tokens.append(token)
            text = req.detok.add(token)
            if grammar is not None:
                try:
                    grammar.consume(token)
                except GrammarError as exc:
                    self._fail(req, exc)
                    return
                grammar.end = len(ctx.tokens)
            if req.detok.stopped:
                finish = "stop"
            elif grammar is not None and grammar.stopped:
                text += req.detok.flush()
                finish = "stop"  # the grammar allows nothing more: done without an EOS step
            elif req.generated >= p.max_tokens or len(ctx.tokens) >= self.max_model_len:
                if grammar is not None and p.constraint.require_complete and not grammar.accepting:
                    self._fail(
                        req,
                        GrammarError(
                            f"the {p.constraint.kind} constraint was not complete after "
                            f"{req.generated} tokens (max_tokens={p.max_tokens}); raise max_tokens"
                        ),
                    )
                    return
                text += req.detok.flush()
                finish = "length"
        if finish is not None:
            self._finish(req)
        req.out.put_nowait(TokenDelta(token, text, finish, logprob, top))
