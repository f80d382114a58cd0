"""The dispatcher's window (which pending calls a round offers the policy), checked against
a plain restatement of its rule on random backlogs: the counters it keeps must not change
which calls it picks."""

from __future__ import annotations

import random
from collections import Counter

from parrot_backend.manager.events import EventLog
from parrot_backend.manager.executor import Manager, ManagerConfig, _Ready
from parrot_backend.manager.policy import PolicyConfig
from parrot_backend.manager.render import CallPlan
from parrot_backend.manager.runs import Run
from parrot_backend.manager.scripted import ScriptedEngine
from parrot_backend.program import Program


def reference_window(pending: list[_Ready], slots: int, old: float) -> set[str]:
    if len(pending) <= slots:
        return {r.call_id for r in pending}
    chosen: dict[str, _Ready] = {}
    for r in pending:
        if r.enqueued_at >= old or len(chosen) >= slots:
            break
        chosen[r.call_id] = r
    share = max(1, slots // len({r.run.run_id for r in pending}))
    taken = Counter(r.run.run_id for r in chosen.values())
    for want_latency in (True, False):
        for fair in (True, False):
            for r in pending:
                if len(chosen) >= slots:
                    break
                if (r.objective == "latency") != want_latency or r.call_id in chosen:
                    continue
                if fair and taken[r.run.run_id] >= share:
                    continue
                chosen[r.call_id] = r
                taken[r.run.run_id] += 1
    groups = {(r.run.run_id, r.group) for r in chosen.values() if r.group is not None}
    for r in pending:
        if (r.run.run_id, r.group) in groups:
            chosen.setdefault(r.call_id, r)
    return set(chosen)


def test_window_picks_what_the_rule_says() -> None:
    rng = random.Random(3)
    now = [100.0]
    config = ManagerConfig(policy=PolicyConfig(aging_s=10.0))
    for trial in range(150):
        m = Manager({"e": ScriptedEngine()}, config=config, clock=lambda: now[0])
        runs = [
            Run(f"r{i}", Program(), None, "t:", True, {}, EventLog(f"r{i}"))
            for i in range(rng.randint(1, 12))
        ]
        order: list[_Ready] = []
        for k in range(rng.randint(1, 80)):
            run = rng.choice(runs)
            ready = _Ready(
                f"{run.run_id}/c{k}",
                run,
                f"c{k}",
                CallPlan([], [], 1),
                (),
                None,
                now[0] - rng.choice([0.0, 1.0, 50.0]) + k * 1e-3,
                rng.choice(["latency", "throughput"]),
                rng.choice([None, 0, 1]),
            )
            m._queue(ready)
            order.append(ready)
        # some calls leave the queue (dispatched or cancelled)
        for ready in rng.sample(order, len(order) // 4):
            m._unqueue(ready.run, ready.name)
            order.remove(ready)
        assert m._pending_latency == sum(r.objective == "latency" for r in order)
        assert m._pending_runs == Counter(r.run.run_id for r in order)
        slots = rng.randint(0, 40)
        got = {r.call_id for r in m._window(slots)}
        assert got == reference_window(order, slots, now[0] - 10.0), trial
