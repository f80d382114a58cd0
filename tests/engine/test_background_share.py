"""While more urgent work runs, less urgent work shares `background_tokens` per step plus a
quarter of the urgent tokens: throughput decode rows count one token each, throughput
prefill its chunk (the scheduler plans steps here without a model)."""

from __future__ import annotations

import pytest
import torch

from parrot_backend.engine.block_pool import BlockPool
from parrot_backend.engine.config import EngineConfig, pick_background, pick_hold, pick_share
from parrot_backend.engine.context import Context, Request
from parrot_backend.engine.scheduler import Scheduler

BS = 16


def _scheduler(background: int = 4, budget: int = 512, every: int = 0) -> Scheduler:
    contexts: dict = {}
    return Scheduler(
        BlockPool(512, BS),
        max_num_seqs=64,
        max_batched_tokens=budget,
        copy_block=lambda src, dst: None,
        contexts=contexts,
        background_tokens=background,
        background_every=every,
    )


def _add(s: Scheduler, name: str, prompt: int, priority: int, kind: str = "generate"):
    ctx = Context(name, None, None, BS)
    ctx.tokens = list(range(1, prompt + 1))
    s.contexts[name] = ctx
    req = Request(kind, ctx, priority=priority)
    ctx.queue.append(req)
    s.add(req)
    return req


def _decoding(s: Scheduler, req: Request) -> None:
    """Mark `req`'s prompt computed and one sampled token pending (a decode row)."""
    ctx = req.ctx
    s._reserve(req, 0, len(ctx.tokens), set())
    ctx.num_computed = len(ctx.tokens)
    ctx.tokens.append(7)


def _plan(s: Scheduler) -> dict[str, int]:
    work, _, _ = s.schedule()
    return {w.req.ctx.id: w.n for w in work}


def test_throughput_decodes_alone_run_in_one_batch():
    s = _scheduler()
    bulk = [_add(s, f"b{i}", 20, 1) for i in range(12)]
    s._admit()
    for r in bulk:
        _decoding(s, r)
    assert _plan(s) == {f"b{i}": 1 for i in range(12)}


def test_a_latency_decode_caps_throughput_rows_at_the_background_share():
    s = _scheduler(background=4)
    bulk = [_add(s, f"b{i}", 20, 1) for i in range(12)]
    chat = _add(s, "chat", 20, 0)
    s._admit()
    for r in [*bulk, chat]:
        _decoding(s, r)
    plan = _plan(s)
    # the latency row, and 4 + 1 // 4 = 4 throughput rows: the oldest ones
    assert plan == {"chat": 1, "b0": 1, "b1": 1, "b2": 1, "b3": 1}
    s.remove(chat)  # the latency call finished: the whole batch decodes again
    assert _plan(s) == {f"b{i}": 1 for i in range(12)}


def test_a_latency_prefill_caps_throughput_decodes_and_prefill():
    s = _scheduler(background=4)
    bulk = [_add(s, f"b{i}", 20, 1) for i in range(12)]
    _add(s, "fill", 300, 1, kind="fill")
    s._admit()
    for r in bulk:
        _decoding(s, r)
    chat = _add(s, "chat", 40, 0)
    plan = _plan(s)
    # 40 urgent prefill tokens allow 4 + 40 // 4 = 14 tokens of throughput work: the 12
    # decode rows, then 2 tokens of the throughput fill
    assert plan["chat"] == 40
    assert sum(n for k, n in plan.items() if k != "chat") == 14
    assert plan["fill"] == 2
    assert chat.priority == 0


def test_without_urgent_work_throughput_prefill_takes_the_whole_budget():
    s = _scheduler(background=4, budget=256)
    _add(s, "fill", 600, 1, kind="fill")
    assert _plan(s) == {"fill": 256}


def test_equal_priorities_share_steps_first_come_first_served():
    """API requests (all priority 0) are not throttled by each other: request-level FIFO."""
    s = _scheduler(background=4)
    reqs = [_add(s, f"r{i}", 20, 0) for i in range(10)]
    s._admit()
    for r in reqs:
        _decoding(s, r)
    late = _add(s, "late", 100, 0)
    plan = _plan(s)
    assert len(plan) == 11 and plan["late"] == 100
    assert late.priority == 0


def test_a_skipped_throughput_decode_keeps_its_state():
    """A decode row left out of a step computes nothing and is planned again later."""
    s = _scheduler(background=0)
    b = _add(s, "b", 20, 1)
    chat = _add(s, "chat", 20, 0)
    s._admit()
    _decoding(s, b)
    _decoding(s, chat)
    before = b.ctx.num_computed
    assert _plan(s) == {"chat": 1}
    assert b.ctx.num_computed == before and b in s.running
    s.remove(chat)
    assert _plan(s) == {"b": 1}


def test_every_nth_urgent_step_the_background_gets_an_eighth_of_the_budget():
    s = _scheduler(background=0, every=3)
    bulk = [_add(s, f"b{i}", 20, 1) for i in range(5)]
    chat = _add(s, "chat", 20, 0)
    s._admit()
    for r in [*bulk, chat]:
        _decoding(s, r)
    riding = []
    for _ in range(6):
        plan = _plan(s)
        assert plan["chat"] == 1
        riding.append(len(plan) - 1)
        for r in s.running:  # each planned row sampled a token: one pending again
            if r.ctx.id in plan:
                r.ctx.num_computed += 1
                r.ctx.tokens.append(7)
    assert riding == [0, 0, 5, 0, 0, 5]
    # a prefill in the background's turn: an eighth of the budget, not a whole chunk
    s = _scheduler(background=0, every=1, budget=512)
    chat = _add(s, "chat", 20, 0)
    _add(s, "fill", 600, 1, kind="fill")
    s._admit()
    _decoding(s, chat)
    assert _plan(s) == {"chat": 1, "fill": 64}


def test_the_defaults_are_picked_by_device():
    assert pick_background(EngineConfig(), torch.device("cpu")) == (0, 0)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (pick_share(EngineConfig(), cpu), pick_share(EngineConfig(), cuda)) == (0.0, 0.25)
    assert (pick_hold(EngineConfig(), cpu), pick_hold(EngineConfig(), cuda)) == (0.03, 0.0)
    assert pick_hold(EngineConfig(urgent_hold=0.1), cuda) == 0.1
    with pytest.raises(ValueError, match="urgent_hold"):
        pick_hold(EngineConfig(urgent_hold=-1), cpu)
    gpu = EngineConfig(max_batched_tokens=2048)
    assert pick_background(gpu, torch.device("cuda")) == (256, 0)
    mine = EngineConfig(background_tokens=9, background_every=2)
    assert pick_background(mine, torch.device("cpu")) == (9, 2)
    with pytest.raises(ValueError, match="background_tokens"):
        pick_background(EngineConfig(background_tokens=-1), torch.device("cpu"))
    with pytest.raises(ValueError, match="background_every"):
        pick_background(EngineConfig(background_every=-1), torch.device("cuda"))
