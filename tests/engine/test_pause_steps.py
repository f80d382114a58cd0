"""A step of only throughput work pauses between layers when a latency request arrives
(`EngineConfig.pause_steps`, on by default on a CPU): the latency request runs first, the
paused step then goes on from its layer, and every request gets the tokens it gets with
no pausing. End to end on the tiny model (2 layers), with the pause made deterministic:
the check between layers waits, the first time, until the latency request has arrived.
Also: a context freed while its step is paused gives its blocks back only when the step
ends (they are pinned), and the scheduler keeps paused requests out of its plans."""

from __future__ import annotations

import asyncio
import json
import threading

import torch

from parrot_backend.contract.sampling import Constraint, SamplingParams
from parrot_backend.engine.block_pool import BlockPool
from parrot_backend.engine.config import EngineConfig, pick_pause
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.scheduler import Scheduler

from .test_background_share import BS, _add

GEN = SamplingParams(max_tokens=6, ignore_eos=True)
# a step paused `background_wait` seconds (2 by default) goes on even with urgent work
# left; the latency requests here may take that long on a loaded machine, and the limit is
# not what these tests are about (test_urgent_linger.py checks it on a fake clock)
NO_LIMIT = {"background_wait": 0}


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


class Gate:
    """Stands in for the engine's pause flag: the first check between layers waits (up to
    30 s) until a more urgent request sets it, so that request arrives mid-step. With
    `when`, only a check in a step whose batch `when(batch)` accepts waits (`watch`)."""

    def __init__(self, wait: float = 30.0, required: bool = True, when=None) -> None:
        self.flag = threading.Event()
        self.entered = threading.Event()
        self.checks = 0
        self.wait, self.required = wait, required
        self.when, self.batch, self.held = when, None, None

    def watch(self, engine) -> None:
        """Note each step's batch as it starts on the compute thread (for `when`)."""
        execute = engine.runner.execute

        def noted(batch, should_pause=None):
            self.batch = batch
            return execute(batch, should_pause)

        engine.runner.execute = noted

    def set(self) -> None:
        self.flag.set()

    def clear(self) -> None:
        self.flag.clear()

    def is_set(self) -> bool:
        self.checks += 1
        if not self.entered.is_set() and (self.when is None or self.when(self.batch)):
            self.held = self.batch
            self.entered.set()
            came = self.flag.wait(self.wait)
            assert came or not self.required, "no urgent request came"
        return self.flag.is_set()


