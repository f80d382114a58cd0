"""The executor across several engines, and when engines or listeners misbehave."""

from __future__ import annotations

import asyncio

import pytest

from parrot_backend.manager.manager import Manager
from parrot_backend.manager.runs import RunCancelled
from parrot_backend.program import RunSpec
from parrot_backend.testing.fake_engine import ScriptedEngine


def one_call(template: str, **inputs: str) -> RunSpec:
    return RunSpec.model_validate(
        {"program": {"calls": [{"name": "c", "template": template}]}, "inputs": inputs}
    )


async def test_calls_with_a_filled_prefix_follow_it_to_its_engine() -> None:
    e0, e1 = ScriptedEngine(), ScriptedEngine()
    system = "A system prompt that both runs share. "
    async with Manager({"e0": e0, "e1": e1}) as m:
        first = await m.create_run(one_call(system + "{{input:q}} {{output:a}}", q="one"))
        await m.get(first, "a")
        holder = m.run_status(first).calls["c"].engine
        for q in ("two", "three"):
            rid = await m.create_run(one_call(system + "{{input:q}} {{output:a}}", q=q))
            await m.get(rid, "a")
            assert m.run_status(rid).calls["c"].engine == holder
        filled = {
            eid: [f for f in e.fills if f.text == system] for eid, e in (("e0", e0), ("e1", e1))
        }
        assert len(filled[holder]) == 1 and sum(map(len, filled.values())) == 1


async def test_parallel_calls_without_a_shared_prefix_spread_over_engines() -> None:
    gate = asyncio.Event()
    e0, e1 = ScriptedEngine(gate=gate), ScriptedEngine(gate=gate)
    calls = [{"name": f"c{i}", "template": f"{i} {{{{output:o{i}}}}}"} for i in range(4)]
    spec = RunSpec.model_validate({"program": {"calls": calls}})
    async with Manager({"e0": e0, "e1": e1}) as m:
        rid = await m.create_run(spec)
        while len(e0.generating) + len(e1.generating) < 4:
            await asyncio.sleep(0)
        assert len(e0.generating) == 2 and len(e1.generating) == 2
        gate.set()
        assert [await m.get(rid, f"o{i}") for i in range(4)] == ["ok"] * 4


async def test_an_engine_whose_stats_fail_takes_no_work() -> None:
    class Broken(ScriptedEngine):
        async def stats(self):
            raise ConnectionError("engine unreachable")

    broken, healthy = Broken(), ScriptedEngine()
    async with Manager({"bad": broken, "good": healthy}) as m:
        rid = await m.create_run(one_call("Hello {{output:a}}"))
        assert await m.get(rid, "a") == "ok"
        assert m.run_status(rid).calls["c"].engine == "good" and broken.generations == []


async def test_stop_frees_contexts_without_marking_runs_cancelled() -> None:
    engine = ScriptedEngine(gate=asyncio.Event())
    m = Manager({"e0": engine})
    await m.start()
    rid = await m.create_run(one_call("Long task {{output:a}}"))
    waiter = asyncio.create_task(m.get(rid, "a"))
    while not engine.generating:
        await asyncio.sleep(0)
    await m.stop()
    with pytest.raises(RunCancelled, match="stopped"):
        await waiter
    assert [c for c in engine.contexts if not str(c).startswith("pfx:")] == []
    assert "run_finished" not in [e.type for e in m.runs[rid].log.events]  # resumable


async def test_a_listener_that_cannot_record_the_end_fails_the_call() -> None:
    class NoEnd:
        async def on_event(self, run_id: str, type: str, payload: dict) -> None:
            if type == "call_finished":
                raise OSError("store down")

    async with Manager({"e0": ScriptedEngine()}, listeners=[NoEnd()]) as m:
        rid = await m.create_run(one_call("x {{output:y}}"))
        assert await m.get(rid, "y") == "ok"  # recorded before the end was refused
        ends = [e.payload async for e in m.subscribe(rid) if e.type == "run_finished"]
        assert ends == [{"status": "failed"}]  # the run ends instead of hanging
        status = m.run_status(rid).calls["c"]
        assert status.state == "failed" and "store down" in status.error


async def test_a_small_run_is_not_held_back_by_a_big_backlog() -> None:
    from parrot_backend.manager.manager import ManagerConfig
    from parrot_backend.manager.policy import PolicyConfig

    gate = asyncio.Event()
    engine = ScriptedEngine(gate=gate)
    config = ManagerConfig(policy=PolicyConfig(latency_capacity=2, max_batch=2))
    big = RunSpec.model_validate(
        {"program": {"calls": [{"template": f"job {i} {{{{output:o{i}}}}}"} for i in range(10)]}}
    )
    async with Manager({"e0": engine}, config=config) as m:
        big_id = await m.create_run(big)
        small_id = await m.create_run(one_call("small {{output:a}}"))
        while len(engine.generating) < 2:
            await asyncio.sleep(0)
        # one of the only two slots went to the small run, not both to the big backlog
        assert m.run_status(small_id).calls["c"].state == "running"
        gate.set()
        assert await m.get(small_id, "a") == "ok"
        assert await m.get(big_id, "o9") == "ok"
