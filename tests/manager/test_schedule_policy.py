"""Scheduling decisions across engines, on scripted snapshots."""

from __future__ import annotations

from parrot_backend.manager.policy import (
    Assignment,
    EngineSnapshot,
    PendingCall,
    PolicyConfig,
    schedule,
)
from parrot_backend.manager.prefix import Prefix

CONFIG = PolicyConfig(latency_capacity=2, max_batch=4, aging_s=10.0)
NOW = 100.0
SYS = Prefix("sys", 1, 50)
SYS_DOC = Prefix("sys+doc", 2, 80)


def engine(eid: str, **kw: object) -> EngineSnapshot:
    kw.setdefault("free_kv_tokens", 1000)
    return EngineSnapshot(eid, **kw)  # type: ignore[arg-type]


def call(cid: str, objective: str = "throughput", **kw: object) -> PendingCall:
    kw.setdefault("n_tokens", 100)
    kw.setdefault("enqueued_at", NOW)
    return PendingCall(cid, objective, **kw)  # type: ignore[arg-type]


def placement(assignments: list[Assignment]) -> dict[str, str]:
    return {a.call_id: a.engine_id for a in assignments}


def test_call_goes_to_engine_holding_its_longest_prefix() -> None:
    engines = [
        engine("e0", prefixes=frozenset({"sys"})),
        engine("e1", prefixes=frozenset({"sys+doc"})),
    ]
    [a] = schedule([call("c", prefixes=(SYS, SYS_DOC))], engines, NOW, CONFIG)
    assert (a.engine_id, a.prefix) == ("e1", SYS_DOC)


def test_prefix_beats_load() -> None:
    engines = [engine("e0", batch_size=3, prefixes=frozenset({"sys"})), engine("e1")]
    [a] = schedule([call("c", prefixes=(SYS,))], engines, NOW, CONFIG)
    assert a.engine_id == "e0" and a.prefix == SYS


def test_without_prefix_the_least_loaded_engine_wins() -> None:
    engines = [engine("e0", batch_size=2), engine("e1", batch_size=1)]
    [a] = schedule([call("c")], engines, NOW, CONFIG)
    assert a.engine_id == "e1" and a.prefix is None


def test_latency_call_only_goes_below_latency_capacity() -> None:
    engines = [engine("e0", batch_size=2, prefixes=frozenset({"sys"})), engine("e1", batch_size=1)]
    [a] = schedule([call("c", "latency", prefixes=(SYS,))], engines, NOW, CONFIG)
    assert a.engine_id == "e1"


def test_latency_call_waits_when_every_batch_is_at_capacity_with_latency_work() -> None:
    engines = [
        engine("e0", running_latency=2, batch_size=2),
        engine("e1", running_latency=2, batch_size=3),
    ]
    assert schedule([call("c", "latency")], engines, NOW, CONFIG) == []


def test_latency_call_joins_a_throughput_batch_rather_than_wait_for_it() -> None:
    # the throughput batch does not drain sooner if the latency call waits for it
    engines = [
        engine("e0", running_latency=2, batch_size=2),
        engine("e1", running_latency=1, batch_size=3),
        engine("e2", batch_size=4),
    ]
    [a] = schedule([call("c", "latency")], engines, NOW, CONFIG)
    assert a.engine_id == "e1"  # e0 has its latency calls, e2 is at max_batch
    # but never past max_batch or the KV
    full = [engine("e0", batch_size=4), engine("e1", batch_size=3, free_kv_tokens=50)]
    assert schedule([call("c", "latency")], full, NOW, CONFIG) == []
    # and it does not let throughput calls in after it (they stay below the capacity)
    out = schedule([call("c", "latency"), call("t")], [engine("e0", batch_size=2)], NOW, CONFIG)
    assert [x.call_id for x in out] == ["c"]


def test_placed_latency_calls_count_against_capacity() -> None:
    calls = [call(f"l{i}", "latency", enqueued_at=NOW - i) for i in range(3)]
    out = schedule(calls, [engine("e0")], NOW, CONFIG)
    assert [a.call_id for a in out] == ["l2", "l1"]