async def _until(cond, what: str) -> None:
    for _ in range(30_000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


async def _drain(rounds: int = 200) -> None:
    """Let every task the event loop has ready run, through chains of up to `rounds` hops
    (a delta goes from the step loop's queue through the engine's generator to its consumer
    in a few): scheduling alone, no clock."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def _gen(engine, cid, prompt, priority, log):
    await engine.fill(cid, None, prompt, priority=priority)
    tokens = []
    async for d in engine.generate(cid, None, GEN, priority=priority):
        if d.token_id is not None:
            tokens.append(d.token_id)
        log.append(cid)
    await engine.free(cid)
    return tokens


def _reference(tiny_model_dir, prompts):
    """Each prompt alone, on an engine that never pauses."""

    async def go():
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=128, pause_steps=False)
        async with engine:
            return [await _gen(engine, f"r{i}", p, 1, []) for i, p in enumerate(prompts)]

    return asyncio.run(go())


def test_a_throughput_step_pauses_for_a_latency_request_and_both_get_their_tokens(
    tiny_model_dir,
):
    bulk_prompt, urgent_prompt = _prompt(300, 1), _prompt(12, 2)
    expected = _reference(tiny_model_dir, [bulk_prompt, urgent_prompt])

    async def go():
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=128, progress=False, **NO_LIMIT)
        assert engine.pause_steps  # the CPU default
        gate = engine._pause_flag = Gate()
        log: list[str] = []
        async with engine:
            bulk = asyncio.create_task(_gen(engine, "bulk", bulk_prompt, 1, log))
            await _until(gate.entered.is_set, "the throughput step")
            urgent = await _gen(engine, "urgent", urgent_prompt, 0, log)
            done_while_paused = engine._paused is not None
            tokens = await bulk
            return urgent, tokens, log, done_while_paused, engine.steps_paused, engine.stats_now()

    urgent, bulk, log, done_while_paused, paused, stats = asyncio.run(go())
    assert paused >= 1
    # the latency request ran to its end while the throughput step waited, paused
    assert done_while_paused
    assert log.index("bulk") > max(i for i, c in enumerate(log) if c == "urgent")
    assert [bulk, urgent] == expected
    assert stats.blocks_used == 0 and stats.contexts == 0 and stats.running == 0


def test_a_context_freed_while_its_step_is_paused_keeps_its_blocks_from_others(
    tiny_model_dir,
):
    """The pool holds the paused fill's blocks and two more: the latency request needs
    three, so it gets one of the freed context's blocks, but only once the paused step,
    which still writes them, has ended; its tokens are those it gets alone."""
    bulk_prompt, urgent_prompt = _prompt(300, 3), _prompt(40, 4)  # 19 and 3 blocks
    (expected,) = _reference(tiny_model_dir, [urgent_prompt])

    async def go():
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=21, progress=False, **NO_LIMIT)
        gate = engine._pause_flag = Gate()
        resume, release = engine._resume, asyncio.Event()

        async def held(**kw):  # the paused step goes on once the test has freed its context
            await release.wait()
            await resume(**kw)

        engine._resume = held
        async with engine:
            bulk = asyncio.create_task(engine.fill("bulk", None, bulk_prompt, priority=1))
            await _until(gate.entered.is_set, "the throughput step")
            urgent = asyncio.create_task(_gen(engine, "urgent", urgent_prompt, 0, []))
            await _until(lambda: engine._paused is not None, "the pause")
            bulk.cancel()
            await asyncio.gather(bulk, return_exceptions=True)
            await engine.free("bulk")
            freed = engine.stats_now().blocks_free  # the paused step's blocks stay pinned
            release.set()
            tokens = await urgent
            return tokens, freed, engine.error, engine.stats_now()

    tokens, freed, error, stats = asyncio.run(go())
    assert error is None
    assert freed == 2
    assert tokens == expected
    assert stats.blocks_used == 0 and stats.contexts == 0


def _paused_scheduler(clock=lambda: 100.0, **kw) -> tuple[Scheduler, list]:
    s = Scheduler(
        BlockPool(64, BS),
        max_num_seqs=8,
        max_batched_tokens=256,
        copy_block=lambda src, dst: None,
        contexts={},
        background_tokens=0,
        background_share=0.0,
        clock=clock,
        **kw,
    )
    bulk = [_add(s, f"b{i}", 40, 1, kind="fill") for i in range(2)]
    s._admit()
    s.paused = {id(r) for r in bulk}
    s.paused_priority = 1
    return s, bulk


def test_paused_requests_stay_out_of_plans_and_come_back_when_nothing_is_more_urgent():
    s, bulk = _paused_scheduler()
    work, _, _ = s.schedule()
    assert work == [] and s.resume_paused  # only the paused step could run: it goes on
    _add(s, "other", 40, 1, kind="fill")  # as urgent as the paused step
    work, _, _ = s.schedule()
    assert work == [] and s.resume_paused
    urgent = _add(s, "urgent", 20, 0, kind="fill")
    work, _, _ = s.schedule()
    assert not s.resume_paused
    assert {w.req.ctx.id for w in work} == {"urgent"}  # the paused ones are not planned
    assert all(r in s.running for r in bulk)
    s.remove(urgent)
    s.paused, s.paused_priority = set(), None
    work, _, _ = s.schedule()
    assert {w.req.ctx.id for w in work} == {"b0", "b1", "other"}


def test_a_paused_request_is_never_preempted_to_admit_a_more_urgent_one():
    s, bulk = _paused_scheduler()
    s.max_num_seqs = 2  # full: the two paused requests
    urgent = _add(s, "urgent", 20, 0, kind="fill")
    work, _, _ = s.schedule()
    assert work == [] and s.resume_paused  # it waits for the paused step
    assert s.preemptions == 0 and urgent in s.waiting


def test_the_pause_waits_out_a_hold_before_resuming():
    now = [100.0]
    s, _ = _paused_scheduler(clock=lambda: now[0], linger=0.25, hold=0.03)
    urgent = _add(s, "urgent", 20, 0, kind="fill")
    s._admit()
    s.remove(urgent)  # a latency call just ended: its chain's next call is on its way
    work, _, _ = s.schedule()
    assert work == [] and not s.resume_paused and s.wake_at == 100.03
    now[0] += 0.04
    s.schedule()
    assert s.resume_paused


def test_pause_steps_by_device():
    assert pick_pause(EngineConfig(), torch.device("cpu")) is True
    assert pick_pause(EngineConfig(), torch.device("cuda")) is False
    assert pick_pause(EngineConfig(pause_steps=False), torch.device("cpu")) is False


def _hold_steps(engine, when):
    """Hold a step on the compute thread, before it runs, while `when()` says so, until
    the returned event is set; the second event says a step is being held."""
    release, held = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def gated(batch, should_pause=None):
        if when():
            held.set()
            assert release.wait(30), "the test never released the step"
        return execute(batch, should_pause)

    engine.runner.execute = gated
    return release, held


def test_a_step_with_forks_that_joined_its_fill_does_not_pause(tiny_model_dir):
    """A fork that joins its parent's fill step without work of its own would be planned
    during a pause over the parent's half-written KV: such a step never pauses, and the
    fork generates what it generates with no urgent request around."""
    parent = _prompt(40, 11)

    async def go(urgent: bool):
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=128, progress=False, **NO_LIMIT)
        release, held = _hold_steps(engine, lambda: bool(engine.scheduler.joined))
        if not urgent:
            release.set()
        async with engine:
            fill = asyncio.ensure_future(engine.fill("p", None, parent, priority=1))
            fork = asyncio.ensure_future(_tokens(engine, "d", "p", 0))
            if urgent:
                await _until(held.is_set, "the joined step")
                seen = engine.submitted
                x = asyncio.create_task(engine.fill("x", None, _prompt(12, 12), priority=0))
                await _until(lambda: engine.submitted > seen, "the urgent request")
                release.set()
                await x
            tokens = await fork
            await fill
            return tokens, engine.steps_paused, engine.error

    expected, _, _ = asyncio.run(go(False))
    tokens, paused, error = asyncio.run(go(True))
    assert error is None and paused == 0
    assert tokens == expected


async def _tokens(engine, cid, parent, priority):
    out = []
    async for d in engine.generate(cid, parent, GEN, priority=priority):
        if d.token_id is not None:
            out.append(d.token_id)
    return out


def test_only_one_step_is_paused_at_a_time(tiny_model_dir):
    """Three priorities: a step of priority 2 pauses for a priority-1 request, whose step,
    run during the pause, does not pause for a priority-0 one (a second pause would lose
    the first's pinned blocks); everything completes and no block stays used."""
    prompts = {"a": _prompt(300, 1), "x": _prompt(100, 2), "y": _prompt(12, 3)}
    expected = _reference(tiny_model_dir, list(prompts.values()))

    async def go():
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=128, progress=False, **NO_LIMIT)
        gate = engine._pause_flag = Gate()
        release, held = _hold_steps(engine, lambda: engine._paused is not None)
        async with engine:
            a = asyncio.create_task(_gen(engine, "a", prompts["a"], 2, []))
            await _until(gate.entered.is_set, "a's step")
            x = asyncio.create_task(_gen(engine, "x", prompts["x"], 1, []))
            await _until(held.is_set, "a step during the pause")
            seen = engine.submitted
            y = asyncio.create_task(_gen(engine, "y", prompts["y"], 0, []))
            await _until(lambda: engine.submitted > seen, "y")  # while x's step is held
            release.set()
            got = await asyncio.gather(a, x, y)
            return got, engine.steps_paused, engine.error, engine.stats_now()

    got, paused, error, stats = asyncio.run(go())
    assert error is None and paused == 1
    assert got == expected
    assert stats.blocks_used == 0 and stats.contexts == 0


def test_a_paused_step_that_fails_when_resumed_retries_its_rows(tiny_model_dir):
    bulk_prompt, urgent_prompt = _prompt(300, 5), _prompt(12, 6)
    expected = _reference(tiny_model_dir, [bulk_prompt, urgent_prompt])

    async def go():
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=128, progress=False, **NO_LIMIT)
        gate = engine._pause_flag = Gate()
        resume, calls = engine.runner.resume, []

        def fails_once(*args, **kw):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("the device hiccuped")
            return resume(*args, **kw)

        engine.runner.resume = fails_once
        async with engine:
            bulk = asyncio.create_task(_gen(engine, "bulk", bulk_prompt, 1, []))
            await _until(gate.entered.is_set, "the throughput step")
            urgent = await _gen(engine, "urgent", urgent_prompt, 0, [])
            return [await bulk, urgent], len(calls), engine.error, engine.stats_now()

    got, calls, error, stats = asyncio.run(go())
    assert calls == 1 and error is None
    assert got == expected  # the bulk's rows were computed again, one by one
    assert stats.blocks_used == 0


