"""Waiting requests are admitted by priority: a latency request (priority 0) does not wait
behind a full batch of throughput work (priority 1); it preempts the newest of it, which
then finishes with the tokens it would have produced anyway (greedy, recomputed KV)."""

from __future__ import annotations

import asyncio

import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine

LONG = SamplingParams(max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, ignore_eos=True)
SHORT_20 = SamplingParams(max_tokens=20, ignore_eos=True)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


async def _gen(engine, cid, prompt, sampling, priority, log):
    await engine.fill(cid, None, prompt, priority=priority)
    tokens = []
    async for d in engine.generate(cid, None, sampling, priority=priority):
        if d.token_id is not None:
            tokens.append(d.token_id)
        log.append(cid)
    await engine.free(cid)
    return tokens


def test_an_urgent_request_overtakes_a_full_batch_of_throughput_work(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=128, max_num_seqs=2, progress=False)

    async def go(urgent: bool):
        log: list[str] = []
        async with engine:
            bulk = [
                asyncio.create_task(_gen(engine, f"bulk{i}", _prompt(20, i), LONG, 1, log))
                for i in range(2)
            ]
            while len(log) < 4:  # both throughput requests are decoding
                await asyncio.sleep(0.001)
            tokens = []
            if urgent:
                tokens = await _gen(engine, "urgent", _prompt(10, 9), SHORT, 0, log)
            bulk_tokens = await asyncio.gather(*bulk)
            return log, tokens, bulk_tokens, engine.stats_now()

    quiet_log, _, quiet_bulk, _ = asyncio.run(go(False))
    log, tokens, bulk_tokens, stats = asyncio.run(go(True))
    assert len(tokens) == 3
    done_at = max(i for i, c in enumerate(log) if c == "urgent")
    # the urgent request finished while the bulk still had most of its tokens to go
    assert sum(1 for c in log[:done_at] if c != "urgent") < 40
    assert stats.preemptions >= 1
    assert bulk_tokens == quiet_bulk  # preempted work recomputes to the same tokens
    assert stats.contexts == 0 and stats.blocks_used == 0


def test_less_urgent_prefill_rides_along_a_decode_in_small_chunks(tiny_model_dir):
    """While a latency request decodes, a throughput prompt is filled a few tokens at a
    time (`background_tokens` per step, the GPU's way: each of the latency request's
    tokens waits for one step), and generates what it generates when filled alone."""

    async def go(urgent: bool):
        engine = Engine.from_pretrained(
            tiny_model_dir,
            num_blocks=128,
            background_tokens=16,
            background_every=0,
            background_wait=0,  # no full turn after 2 s (a loaded machine may take them)
            progress=False,
        )
        plans: list[list[tuple[int, str, int]]] = []
        schedule = engine.scheduler.schedule

        def spy():
            out = schedule()
            plans.append([(w.req.priority, w.req.kind, w.n) for w in out[0]])
            return out

        engine.scheduler.schedule = spy
        log: list[str] = []
        async with engine:
            task = None
            if urgent:
                task = asyncio.create_task(_gen(engine, "urgent", _prompt(10, 1), LONG, 0, log))
                while len(log) < 2:  # it is decoding
                    await asyncio.sleep(0.001)
            bulk = await _gen(engine, "bulk", _prompt(400, 2), SHORT, 1, log)
            if task is not None:
                await task
        return plans, bulk, engine.scheduler.background_tokens

    plans, bulk, background = asyncio.run(go(True))
    alongside = [
        n
        for plan in plans
        if any(p == 0 and k == "generate" for p, k, _ in plan)
        for p, _, n in plan
        if p == 1 and n > 1
    ]
    assert alongside and max(alongside) <= background < 400
    quiet_plans, quiet_bulk, _ = asyncio.run(go(False))
    assert max(n for plan in quiet_plans for _, _, n in plan) > background  # full chunks alone
    assert bulk == quiet_bulk


