"""Objective deduction on the paper's application shapes."""

from __future__ import annotations

import pytest

from parrot_backend.manager.objectives import CallObjective, deduce
from parrot_backend.program import Call, Program, UnknownVariableError


def program(*templates: tuple[str, str]) -> Program:
    return Program([Call.from_template(name, t) for name, t in templates])


def chain() -> Program:
    return program(
        ("outline", "{{input:topic}} {{output:outline}}"),
        ("draft", "{{input:outline}} {{output:draft}}"),
        ("polish", "{{input:draft}} {{output:final}}"),
    )


def map_reduce(n: int = 3) -> Program:
    maps = [(f"map{i}", f"{{{{input:chunk{i}}}}} {{{{output:s{i}}}}}") for i in range(n)]
    reads = " ".join(f"{{{{input:s{i}}}}}" for i in range(n))
    return program(*maps, ("reduce", f"{reads} {{{{output:summary}}}}"))


def multi_agent() -> Program:
    """A planner fans out to three agents; a judge reads all of them (fan-out, fan-in)."""
    agents = [
        (f"agent{i}", f"{{{{input:plan}}}} role {i}: {{{{output:reply{i}}}}}") for i in range(3)
    ]
    return program(
        ("planner", "{{input:task}} {{output:plan}}"),
        *agents,
        ("judge", "{{input:reply0}} {{input:reply1}} {{input:reply2}} {{output:verdict}}"),
    )


def test_chain_latency_flows_to_every_upstream_call() -> None:
    d = deduce(chain(), {"final": "latency"})
    assert {name: c.objective for name, c in d.calls.items()} == {
        "outline": "latency",
        "draft": "latency",
        "polish": "latency",
    }
    assert d.groups == []


def test_waiting_on_the_middle_of_a_chain_leaves_the_tail_throughput() -> None:
    d = deduce(chain(), {"draft": "latency"})
    assert d.calls["draft"].objective == "latency"
    assert d.calls["outline"].objective == "latency"
    assert d.calls["polish"].objective == "throughput"


def test_nobody_waiting_means_throughput() -> None:
    d = deduce(chain(), {})
    assert {c.objective for c in d.calls.values()} == {"throughput"}


def test_map_reduce_maps_form_one_latency_task_group() -> None:
    d = deduce(map_reduce(), {"summary": "latency"})
    assert len(d.groups) == 1
    group = d.groups[0]
    assert group.members == ("map0", "map1", "map2")
    assert group.consumers == ("reduce",)
    assert group.objective == "latency"
    assert all(d.calls[m].group == group.id for m in group.members)
    assert d.calls["reduce"].group is None
    assert d.calls["reduce"].objective == "latency"
    assert d.group_of("map1") is group


def test_map_reduce_for_throughput_keeps_the_group() -> None:
    d = deduce(map_reduce(), {"summary": "throughput"})
    assert d.groups[0].objective == "throughput"
    assert {c.objective for c in d.calls.values()} == {"throughput"}


def test_multi_agent_fan_out_fan_in() -> None:
    d = deduce(multi_agent(), {"verdict": "latency"})
    assert [g.members for g in d.groups] == [("agent0", "agent1", "agent2")]
    assert d.groups[0].objective == "latency"
    # the planner is the agents' sole producer: it inherits latency, alone
    assert d.calls["planner"].objective == "latency"
    assert d.calls["planner"].group is None


def test_latency_chat_and_throughput_batch_in_one_program() -> None:
    p = map_reduce(2)
    p.add_call(Call.from_template("chat", "{{input:question}} {{output:answer}}"))
    d = deduce(p, {"answer": "latency", "summary": "throughput"})
    assert d.calls["chat"] == CallObjective("latency", None)
    assert d.groups[0].objective == "throughput"
    assert all(d.calls[m].objective == "throughput" for m in ("map0", "map1", "reduce"))


def test_producer_upstream_of_another_producer_is_not_in_the_group() -> None:
    # a -> b -> c and a -> c: a and b are not parallel, so no group
    p = program(
        ("a", "{{input:x}} {{output:va}}"),
        ("b", "{{input:va}} {{output:vb}}"),
        ("c", "{{input:va}} {{input:vb}} {{output:vc}}"),
    )
    d = deduce(p, {"vc": "latency"})
    assert d.groups == []
    assert {c.objective for c in d.calls.values()} == {"latency"}