def test_a_request_that_must_wait_anyway_does_not_pause_the_step(tiny_model_dir):
    """A latency fork of the context the running step fills cannot run before that fill
    ends: it does not pause the step (which would only resume at once)."""
    parent = _prompt(300, 7)

    async def go():
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=128, progress=False, **NO_LIMIT)
        gate = engine._pause_flag = Gate(wait=0.5, required=False)
        async with engine:
            fill = asyncio.create_task(engine.fill("p", None, parent, priority=1))
            await _until(gate.entered.is_set, "the fill's step")
            tokens = await _tokens(engine, "d", "p", 0)
            await fill
            return tokens, engine.steps_paused, gate.flag.is_set(), engine.error

    tokens, paused, flagged, error = asyncio.run(go())
    assert error is None and paused == 0 and not flagged
    assert len(tokens) == GEN.max_tokens


def test_the_hold_is_only_for_work_less_urgent_than_the_request_that_ended():
    """A request as urgent as the paused step ending (a cancelled throughput call) starts
    no hold before the paused step goes on; a more urgent one does."""
    now = [100.0]
    s, _ = _paused_scheduler(clock=lambda: now[0], linger=0.25, hold=0.03)
    peer = _add(s, "peer", 20, 1, kind="fill")
    s._admit()
    s.remove(peer)
    work, _, _ = s.schedule()
    assert work == [] and s.resume_paused and s.wake_at is None