def test_throughput_decodes_wait_beside_a_latency_decode_on_cpu(tiny_model_dir):
    """Eight throughput requests decoding and one latency request, CPU defaults (but no
    turn after `background_wait`): while the latency request runs, its steps carry no
    throughput work; once it is done the eight decode together again, and every request
    generates the tokens it generates without the latency one."""

    async def go(urgent: bool):
        # background_wait=0: no turn for the batch after 2 s, which these steps might take
        # on a loaded machine (that rule is checked on a fake clock in test_urgent_linger)
        engine = Engine.from_pretrained(
            tiny_model_dir, num_blocks=256, progress=False, background_wait=0
        )
        plans: list[list[tuple[int, int]]] = []
        schedule = engine.scheduler.schedule

        def spy():
            out = schedule()
            plans.append([(w.req.priority, w.n) for w in out[0]])
            return out

        engine.scheduler.schedule = spy
        log: list[str] = []
        async with engine:
            bulk = [
                asyncio.create_task(_gen(engine, f"bulk{i}", _prompt(12, 20 + i), LONG, 1, log))
                for i in range(8)
            ]
            while len(log) < 16:  # the batch is decoding
                await asyncio.sleep(0.001)
            tokens = None
            if urgent:
                tokens = await _gen(engine, "urgent", _prompt(10, 9), SHORT_20, 0, log)
            bulk_tokens = await asyncio.gather(*bulk)
        s = engine.scheduler
        return plans, tokens, bulk_tokens, (s.background_tokens, s.background_every)

    plans, tokens, bulk_tokens, background = asyncio.run(go(True))
    assert background == (0, 0)  # the CPU defaults: turns only after `background_wait`
    assert len(tokens) == 20
    with_urgent = [p for p in plans if any(prio == 0 for prio, _ in p)]
    decoding = [p for p in with_urgent if all(n <= 1 for _, n in p)]
    assert len(decoding) >= 18
    riding = [sum(1 for prio, _ in p if prio == 1) for p in decoding]
    # steps with the latency call decode it alone (on a CPU nothing rides along)
    assert set(riding) == {0}, riding
    _, _, quiet_bulk, _ = asyncio.run(go(False))
    assert bulk_tokens == quiet_bulk


def test_a_latency_calls_next_request_is_in_the_step_after_its_last_one(
    tiny_model_dir, monkeypatch
):
    """A latency call awaits its prefix's fill, then fills its own fork, then generates: each
    next request makes the step right after the one that ended the last (the loop lets the
    caller run before planning), so no step of throughput work alone comes between. (The
    hold after a request ends, `urgent_hold`, would hide a missing yield: it is off here.)"""
    from parrot_backend.engine import step_loop

    async def go():
        engine = Engine.from_pretrained(
            tiny_model_dir, num_blocks=256, progress=False, urgent_hold=0
        )
        plans: list[set[int]] = []
        schedule = engine.scheduler.schedule

        def spy():
            out = schedule()
            if out[0]:
                plans.append({w.req.priority for w in out[0]})
            return out

        engine.scheduler.schedule = spy
        log: list[str] = []
        async with engine:
            bulk = asyncio.create_task(_gen(engine, "bulk", _prompt(12, 3), LONG, 1, log))
            while len(log) < 2:  # the throughput request is decoding
                await asyncio.sleep(0.001)
            start = len(plans)
            await engine.fill("prefix", None, _prompt(20, 4), priority=0)
            await engine.fill("call", "prefix", _prompt(6, 5), priority=0)
            tokens = [
                d.token_id
                async for d in engine.generate("call", None, SHORT, priority=0)
                if d.token_id is not None
            ]
            end = len(plans)
            await bulk
        return plans[start:end], tokens

    plans, tokens = asyncio.run(go())
    assert len(tokens) == 3
    # fill, fork fill, 3 sampled tokens (the first from the fill's kept state): every step
    # from the first fill to the last token has the latency call in it
    assert plans and all(0 in p for p in plans), plans
    monkeypatch.setattr(step_loop, "YIELDS_AFTER_END", 0)
    plans, _ = asyncio.run(go())
    assert any(0 not in p for p in plans), plans  # without the yield a step slips in
