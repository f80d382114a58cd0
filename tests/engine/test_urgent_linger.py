"""For `linger` seconds after a more urgent request ends, less urgent work keeps to the
background's turn (an eighth of the step budget) per step, so the next call of a latency
chain waits for a small step at most; then it gets full steps again. Planned without a
model, on a fake clock; the engine's default and the check of the setting."""

from __future__ import annotations

import pytest
import torch

from parrot_backend.engine.block_pool import BlockPool
from parrot_backend.engine.config import EngineConfig, pick_linger, pick_share
from parrot_backend.engine.scheduler import Scheduler

from .test_background_share import BS, _add, _decoding


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _scheduler(clock: Clock, linger: float, budget: int = 512, **kw) -> Scheduler:
    kw.setdefault("background_every", 6)
    return Scheduler(
        BlockPool(512, BS),
        max_num_seqs=64,
        max_batched_tokens=budget,
        copy_block=lambda src, dst: None,
        contexts={},
        background_tokens=0,
        linger=linger,
        clock=clock,
        **kw,
    )


def _tokens(s: Scheduler) -> dict[str, int]:
    work, _, _ = s.schedule()
    return {w.req.ctx.id: w.n for w in work}


def _with_a_finished_latency_call(linger: float, **kw):
    clock = Clock()
    s = _scheduler(clock, linger, **kw)
    bulk = [_add(s, f"b{i}", 20, 1) for i in range(12)]
    fill = _add(s, "fill", 1000, 1, kind="fill")
    chain = _add(s, "chain", 20, 0)
    s._admit()
    for r in [*bulk, chain]:
        _decoding(s, r)
    assert _tokens(s) == {"chain": 1}  # the background waits for its turn (share 0)
    s.remove(chain)  # the chain's call ended; its next one is being prepared
    return s, clock, fill


def test_after_a_latency_call_ends_the_background_keeps_to_its_turn_while_lingering():
    s, clock, _ = _with_a_finished_latency_call(linger=0.25)
    plan = _tokens(s)
    # an eighth of 512: the 12 throughput decode rows and 52 prefill tokens, not 500
    assert plan == {**{f"b{i}": 1 for i in range(12)}, "fill": 64 - 12}
    clock.now += 0.1
    assert sum(_tokens(s).values()) == 64
    clock.now += 0.2  # the linger is over: full steps again
    assert _tokens(s)["fill"] == 512 - 12


def test_without_linger_the_background_takes_a_full_step_at_once():
    s, _, _ = _with_a_finished_latency_call(linger=0.0)
    assert _tokens(s)["fill"] == 512 - 12


def test_the_next_latency_call_in_the_linger_runs_beside_the_turn_only():
    s, clock, _ = _with_a_finished_latency_call(linger=0.25)
    _tokens(s)  # a small step while lingering
    clock.now += 0.05
    _add(s, "next", 40, 0, kind="fill")  # the chain's next call arrives
    plan = _tokens(s)
    assert plan["next"] == 40
    assert sum(n for k, n in plan.items() if k != "next") == 40 // 4  # the quarter share


def test_in_the_hold_the_background_waits_and_the_next_call_starts_alone():
    """`hold`: for its first seconds after a latency call ends, the linger plans nothing
    for less urgent work (the loop waits until `wake_at` or a new request); the chain's
    next call arriving in it starts in a step of its own."""
    s, clock, _ = _with_a_finished_latency_call(linger=0.25, hold=0.03)
    assert _tokens(s) == {} and s.wake_at == pytest.approx(100.03)
    clock.now += 0.01
    assert _tokens(s) == {} and s.wake_at == pytest.approx(100.03)
    _add(s, "next", 40, 0, kind="fill")  # the next call, in the hold
    assert _tokens(s) == {"next": 40, **{f"b{i}": 1 for i in range(10)}}  # + the quarter
    assert s.wake_at is None


def test_after_the_hold_the_background_gets_its_turn():
    s, clock, _ = _with_a_finished_latency_call(linger=0.25, hold=0.03)
    assert _tokens(s) == {}
    clock.now += 0.031
    assert sum(_tokens(s).values()) == 64 and s.wake_at is None
    clock.now += 0.25  # and after the linger, full steps
    assert _tokens(s)["fill"] == 512 - 12


def test_a_hold_longer_than_the_linger_ends_with_it():
    s, clock, _ = _with_a_finished_latency_call(linger=0.02, hold=0.5)
    assert _tokens(s) == {} and s.wake_at == pytest.approx(100.02)
    clock.now += 0.021
    assert _tokens(s)["fill"] == 512 - 12


def test_the_background_share_of_a_latency_calls_tokens():
    for share, riding in ((0.25, 10), (0.0, 0), (0.5, 20)):
        s, clock, _ = _with_a_finished_latency_call(linger=0.0, background_share=share)
        clock.now += 1
        _add(s, "next", 40, 0, kind="fill")
        plan = _tokens(s)
        assert plan["next"] == 40
        assert sum(n for k, n in plan.items() if k != "next") == riding, share
    cpu = torch.device("cpu")
    assert pick_share(EngineConfig(background_share=0.25), cpu) == 0.25
    for bad in (-0.1, 1.5, float("nan"), "0.2"):
        with pytest.raises(ValueError, match="background_share"):
            pick_share(EngineConfig(background_share=bad), cpu)