SCHEMA = {
    "type": "object",
    "properties": {
        "title_of_the_document": {"type": "string", "maxLength": 12},
        "number_of_pages_in_total": {"type": "integer", "minimum": 1, "maximum": 999},
    },
    "required": ["title_of_the_document", "number_of_pages_in_total"],
}


def test_a_paused_step_of_drafted_and_constrained_rows_gives_their_plain_tokens(
    tiny_model_dir,
):
    """Two throughput generations under grammars (a JSON schema, whose forced keys and
    quotes are drafted, and a sampled regex) pause in a decode step that checks drafts
    under grammar masks; the latency request runs during the pause, and the paused step
    then goes on. Every generation yields what it yields with no drafts and no pausing:
    the masks were built before the step and the drafts are judged after it ends."""
    bulk = [
        (
            _prompt(20, 21),
            SamplingParams(max_tokens=40, constraint=Constraint("json_schema", json.dumps(SCHEMA))),
        ),
        (
            _prompt(24, 22),
            SamplingParams(
                max_tokens=16,
                temperature=0.8,
                seed=8,
                constraint=Constraint("regex", "[a-z ]{1,40}"),
            ),
        ),
    ]
    # the latency request is constrained too: its masks are computed during the pause
    urgent = (
        _prompt(12, 23),
        SamplingParams(max_tokens=30, constraint=Constraint("json_schema", json.dumps(SCHEMA))),
    )

    async def generate(engine, cid, prompt, sampling, priority, log):
        await engine.fill(cid, None, prompt, priority=priority)
        out = []
        async for d in engine.generate(cid, None, sampling, priority=priority):
            if d.token_id is not None:
                out.append(d.token_id)
            log.append((cid, len(out)))  # (whose delta, its tokens so far)
        await engine.free(cid)
        return out

    async def plain():
        engine = Engine.from_pretrained(
            tiny_model_dir, num_blocks=128, progress=False, pause_steps=False, speculate=0
        )
        async with engine:
            got = await asyncio.gather(
                *(generate(engine, f"b{i}", p, s, 1, []) for i, (p, s) in enumerate(bulk))
            )
            return [*got, await generate(engine, "u", *urgent, 0, [])]

    def drafting_and_constrained(batch) -> bool:
        rows = [i for i, d in enumerate(batch.drafts) if d]
        return bool(rows) and any(
            batch.samplers[i] is not None and batch.samplers[i].grammar is not None for i in rows
        )

    async def paused():
        engine = Engine.from_pretrained(
            tiny_model_dir,
            num_blocks=128,
            progress=False,
            speculate=4,
            speculate_rows=8,
            **NO_LIMIT,
        )
        gate = engine._pause_flag = Gate(when=drafting_and_constrained)
        gate.watch(engine)
        log: list[str] = []
        async with engine:
            tasks = [
                asyncio.create_task(generate(engine, f"b{i}", p, s, 1, log))
                for i, (p, s) in enumerate(bulk)
            ]
            await _until(gate.entered.is_set, "a drafted, constrained throughput step")
            # the deltas of the steps before the pause may still be on their way to their
            # consumers (queued, not yet logged); the paused step yields nothing until the
            # latency request comes, so let every ready consumer run before marking the log
            await _drain()
            at_pause = len(log)
            alone = await generate(engine, "u", *urgent, 0, log)
            during = engine._paused is not None
            got = await asyncio.gather(*tasks)
            return [*got, alone], gate.held, during, log[at_pause:], engine.steps_paused, engine

    expected = asyncio.run(plain())
    got, held, during, log, steps_paused, engine = asyncio.run(paused())
    assert steps_paused >= 1 and during
    assert sum(len(d) for d in held.drafts if d) > 0  # the paused step checked drafts
    # from the pause on, the latency request ran to its end before any throughput token
    # was computed: the only throughput deltas among its own are first tokens sampled from
    # a fill's kept last state (no KV computed), which ride along with its steps (a
    # generation that arrived after the paused step began)
    last_urgent = max(i for i, (cid, _) in enumerate(log) if cid == "u")
    assert ("u", 1) in log  # all of it: from its first token
    assert all(cid == "u" or n == 1 for cid, n in log[:last_urgent]), log[:last_urgent]
    assert got == expected
    s = engine.stats_now()
    assert s.draft_tokens_accepted > 0 and s.blocks_used == 0 and s.contexts == 0
    assert set(json.loads(engine.detokenize(got[0]))) == set(SCHEMA["properties"])