def test_latency_forks_of_one_prefix_are_admitted_together() -> None:
    # 3 users of one system prompt: capacity 2 would start the third only after the
    # first two finished decoding; forks of one prefix join their family's engine
    users = [
        call(f"u{i}", "latency", prefixes=(SYS, Prefix(f"q{i}", 2, 60)), enqueued_at=NOW - i)
        for i in range(3)
    ]
    out = schedule(users, [engine("e0"), engine("e1")], NOW, CONFIG)
    assert sorted(placement(out).values()) == ["e0", "e0", "e0"]
    assert [a.prefix for a in out] == [None, SYS, SYS]  # one fill, the others fork


def test_users_asking_the_same_question_still_join_the_system_prompt_family() -> None:
    # u1 and u2 share a longer prefix (same question) than the one all three share
    same = Prefix("sys+q", 2, 70)
    users = [
        call("u0", "latency", prefixes=(SYS, Prefix("own", 2, 60)), enqueued_at=NOW - 1),
        call("u1", "latency", prefixes=(SYS, same), enqueued_at=NOW - 3),
        call("u2", "latency", prefixes=(SYS, same), enqueued_at=NOW - 2),
    ]
    out = schedule(users, [engine("e0")], NOW, CONFIG)
    assert [(a.call_id, a.prefix) for a in out] == [("u1", None), ("u2", same), ("u0", SYS)]


def test_latency_forks_stay_within_max_batch_and_kv() -> None:
    users = [call(f"u{i}", "latency", prefixes=(SYS,), enqueued_at=NOW - i) for i in range(6)]
    out = schedule(users, [engine("e0")], NOW, CONFIG)
    assert len(out) == CONFIG.max_batch
    # KV: 100 tokens each, 50 of them the shared prefix: 100 + 2 x 50 fit in 200
    out = schedule(users, [engine("e0", free_kv_tokens=200)], NOW, CONFIG)
    assert len(out) == 3


def test_latency_calls_without_a_shared_prefix_still_obey_capacity() -> None:
    calls = [
        call(f"l{i}", "latency", prefixes=(Prefix(f"own{i}", 1, 50),), enqueued_at=NOW - i)
        for i in range(3)
    ]
    out = schedule(calls, [engine("e0")], NOW, CONFIG)
    assert [a.call_id for a in out] == ["l2", "l1"]
    # nor does a fork family let an unrelated latency call past the capacity
    forks = [call(f"f{i}", "latency", prefixes=(SYS,), enqueued_at=NOW - 5 - i) for i in range(3)]
    out = schedule([*calls, *forks], [engine("e0")], NOW, CONFIG)
    assert sorted(a.call_id for a in out) == ["f0", "f1", "f2"]


def test_throughput_fills_engines_without_latency_work_up_to_max_batch() -> None:
    calls = [call(f"t{i}", enqueued_at=NOW - i) for i in range(6)]
    out = schedule(
        calls, [engine("e0", running_latency=1, batch_size=1), engine("e1")], NOW, CONFIG
    )
    on = placement(out)
    assert sum(e == "e1" for e in on.values()) == 4  # max_batch
    assert sum(e == "e0" for e in on.values()) == 1  # up to latency_capacity only


def test_throughput_prefers_engine_without_latency_calls() -> None:
    engines = [engine("e0", running_latency=1, batch_size=1), engine("e1", batch_size=3)]
    [a] = schedule([call("t")], engines, NOW, CONFIG)
    assert a.engine_id == "e1"


def test_latency_goes_before_older_throughput() -> None:
    calls = [call("old-t", enqueued_at=NOW - 5), call("new-l", "latency")]
    out = schedule(calls, [engine("e0", batch_size=1)], NOW, CONFIG)
    assert [a.call_id for a in out][0] == "new-l"


def test_memory_need_is_reduced_by_the_held_prefix() -> None:
    engines = [
        engine("e0", free_kv_tokens=30, prefixes=frozenset({"sys+doc"})),
        engine("e1", free_kv_tokens=90),
    ]
    [a] = schedule([call("c", prefixes=(SYS, SYS_DOC))], engines, NOW, CONFIG)
    assert a.engine_id == "e0"
    assert schedule([call("c", n_tokens=200)], engines, NOW, CONFIG) == []


