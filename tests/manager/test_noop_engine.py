"""The manager benchmark's no-op engine keeps the engine contract it checks, and a manager
running a shared-prefix map-reduce on it frees every context it made."""

from __future__ import annotations

import pytest

from parrot_backend.contract.errors import ContextNotFound
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.manager.manager import Manager
from parrot_backend.program import RunSpec
from parrot_backend.testing.fake_engine import NoopEngine

SYSTEM = "You are a careful analyst. Summarize the text you are given. "


async def test_noop_engine_contract() -> None:
    engine = NoopEngine()
    assert await engine.fill("a", None, [1, 2, 3]) == 3
    deltas = [d async for d in engine.generate("b", "a", SamplingParams())]
    assert [(d.text, d.finish_reason) for d in deltas] == [("", "stop")]
    with pytest.raises(ContextNotFound):
        engine.generate("c", "missing", SamplingParams())
    with pytest.raises(ContextNotFound):
        await engine.fill("c", "missing", [1])
    await engine.free("b")
    await engine.free("a")
    with pytest.raises(ContextNotFound):
        await engine.free("a")
    assert not engine.live and (await engine.stats()).free_tokens > 0


async def test_manager_on_the_noop_engine_frees_everything() -> None:
    calls = [
        {"name": f"m{k}", "template": SYSTEM + f"Text: {{{{input:c{k}}}}} S: {{{{output:s{k}}}}}"}
        for k in range(4)
    ]
    calls.append({"name": "r", "template": "All {{input:s0}} {{input:s2}}: {{output:t}}"})
    engine = NoopEngine()
    async with Manager({"e0": engine}) as m:
        ids = []
        for i in range(3):
            spec = {
                "program": {"calls": calls},
                "inputs": {f"c{k}": f"doc {i}.{k}" for k in range(4)},
                "outputs": {"t": "throughput"},
            }
            ids.append(await m.create_run(RunSpec.model_validate(spec)))
        for rid in ids:
            assert await m.get(rid, "t") == ""
            async for _ in m.subscribe(rid):
                pass
            assert m.run_status(rid).state == "finished"
        # the system prompt once for all runs; the reduce's prompt is the same in every
        # run (empty values): its three prefixes ("All ", then after each value) once
        assert m.sharing.fills["e0"] == 4
        assert m.sharing.forks["e0"] == 15  # every call forked from a shared prefix
    assert not engine.live  # calls' contexts freed as they end, the prefix at stop


async def test_engine_load_returns_to_zero_after_cancels_and_ends() -> None:
    import asyncio

    from parrot_backend.testing.fake_engine import ScriptedEngine

    gate = asyncio.Event()
    engine = ScriptedEngine(reply=lambda p: "ab", gate=gate)
    async with Manager({"e0": engine}) as m:
        spec = {"program": {"calls": [{"template": "Q {{input:q}} A {{output:a}}"}]}}
        ids = [
            await m.create_run(RunSpec.model_validate({**spec, "inputs": {"q": str(i)}}))
            for i in range(4)
        ]
        while m.counts()["running_calls"] < 4:
            await asyncio.sleep(0.01)
        await m.cancel(ids[0])
        await m.cancel(ids[1])
        gate.set()
        assert [await m.get(r, "a") for r in ids[2:]] == ["ab", "ab"]
        while m.counts()["running_calls"]:
            await asyncio.sleep(0.01)
        load = m.engine_set.load["e0"]
        assert (load.batch, load.tokens, load.latency) == (0, 0, 0)
        assert m.counts()["running_calls"] == 0
        assert all(c.startswith("pfx:") for c in engine.contexts)  # only the hot prefix
    assert not engine.contexts  # freed when the manager stops


async def test_a_call_that_cannot_be_rendered_fails_and_the_rest_go_on() -> None:
    """Calls are rendered when the dispatcher first offers them: a render error (here a
    tokenizer giving an id out of range) fails that call and what depends on it."""
    from parrot_backend.testing.fake_engine import ScriptedEngine

    class BadTokens(ScriptedEngine):
        def tokenize(self, text: str, *, data: bool = False) -> list[int]:
            return [2**40] if "BAD" in text else super().tokenize(text)

    engine = BadTokens(reply=lambda p: "fine")
    calls = [
        {"name": "a", "template": "Q {{input:q}} A {{output:x}}"},
        {"name": "b", "template": "Then {{input:x}} B {{output:y}}"},
    ]
    async with Manager({"e0": engine}) as m:
        bad = await m.create_run(
            RunSpec.model_validate({"program": {"calls": calls}, "inputs": {"q": "BAD"}})
        )
        good = await m.create_run(
            RunSpec.model_validate({"program": {"calls": calls}, "inputs": {"q": "ok"}})
        )
        assert await m.get(good, "y") == "fine"
        from parrot_backend.manager.runs import VariableFailed

        with pytest.raises(VariableFailed, match="rendering the call failed: ValueError"):
            await m.get(bad, "y")
        async for _ in m.subscribe(bad):
            pass
        status = m.run_status(bad)
        assert status.state == "failed"
        assert status.calls["a"].state == "failed" and status.calls["b"].state == "failed"
        assert m.counts()["pending_calls"] == 0