def test_groups_sharing_a_member_merge() -> None:
    p = program(
        ("a", "{{output:va}}"),
        ("b", "{{output:vb}}"),
        ("c", "{{output:vc}}"),
        ("ab", "{{input:va}} {{input:vb}} {{output:x}}"),
        ("bc", "{{input:vb}} {{input:vc}} {{output:y}}"),
    )
    d = deduce(p, {"x": "throughput", "y": "latency"})
    assert [g.members for g in d.groups] == [("a", "b", "c")]
    assert d.groups[0].consumers == ("ab", "bc")
    assert d.groups[0].objective == "latency"


def test_member_keeps_its_own_latency_inside_a_throughput_group() -> None:
    p = map_reduce(2)
    p.add_call(Call.from_template("peek", "{{input:s0}} {{output:quick}}"))
    d = deduce(p, {"summary": "throughput", "quick": "latency"})
    assert d.groups[0].objective == "throughput"
    assert d.calls["map0"].objective == "latency"
    assert d.calls["map1"].objective == "throughput"


def test_waiting_on_a_program_input_changes_nothing() -> None:
    d = deduce(chain(), {"topic": "latency"})
    assert {c.objective for c in d.calls.values()} == {"throughput"}


def test_unknown_waited_variable_is_named() -> None:
    with pytest.raises(UnknownVariableError, match="'nope'"):
        deduce(chain(), {"nope": "latency"})


def _reference(p: Program, waits: dict[str, str]) -> dict[str, tuple[str, frozenset[str]]]:
    """The deduction spelled out with networkx on `call_graph()`: each call's objective
    and the members of its group (group ids aside)."""
    import networkx as nx

    g = p.call_graph()
    latency: set[str] = set()
    for name, crit in waits.items():
        producer = p.variables[name].producer
        if crit == "latency" and producer is not None:
            latency |= {producer} | nx.ancestors(g, producer)
    groups = nx.Graph()
    for consumer in g:
        producers = list(g.predecessors(consumer))
        upstream = set().union(*(nx.ancestors(g, q) for q in producers))
        frontier = [q for q in producers if q not in upstream]
        if len(frontier) >= 2:
            nx.add_path(groups, frontier)
    member_of = {c: frozenset(comp) for comp in nx.connected_components(groups) for c in comp}
    return {
        c: ("latency" if c in latency else "throughput", member_of.get(c, frozenset()))
        for c in p.calls
    }


def test_deduction_matches_a_networkx_reference_on_random_dags() -> None:
    import random

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 9)
        templates = []
        for i in range(n):
            reads = [f"v{j}" for j in range(i) if rng.random() < 0.35]
            reads += [f"in{i}"] if not reads or rng.random() < 0.3 else []
            text = " ".join(f"{{{{input:{r}}}}}" for r in reads)
            templates.append((f"c{i}", f"{text} {{{{output:v{i}}}}}"))
        p = program(*templates)
        waits = {
            f"v{i}": rng.choice(["latency", "throughput"]) for i in range(n) if rng.random() < 0.4
        }
        got = deduce(p, waits)
        want = _reference(p, waits)
        for name, (objective, members) in want.items():
            found = got.calls[name]
            assert found.objective == objective, (name, templates, waits)
            group = got.group_of(name)
            assert frozenset(group.members if group else ()) == members, (name, templates)
        ids = [g.id for g in got.groups]
        assert ids == list(range(len(ids)))


def test_shared_deduction_equals_a_fresh_one_for_programs_of_shared_calls() -> None:
    """Runs of a workflow share their Call objects: `deduce_shared` hands the same
    deduction to programs of the same calls and waits, and a fresh one otherwise."""
    import random

    from parrot_backend.manager.objectives import deduce_shared

    rng = random.Random(3)
    pool: list[Call] = []
    for i in range(8):
        reads = [f"v{j}" for j in range(i) if rng.random() < 0.4] or [f"in{i}"]
        text = " ".join(f"{{{{input:{r}}}}}" for r in reads)
        pool.append(Call.from_template(f"c{i}", f"{text} {{{{output:v{i}}}}}"))
    for _ in range(300):
        n = rng.randint(1, len(pool))
        p = Program(pool[:n])  # a prefix of the pool: every input is produced or given
        waits = {
            f"v{i}": rng.choice(["latency", "throughput"]) for i in range(n) if rng.random() < 0.3
        }
        got = deduce_shared(p, waits)
        want = deduce(p, waits)
        assert got.calls == want.calls
        assert got.groups == want.groups
        assert deduce_shared(Program(pool[:n]), dict(waits)) is got  # shared
    # same names and templates, other Call objects: not the cached deduction's calls
    again = Program([Call.from_template(c.name, c.template) for c in pool[:3]])
    assert deduce_shared(again, {}).calls == deduce(again, {}).calls
    with pytest.raises(UnknownVariableError, match="'nope'"):
        deduce_shared(chain(), {"nope": "latency"})
