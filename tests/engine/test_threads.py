"""The compute thread's thread count: the tuner keeps what measures cheaper and goes back
when that changes; switching counts changes no result."""

from __future__ import annotations

import asyncio

import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.threads import ThreadTuner

from .helpers import collect


class FakeMachine:
    """Step costs per thread count (seconds per token), changed by the test."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cost = {2: 1.0, 1: 1.8}  # quiet 2-core machine: the whole team is faster
        self.applied: list[int] = []

    def run(self, tuner: ThreadTuner, steps: int) -> list[int]:
        used = []
        for _ in range(steps):
            n = tuner.before_step()
            used.append(n)
            self.now += 0.05
            tuner.after_step(n, self.cost[n] * 8, 8)
        return used


def _tuner(machine: FakeMachine, **kw) -> ThreadTuner:
    return ThreadTuner(
        2,
        probe_every_s=1.0,
        max_probe_every_s=4.0,
        probe_steps=3,
        clock=lambda: machine.now,
        set_threads=machine.applied.append,
        **kw,
    )


def test_the_tuner_drops_to_one_thread_under_contention_and_comes_back():
    m = FakeMachine()
    tuner = _tuner(m)
    used = m.run(tuner, 400)  # 20 s
    assert tuner.current == 2 and 1 in used  # it probed one thread and stayed at two
    # probes are short and back off (1, 2, 4, 4, ... s apart): few slow steps
    assert used.count(1) <= 3 * 7
    m.cost = {2: 6.0, 1: 1.9}  # another process spins on one core: the team waits
    m.run(tuner, 100)
    assert tuner.current == 1
    m.cost = {2: 1.0, 1: 1.8}  # the load is gone
    m.run(tuner, 100)
    assert tuner.current == 2
    assert tuner.switches == 2
    assert m.applied[0] == 2 and set(m.applied) == {1, 2}


def test_the_tuner_keeps_its_count_within_the_margin_and_fixed_never_probes():
    m = FakeMachine()
    m.cost = {2: 1.0, 1: 0.95}  # one thread barely cheaper: not worth a switch
    tuner = _tuner(m)
    m.run(tuner, 100)
    assert tuner.current == 2 and tuner.switches == 0
    fixed = _tuner(m, fixed=True)
    assert set(m.run(fixed, 100)) == {2}


def test_a_probe_compares_counts_alternately_not_against_steps_before_it():
    """The first steps of a server (or those after a long prefill, or a noisy spell of the
    host) are slow at any count: a probe judged against them picked one thread on a quiet
    2-core machine (measured: 56-66 ms decode steps instead of 34-37 ms for seconds)."""
    m = FakeMachine()
    tuner = _tuner(m)
    m.cost = {2: 3.0, 1: 5.4}  # cold: everything slow
    m.run(tuner, 3)  # enough for the first probe to start
    m.cost = {2: 1.0, 1: 1.8}  # warm
    used = m.run(tuner, 30)
    assert tuner.current == 2 and tuner.switches == 0
    assert used[:6] == [1, 2, 1, 2, 1, 2]  # the probe: one thread and two, alternately
    m.cost = {2: 6.0, 1: 1.9}  # a real load still moves it, alternating or not
    m.run(tuner, 200)
    assert tuner.current == 1 and tuner.switches == 1


def _steps(tuner: ThreadTuner, machine: FakeMachine, sizes: list[int]) -> list[tuple[int, int]]:
    """Run steps of these token counts; (tokens, thread count) of each."""
    used = []
    for tokens in sizes:
        n = tuner.before_step(tokens)
        used.append((tokens, n))
        machine.now += 0.05
        tuner.after_step(n, machine.cost[n] * tokens, tokens)
    return used


def test_a_probe_tries_its_count_on_small_steps_only():
    """A pause makes a probe due, and the next request starts with a prefill chunk: on one
    thread of two a 512-token chunk took 0.9-1.0 s instead of ~0.5 s (SmolLM2, 2 cores),
    added to that request's first token. Large steps keep the current count; the probe
    runs on the decode steps after them and still decides."""
    m = FakeMachine()
    tuner = _tuner(m)
    _steps(tuner, m, [8] * 12)  # a first request's decode: its first probe comes and goes
    m.now += 30.0  # idle: the next probe is due
    used = _steps(tuner, m, [512, 512, 15] + [8] * 12)
    assert [n for t, n in used if t > 64] == [2, 2]  # the chunks: the whole team
    assert used[2] == (15, 1)  # the first small step takes the tried count
    # then the counts alternate until each has 3 steps, and the probe ends
    assert [n for _, n in used[2:8]] == [1, 2, 1, 2, 1, 2]
    assert {n for _, n in used[8:]} == {2}
    assert tuner.current == 2 and tuner.switches == 0  # one thread measured dearer
    # under a co-located load the decision still comes, from the small steps, while big
    # prefill steps between them keep the count then current
    m.cost = {2: 6.0, 1: 1.9}
    used = _steps(tuner, m, [512, 8, 8, 8, 8, 8] * 40)
    assert tuner.current == 1 and tuner.switches == 1
    switched = next(i for i, (t, n) in enumerate(used) if t > 64 and n == 1)
    assert all(n == 2 for t, n in used[:switched] if t > 64)
    # from then on big steps run one thread; later probes try two on small steps only
    assert all(n == 1 for t, n in used[switched:] if t > 64)


def test_one_and_two_threads_give_the_same_logits_and_tokens(tiny_model_dir):
    prompt = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()

    def tokens(threads: int):
        engine = Engine.from_pretrained(
            tiny_model_dir, num_blocks=64, threads=threads, progress=False
        )

        async def go():
            async with engine:
                await engine.fill("a", None, prompt)
                return (
                    await collect(engine, "a", None, SamplingParams(max_tokens=12, ignore_eos=True))
                )[0]

        return asyncio.run(go()), engine.threads.describe()

    (one, d1), (two, d2) = tokens(1), tokens(2)
    assert one == two
    assert "1 thread" in d1 and "2 thread" in d2
