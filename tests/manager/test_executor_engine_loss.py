"""An engine that dies mid-run is retired and its calls run elsewhere, losing no run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from parrot_backend.contract.errors import EngineUnavailable
from parrot_backend.manager.manager import Manager
from parrot_backend.program import RunSpec
from parrot_backend.testing.fake_engine import ScriptedEngine


@dataclass
class DyingEngine(ScriptedEngine):
    """Works until `dead` is set; then every operation fails as a vanished remote would."""

    dead: bool = False

    def _check(self) -> None:
        if self.dead:
            raise EngineUnavailable("connection refused")

    async def fill(self, *args, **kwargs):
        self._check()
        return await super().fill(*args, **kwargs)

    async def generate(self, *args, **kwargs):
        self._check()
        async for delta in super().generate(*args, **kwargs):
            self._check()
            yield delta

    async def free(self, context_id):
        self._check()
        return await super().free(context_id)

    async def stats(self):
        self._check()
        return await super().stats()


def fan_out() -> RunSpec:
    calls = [
        {"name": f"w{i}", "template": f"Worker {i} on {{{{input:task}}}}: {{{{output:r{i}}}}}"}
        for i in range(4)
    ]
    calls.append(
        {
            "name": "sum",
            "template": "Sum "
            + " ".join(f"{{{{input:r{i}}}}}" for i in range(4))
            + " => {{output:total}}",
        }
    )
    return RunSpec.model_validate(
        {"program": {"calls": calls}, "inputs": {"task": "x"}, "outputs": {"total": "latency"}}
    )


def reply(prompt: str) -> str:
    return f"<{len(prompt)}>"


async def test_calls_on_a_dead_engine_are_dispatched_elsewhere() -> None:
    async with Manager({"solo": ScriptedEngine(reply=reply)}) as m:
        rid = await m.create_run(fan_out())
        expected = await m.get(rid, "total")

    gate = asyncio.Event()
    doomed = DyingEngine(reply=reply, gate=gate)
    healthy = ScriptedEngine(reply=reply, gate=gate)
    async with Manager({"doomed": doomed, "healthy": healthy}) as m:
        rid = await m.create_run(fan_out())
        for _ in range(200):  # until both engines run workers
            await asyncio.sleep(0.01)
            engines = {c.engine for c in m.run_status(rid).calls.values() if c.engine}
            if engines == {"doomed", "healthy"}:
                break
        assert engines == {"doomed", "healthy"}
        doomed.dead = True
        gate.set()
        total = await asyncio.wait_for(m.get(rid, "total"), 10)
        status = m.run_status(rid)
    assert total == expected
    assert "doomed" not in m.engines
    assert status.state == "finished"
    assert all(c.engine == "healthy" for c in status.calls.values())


async def test_an_added_engine_takes_work_and_a_foreign_model_is_refused() -> None:
    import pytest

    m = Manager({"a": ScriptedEngine(reply=reply)})
    async with m:
        m.add_engine("b", ScriptedEngine(reply=reply))
        assert set(m.engines) == {"a", "b"}
        with pytest.raises(ValueError, match="serves"):
            m.add_engine("c", ScriptedEngine(model_name="other"))
        moved = await m.remove_engine("a")
        rid = await m.create_run(fan_out())
        await asyncio.wait_for(m.get(rid, "total"), 10)
        assert moved == []
        assert {c.engine for c in m.run_status(rid).calls.values()} == {"b"}


async def test_an_engine_outliving_its_manager_serves_the_next_one_identically() -> None:
    engine = ScriptedEngine(reply=reply)
    outputs = []
    for _ in range(2):  # e.g. a remote engine across a manager restart
        async with Manager({"e": engine}) as m:
            rid = await m.create_run(fan_out())
            outputs.append(await m.get(rid, "total"))
        assert engine.contexts == {}  # the stopped manager freed its prefix contexts
    assert outputs[0] == outputs[1]


async def test_get_resolves_when_the_value_arrives_during_its_deduction() -> None:
    gate = asyncio.Event()

    class SlowObjectives:
        """A listener slow to record objective changes (a store under load); the call
        finishes meanwhile."""

        async def on_event(self, run_id, type, payload):
            latency = payload.get("calls", {}).get("c", {}).get("objective") == "latency"
            if type == "objectives" and latency and not gate.is_set():
                gate.set()
                await asyncio.sleep(0.2)

    engine = ScriptedEngine(reply=reply, gate=gate)
    async with Manager({"e": engine}, listeners=[SlowObjectives()]) as m:
        spec = RunSpec.model_validate(
            {
                "program": {"calls": [{"name": "c", "template": "Q {{input:q}} A {{output:a}}"}]},
                "inputs": {"q": "x"},
            }
        )
        rid = await m.create_run(spec)
        # the call runs while this get's deduction waits on the listener
        assert await asyncio.wait_for(m.get(rid, "a", perf="latency"), 5) == reply("Q x A ")