def test_calls_sharing_a_prefix_in_one_round_follow_each_other() -> None:
    calls = [call("a", prefixes=(SYS,), enqueued_at=NOW - 1), call("b", prefixes=(SYS,))]
    out = schedule(calls, [engine("e0"), engine("e1")], NOW, CONFIG)
    assert placement(out)["a"] == placement(out)["b"]
    assert out[1].prefix == SYS  # the second one forks from what the first one fills


def test_aged_throughput_goes_first_and_may_exceed_latency_capacity() -> None:
    engines = [engine("e0", running_latency=2, batch_size=2)]
    calls = [call("fresh-l", "latency"), call("aged-t", enqueued_at=NOW - 11)]
    out = schedule(calls, engines, NOW, CONFIG)
    assert [a.call_id for a in out] == ["aged-t"]


def test_aged_call_that_does_not_fit_reserves_an_engine() -> None:
    engines = [engine("e0", free_kv_tokens=300), engine("e1", free_kv_tokens=200)]
    calls = [
        call("huge", n_tokens=500, enqueued_at=NOW - 20),
        call("y1", enqueued_at=NOW - 1),
        call("y2"),
    ]
    out = schedule(calls, engines, NOW, CONFIG)
    # e0 (most free KV) drains for the huge call; younger calls only use e1
    assert placement(out) == {"y1": "e1", "y2": "e1"}


def test_group_sharing_a_prefix_stays_on_one_engine() -> None:
    members = [
        call(f"m{i}", prefixes=(SYS, Prefix(f"own{i}", 2, 60)), group="r/0") for i in range(3)
    ]
    out = schedule(
        members,
        [engine("e0"), engine("e1"), engine("e2", prefixes=frozenset({"sys"}))],
        NOW,
        CONFIG,
    )
    assert set(placement(out).values()) == {"e2"}
    assert all(a.prefix == SYS for a in out)


def test_group_without_shared_prefix_is_spread() -> None:
    members = [call(f"m{i}", prefixes=(Prefix(f"own{i}", 1, 10),), group="r/0") for i in range(3)]
    out = schedule(members, [engine("e0"), engine("e1"), engine("e2")], NOW, CONFIG)
    assert sorted(placement(out).values()) == ["e0", "e1", "e2"]


def test_group_is_all_or_nothing() -> None:
    members = [call(f"m{i}", group="r/0") for i in range(3)]
    loner = call("solo", enqueued_at=NOW + 1)
    out = schedule([*members, loner], [engine("e0", free_kv_tokens=250)], NOW, CONFIG)
    assert placement(out) == {"solo": "e0"}


def test_aged_group_places_what_fits() -> None:
    members = [call(f"m{i}", group="r/0", enqueued_at=NOW - 30) for i in range(3)]
    out = schedule(members, [engine("e0", free_kv_tokens=250)], NOW, CONFIG)
    assert len(out) == 2


def test_shared_prefix_group_too_big_for_one_engine_is_spread() -> None:
    members = [call(f"m{i}", prefixes=(SYS,), group="r/0") for i in range(6)]
    out = schedule(members, [engine("e0"), engine("e1")], NOW, CONFIG)
    on = list(placement(out).values())
    # prefix locality fills the first engine to max_batch; the rest share the prefix on e1
    assert (on.count("e0"), on.count("e1")) == (4, 2)
    assert [a.prefix for a in out if a.engine_id == "e1"] == [None, SYS]


def test_group_members_obey_throughput_caps_even_for_latency() -> None:
    members = [call(f"m{i}", "latency", group="r/0") for i in range(3)]
    # a latency single could not join this batch of 2; a batched group may (no latency running)
    out = schedule(members, [engine("e0", batch_size=1)], NOW, CONFIG)
    assert len(out) == 3


def test_latency_group_goes_before_throughput_singles() -> None:
    members = [call(f"m{i}", "latency", group="r/0") for i in range(2)]
    out = schedule(
        [call("t", enqueued_at=NOW - 5), *members], [engine("e0", batch_size=2)], NOW, CONFIG
    )
    assert sorted(a.call_id for a in out) == ["m0", "m1"]


