"""The dispatcher's window (which pending calls a round offers the policy), checked against
a plain restatement of its rule on random backlogs: the counters it keeps must not change
which calls it picks."""

from __future__ import annotations

import random
from collections import Counter

from parrot_backend.manager.dispatch_window import dispatch_window
from parrot_backend.manager.events import EventLog
from parrot_backend.manager.manager import Manager, ManagerConfig
from parrot_backend.manager.policy import PolicyConfig
from parrot_backend.manager.ready_queue import ReadyCall, ReadyQueue
from parrot_backend.manager.runs import Run
from parrot_backend.program import Program, RunSpec
from parrot_backend.testing.fake_engine import ScriptedEngine


def reference_window(pending: list[ReadyCall], slots: int, old: float) -> set[str]:
    """The rule, restated plainly: a call brings its whole task group, every member counts
    against the slots (and its tenant's and run's shares); a group that does not fit in the
    slots left is passed over, unless nothing is chosen yet. Each tenant's share is an
    equal part of the slots, each run's an equal part of its tenant's share."""
    if len(pending) <= slots:
        return {r.call_id for r in pending}
    chosen: dict[str, ReadyCall] = {}
    taken: Counter[str] = Counter()
    by_tenant: Counter[str | None] = Counter()
    passed: set[tuple[str, int]] = set()

    def unit(r: ReadyCall) -> list[ReadyCall]:
        if r.group is None:
            return [r]
        return [q for q in pending if q.run is r.run and q.group == r.group]

    def take(r: ReadyCall) -> None:
        if r.group is not None and (r.run.run_id, r.group) in passed:
            return
        members = unit(r)
        if chosen and len(chosen) + len(members) > slots:
            passed.add((r.run.run_id, r.group))  # type: ignore[arg-type]
            return
        for q in members:
            chosen[q.call_id] = q
        taken[r.run.run_id] += len(members)
        by_tenant[r.run.tenant] += len(members)

    for r in pending:
        if r.enqueued_at >= old or len(chosen) >= slots:
            break
        if r.call_id not in chosen:
            take(r)
    runs_of: dict[str | None, set[str]] = {}
    for r in pending:
        runs_of.setdefault(r.run.tenant, set()).add(r.run.run_id)
    share = max(1, slots // len(runs_of))
    for want_latency in (True, False):
        for fair in (True, False):
            for r in pending:
                if len(chosen) >= slots:
                    break
                if (r.objective == "latency") != want_latency or r.call_id in chosen:
                    continue
                run_share = max(1, share // len(runs_of[r.run.tenant]))
                if fair and (by_tenant[r.run.tenant] >= share or taken[r.run.run_id] >= run_share):
                    continue
                take(r)
    return set(chosen)


def test_window_picks_what_the_rule_says() -> None:
    rng = random.Random(3)
    now = [100.0]
    for trial in range(150):
        q = ReadyQueue()
        tenants = [None, "alice", "bob", "carol"][: rng.randint(1, 4)]
        runs = [
            Run(f"r{i}", Program(), rng.choice(tenants), "t:", True, {}, EventLog(f"r{i}"))
            for i in range(rng.randint(1, 12))
        ]
        order: list[ReadyCall] = []
        for k in range(rng.randint(1, 80)):
            run = rng.choice(runs)
            ready = ReadyCall(
                f"{run.run_id}/c{k}",
                run,
                f"c{k}",
                now[0] - rng.choice([0.0, 1.0, 50.0]) + k * 1e-3,
                rng.choice(["latency", "throughput"]),
                rng.choice([None, 0, 1]),
            )
            q.add(ready)
            order.append(ready)
        # some calls leave the queue (dispatched or cancelled)
        for ready in rng.sample(order, len(order) // 4):
            q.remove(ready.run, ready.name)
            order.remove(ready)
        assert q.latency == sum(r.objective == "latency" for r in order)
        assert q.runs == Counter(r.run.run_id for r in order)
        assert q.tenants == Counter(
            {
                t: len({r.run.run_id for r in order if r.run.tenant == t})
                for t in {r.run.tenant for r in order}
            }
        )
        assert q.inflight == Counter(r.run.tenant for r in order)
        slots = rng.randint(0, 40)
        got = {r.call_id for r in dispatch_window(q, slots, now[0] - 10.0)}
        assert got == reference_window(order, slots, now[0] - 10.0), trial


def _ready(run: Run, name: str, at: float, group: int | None, objective="throughput") -> ReadyCall:
    return ReadyCall(f"{run.run_id}/{name}", run, name, at, objective, group)


def test_a_group_is_never_split_and_counts_against_the_slots() -> None:
    now = [100.0]
    q = ReadyQueue()
    runs = [Run(f"r{i}", Program(), None, "t:", True, {}, EventLog(f"r{i}")) for i in range(4)]
    for i, run in enumerate(runs):  # four runs, each a group of 3 and a single call
        for k in range(3):
            q.add(_ready(run, f"m{k}", 99.0 + i * 0.01, 0))
        q.add(_ready(run, "s", 99.5, None))
    window = dispatch_window(q, 7, now[0] - 10.0)
    # fair share 7 // 4 = 1: r0's group (3), r1's group (3), then r2's group does not fit
    # the one slot left (passed over) and r2's single takes it
    assert [r.call_id for r in window] == [
        "r0/m0",
        "r0/m1",
        "r0/m2",
        "r1/m0",
        "r1/m1",
        "r1/m2",
        "r2/s",
    ]


def test_a_group_larger_than_the_slots_is_offered_whole_when_it_comes_first() -> None:
    now = [100.0]
    q = ReadyQueue()
    big = Run("big", Program(), None, "t:", True, {}, EventLog("big"))
    small = Run("small", Program(), None, "t:", True, {}, EventLog("small"))
    for k in range(6):
        q.add(_ready(big, f"m{k}", 99.0, 0))
    for k in range(3):
        q.add(_ready(small, f"s{k}", 99.5, None))
    assert [r.name for r in dispatch_window(q, 4, now[0] - 10.0)] == [f"m{k}" for k in range(6)]
    # behind younger calls of another run it waits (passed over) ...
    q = ReadyQueue()
    for k in range(3):
        q.add(_ready(small, f"s{k}", 95.0, None))
    for k in range(6):
        q.add(_ready(big, f"m{k}", 99.0, 0))
    assert [r.name for r in dispatch_window(q, 4, now[0] - 10.0)] == ["s0", "s1", "s2"]
    # ... until it has waited `aging_s`; the smaller aged calls before it go first, and
    # it comes first once they are gone
    now[0] = 109.5
    assert [r.name for r in dispatch_window(q, 4, now[0] - 10.0)] == ["s0", "s1", "s2"]
    for k in range(3):
        q.remove(small, f"s{k}")
    q.add(_ready(small, "late", 109.0, None))
    assert [r.name for r in dispatch_window(q, 4, now[0] - 10.0)] == [f"m{k}" for k in range(6)]


def _map_reduce(i: int, maps: int, max_tokens: int) -> RunSpec:
    calls = [
        {
            "name": f"m{k}",
            "template": f"Map {{{{input:c{k}}}}} {{{{output:s{k}}}}}",
            "outputs": {f"s{k}": {"max_tokens": max_tokens}},
        }
        for k in range(maps)
    ]
    reads = " ".join(f"{{{{input:s{k}}}}}" for k in range(maps))
    calls.append({"name": "r", "template": f"Reduce {reads} {{{{output:total}}}}"})
    return RunSpec.model_validate(
        {
            "program": {"calls": calls},
            "inputs": {f"c{k}": f"d{i}x{k}" for k in range(maps)},
            "outputs": {"total": "throughput"},
        }
    )


def _echo(prompt: str) -> str:
    return f"<{prompt.split()[-1]}>"


def _watch_windows(m: Manager) -> list[tuple[int, list[ReadyCall], dict[str, ReadyCall]]]:
    seen: list[tuple[int, list[ReadyCall], dict[str, ReadyCall]]] = []
    inner = m.dispatcher.window

    def window(slots: int) -> list[ReadyCall]:
        before = dict(m.queue.calls)
        got = inner(slots)
        seen.append((slots, got, before))
        return got

    m.dispatcher.window = window  # type: ignore[method-assign]
    return seen


def _check_windows(seen: list[tuple[int, list[ReadyCall], dict[str, ReadyCall]]]) -> None:
    for slots, got, before in seen:
        groups = {(r.run.run_id, r.group) for r in got if r.group is not None}
        for r in before.values():  # every pending member of an offered group is offered
            if (r.run.run_id, r.group) in groups:
                assert r in got
        first = got[0] if got else None
        whole_first = (
            first is not None
            and first.group is not None
            and all(r.run is first.run and r.group == first.group for r in got)
        )
        assert len(got) <= slots or whole_first


async def test_memory_tight_engine_runs_every_group_whole() -> None:
    # each map needs ~16 + 40 tokens of KV: about two groups of four fit at once, while
    # the batch has room for twice that; every run still finishes with the right values
    engine = ScriptedEngine(reply=_echo, capacity_tokens=16 * 30, record=False)
    config = ManagerConfig(policy=PolicyConfig(max_batch=16))
    async with Manager({"e0": engine}, config=config) as m:
        seen = _watch_windows(m)
        ids = [await m.create_run(_map_reduce(i, 4, 40)) for i in range(12)]
        for i, rid in enumerate(ids):
            assert await m.get(rid, "total") == f"<<d{i}x3>>"
        assert any(len(before) > slots for slots, _, before in seen)  # a backlog formed
        assert max(len(got) for _, got, _ in seen) <= 16  # never the whole backlog
    _check_windows(seen)


async def test_a_group_larger_than_max_batch_still_runs() -> None:
    engine = ScriptedEngine(reply=_echo, record=False)
    config = ManagerConfig(policy=PolicyConfig(max_batch=4, aging_s=0.05))
    async with Manager({"e0": engine}, config=config) as m:
        seen = _watch_windows(m)
        small = [await m.create_run(_map_reduce(i, 2, 8)) for i in range(3)]
        big = await m.create_run(_map_reduce(99, 6, 8))
        assert await m.get(big, "total") == "<<d99x5>>"
        for i, rid in enumerate(small):
            assert await m.get(rid, "total") == f"<<d{i}x1>>"
    _check_windows(seen)


def test_a_tenant_with_many_runs_does_not_take_every_slot() -> None:
    now = [100.0]
    q = ReadyQueue()
    many = [Run(f"a{i}", Program(), "alice", "t:", True, {}, EventLog(f"a{i}")) for i in range(8)]
    bob = Run("b", Program(), "bob", "t:", True, {}, EventLog("b"))
    for i, run in enumerate(many):  # alice queued first: 8 runs of 2 calls
        for k in range(2):
            q.add(_ready(run, f"c{k}", 99.0 + i * 0.01 + k * 0.001, None))
    for k in range(4):
        q.add(_ready(bob, f"c{k}", 99.5 + k * 0.001, None))
    window = dispatch_window(q, 8, now[0] - 10.0)
    # per run, bob would get 8 // 9 -> 1 slot; per tenant he gets half of them
    assert sum(r.run is bob for r in window) == 4
    assert len(window) == 8
