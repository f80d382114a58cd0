"""A call's `call_started` is recorded while the engine already starts the call
(`call_task.py`): the engine does not wait for the store's commit, yet no token or value
of the call reaches a listener before its start; and a start that cannot be recorded
because another manager holds the call still drops the run here, engine work included."""

from __future__ import annotations

import asyncio

import pytest

from parrot_backend.manager.manager import Manager
from parrot_backend.manager.runs import RunCancelled, RunOwnedElsewhere
from parrot_backend.program import RunSpec
from parrot_backend.testing.fake_engine import ScriptedEngine

SPEC = RunSpec.model_validate(
    {
        "program": {
            "calls": [
                {"name": f"m{i}", "template": f"Part {i} of {{{{input:x}}}}: {{{{output:p{i}}}}}"}
                for i in range(3)
            ]
        },
        "inputs": {"x": "a document"},
        "outputs": {f"p{i}": "latency" for i in range(3)},
    }
)


class HeldStarts:
    """A listener whose `call_started` writes wait for `release` (a slow store), then
    succeed or, with `lose`, fail as another manager's claim would."""

    def __init__(self, lose: bool = False) -> None:
        self.release = asyncio.Event()
        self.lose = lose
        self.seen: list[tuple[str, str | None]] = []

    async def on_event(self, run_id: str, type: str, payload: dict) -> None:
        if type == "call_started":
            await self.release.wait()
            if self.lose:
                raise RunOwnedElsewhere(f"call {payload['call']!r} is held elsewhere")
        self.seen.append((type, payload.get("call")))


async def _until(cond, what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


async def test_the_engine_starts_calls_before_their_start_is_recorded() -> None:
    engine = ScriptedEngine(reply=lambda prompt: "a summary")
    held = HeldStarts()
    async with Manager({"e0": engine}, listeners=[held]) as m:
        rid = await m.create_run(SPEC)
        # every call reached the engine while no start was recorded yet
        await _until(lambda: len(engine.fills) >= 3, "the three calls' fills")
        await asyncio.sleep(0.05)  # the generations run on to their first token, and wait
        assert not any(t in {"call_started", "token", "variable_ready"} for t, _ in held.seen)
        assert all(e.type != "token" for e in m.runs[rid].log.events)
        held.release.set()
        values = [await m.get(rid, f"p{i}") for i in range(3)]
    assert values == ["a summary"] * 3
    for call in ("m0", "m1", "m2"):
        mine = [t for t, c in held.seen if c == call]
        assert mine[0] == "call_started"
        assert "token" in mine and "variable_ready" in mine


async def test_a_start_lost_to_another_manager_drops_the_run_and_its_engine_work() -> None:
    engine = ScriptedEngine(reply=lambda prompt: "a summary")
    held = HeldStarts(lose=True)
    async with Manager({"e0": engine}, listeners=[held]) as m:
        rid = await m.create_run(SPEC)
        await _until(lambda: len(engine.fills) >= 3, "the three calls' fills")
        waiter = asyncio.create_task(m.get(rid, "p0"))
        await asyncio.sleep(0.01)
        held.release.set()
        with pytest.raises(RunCancelled):
            await waiter
        await _until(lambda: rid not in m.runs, "the run to be dropped")
        # each call's own context is freed (the prompts' static prefixes stay filled, idle,
        # for later runs to fork from, as after any run)
        await _until(lambda: len(engine.freed) == 3, "the calls' contexts to be freed")
        assert not [c for c in engine.contexts if str(c).startswith("call:")]
        assert not engine.generating
    # nothing of the calls was told to a listener: the other manager records the run
    assert [t for t, _ in held.seen if t in {"token", "variable_ready", "call_finished"}] == []