def test_a_background_that_waited_long_enough_gets_its_turn():
    """With no turns by step count and no share (the CPU defaults), less urgent work
    beside a stream of latency decode steps gets an eighth of the budget once it has gone
    `background_wait` seconds without one, then waits again."""
    clock = Clock()
    s = _scheduler(clock, 0.0, background_every=0, background_wait=1.0)
    bulk = [_add(s, f"b{i}", 20, 1) for i in range(4)]
    chain = _add(s, "chain", 20, 0)
    s._admit()
    for r in [*bulk, chain]:
        _decoding(s, r)
    plans = []
    for _ in range(12):  # latency decode steps, 0.125 s apart
        plans.append(_tokens(s))
        clock.now += 0.125
    turns = [i for i, p in enumerate(plans) if len(p) > 1]
    assert turns == [8], plans  # 1.0 s after the background last ran (at the start)
    assert plans[8] == {"chain": 1, **{f"b{i}": 1 for i in range(4)}}


def test_equal_priority_work_is_never_held_back_by_lingering():
    clock = Clock()
    s = _scheduler(clock, linger=0.25)
    a = _add(s, "a", 20, 0)
    _add(s, "b", 700, 0, kind="fill")
    s._admit()
    _decoding(s, a)
    s.remove(a)
    assert _tokens(s) == {"b": 512}


def test_a_less_urgent_end_does_not_shorten_a_more_urgent_linger():
    s, clock, _ = _with_a_finished_latency_call(linger=0.25)
    clock.now += 0.2
    s.remove(s.running[0])  # a throughput row ends (priority 1)
    assert sum(_tokens(s).values()) == 64  # still the latency call's linger (until +0.25)
    clock.now += 0.1
    assert sum(_tokens(s).values()) > 64


def test_the_engine_lingers_a_quarter_second_by_default_and_checks_the_setting():
    assert EngineConfig().urgent_linger == 0.25
    assert pick_linger(0) == 0.0
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="urgent_linger"):
            pick_linger(bad)


def _engine_steps_after_a_latency_call(
    tiny_model_dir, linger: float, hold: float = 0.0
) -> list[int]:
    """On the tiny engine (512 positions), steps of 128 tokens: a throughput fill of 480
    tokens runs; a latency call (fill and 3 tokens) comes and ends; the token counts of the
    fill's steps after that end."""
    import asyncio

    import torch

    from parrot_backend.contract.sampling import SamplingParams
    from parrot_backend.engine.engine import Engine

    engine = Engine.from_pretrained(
        tiny_model_dir,
        num_blocks=256,
        max_batched_tokens=128,
        urgent_linger=linger,
        urgent_hold=hold,
        progress=False,
    )
    steps: list[tuple[bool, int]] = []  # (latency work in it, throughput tokens)
    step = engine._step

    async def logged(work):
        urgent = any(w.req.priority == 0 for w in work)
        steps.append((urgent, sum(w.n for w in work if w.req.priority == 1)))
        return await step(work)

    engine._step = logged
    ids = torch.randint(3, 200, (510,), generator=torch.Generator().manual_seed(1)).tolist()

    async def go() -> None:
        async with engine:
            bulk = asyncio.create_task(engine.fill("bulk", None, ids[:480], priority=1))
            while not steps and not bulk.done():
                await asyncio.sleep(0.001)
            await engine.fill("chain", None, ids[480:500], priority=0)
            async for _ in engine.generate(
                "chain", None, SamplingParams(max_tokens=3, ignore_eos=True), priority=0
            ):
                pass
            await bulk

    asyncio.run(asyncio.wait_for(go(), 120))
    last_urgent = max(i for i, (urgent, _) in enumerate(steps) if urgent)
    return [n for _, n in steps[last_urgent + 1 :]]


def test_the_engine_keeps_throughput_steps_small_after_a_latency_call(tiny_model_dir):
    after = _engine_steps_after_a_latency_call(tiny_model_dir, linger=60.0)
    assert after and all(0 < n <= 128 // 8 for n in after)  # the linger outlasts the fill
    after = _engine_steps_after_a_latency_call(tiny_model_dir, linger=0.0)
    assert after[0] > 128 // 8  # without it the next step is a full chunk


def test_the_engine_holds_the_background_then_goes_on(tiny_model_dir):
    """With a hold as long as the linger, the engine plans nothing for the throughput fill
    after the latency call ends, then, woken by the hold's end (no new request), gives it
    full steps: it is not stalled."""
    after = _engine_steps_after_a_latency_call(tiny_model_dir, linger=0.3, hold=0.3)
    assert after and after[0] > 128 // 8