def test_snapshots_are_not_mutated_and_decisions_are_deterministic() -> None:
    engines = [engine("e0", prefixes=frozenset({"sys"})), engine("e1")]
    before = [(e.batch_size, e.free_kv_tokens, e.prefixes) for e in engines]
    calls = [call(f"c{i}", prefixes=(SYS,), enqueued_at=NOW - i) for i in range(5)]
    first = schedule(calls, engines, NOW, CONFIG)
    assert [(e.batch_size, e.free_kv_tokens, e.prefixes) for e in engines] == before
    assert schedule(list(reversed(calls)), engines, NOW, CONFIG) == first


def _reference_schedule(pending, engines, now, config):  # type: ignore[no-untyped-def]
    """`schedule` as it was before placements were kept from their trial copies: every
    unit placed on trial copies of the loads, then committed again to the round's state."""
    from parrot_backend.manager import policy as p

    def place_each(calls, loads, aged, partial, batched=True):  # type: ignore[no-untyped-def]
        trial = {e.engine_id: e.trial() for e in loads}
        placed = []
        for c in calls:
            e = p._best(c, trial.values(), config, aged, batched)
            if e is None:
                if partial:
                    continue
                return None
            p._commit(c, e, single=not batched)
            placed.append((c, e.engine_id))
        return placed

    def place_unit(unit, loads):  # type: ignore[no-untyped-def]
        batched = not p._single(unit)
        if batched and p._shared_prefix(unit.calls) is not None:
            for e in sorted(loads, key=lambda e: p._rank(unit.calls[0], e, True)):
                together = place_each(unit.calls, [e], unit.aged, partial=False)
                if together is not None:
                    return together
        return place_each(unit.calls, loads, unit.aged, partial=False, batched=batched)

    state = {e.engine_id: p.RoundLoad.of(e) for e in engines}
    reserved: set[str] = set()
    out = []
    units = p._units(pending, now, config)
    family = p._families(units)
    joined: dict[str, str] = {}
    for unit in units:
        open_engines = [s for eid, s in state.items() if eid not in reserved]
        if not unit.aged and all(s.batch_size >= config.max_batch for s in open_engines):
            break
        fam = family.get(unit.calls[0].call_id, []) if p._single(unit) else []
        hits = [
            joined[k]
            for k in fam
            if k in joined
            and joined[k] not in reserved
            and p._fits(unit.calls[0], state[joined[k]], config, True, False)
        ]
        if hits:
            out.append(p._commit(unit.calls[0], state[hits[0]], single=True))
            for k in fam:
                joined.setdefault(k, hits[0])
            continue
        placed = place_unit(unit, open_engines)
        if placed is None and unit.aged:
            placed = place_each(unit.calls, open_engines, aged=True, partial=True)
        if placed:
            for c, eid in placed:
                out.append(p._commit(c, state[eid], single=p._single(unit)))
                for k in fam:
                    joined.setdefault(k, eid)
        if unit.aged and (placed is None or len(placed) < len(unit.calls)) and open_engines:
            reserved.add(max(open_engines, key=lambda s: (s.free_kv_tokens, s.engine_id)).engine_id)
    return out


def test_placements_kept_from_trial_copies_decide_as_before() -> None:
    import random

    rng = random.Random(11)
    pool = [Prefix(f"k{i}", i + 1, 10 * (i + 1)) for i in range(6)]
    for _ in range(3000):
        config = PolicyConfig(
            latency_capacity=rng.randint(1, 4), max_batch=rng.randint(2, 8), aging_s=10.0
        )
        engines = [
            EngineSnapshot(
                f"e{j}",
                running_latency=rng.randint(0, 2),
                batch_size=rng.randint(0, 6),
                running_tokens=rng.randint(0, 500),
                free_kv_tokens=rng.randint(0, 600),
                prefixes=frozenset(p.key for p in pool if rng.random() < 0.3),
            )
            for j in range(rng.randint(1, 3))
        ]
        calls = []
        for i in range(rng.randint(0, 12)):
            k = rng.randint(0, 3)
            start = rng.randint(0, 3)
            calls.append(
                PendingCall(
                    f"c{i}",
                    rng.choice(["latency", "throughput"]),
                    rng.randint(1, 300),
                    NOW - rng.choice([0.0, 1.0, 5.0, 11.0, 30.0]),
                    tuple(pool[start : start + k]),
                    rng.choice([None, None, None, "g1", "g2"]),
                )
            )
        want = _reference_schedule(calls, engines, NOW, config)
        assert schedule(calls, engines, NOW, config) == want
