"""Values that arrive while a run's events wait to be written are told to the listeners
together (`RunTransitions.set_value`: `on_values`, one store transaction), each once, in
order with the calls' own events; a group that cannot be written fails each of its
values' calls, and only those."""

from __future__ import annotations

import asyncio

import pytest

from parrot_backend.manager.manager import Manager
from parrot_backend.program import RunSpec
from parrot_backend.testing.fake_engine import ScriptedEngine

FAN = 6
SPEC = RunSpec.model_validate(
    {
        "program": {
            "calls": [
                *(
                    {
                        "name": f"m{i}",
                        "template": f"Part {i} of {{{{input:x}}}}: {{{{output:p{i}}}}}",
                    }
                    for i in range(FAN)
                ),
                {
                    "name": "r",
                    "template": "Join "
                    + " ".join(f"{{{{input:p{i}}}}}" for i in range(FAN))
                    + " {{output:y}}",
                },
            ]
        },
        "inputs": {"x": "a document"},
        "outputs": {"y": "latency"},
    }
)


class SlowStore:
    """A listener that takes a while per write (as a store's commit), recording each
    event it is told and the groups of values; `fail` names a value whose group fails."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.seen: list[tuple[str, dict]] = []
        self.groups: list[list[str]] = []

    async def on_event(self, run_id: str, type: str, payload: dict) -> None:
        await asyncio.sleep(0.005 if type != "token" else 0)
        self.seen.append((type, payload))

    async def on_values(self, run_id: str, payloads: list[dict]) -> None:
        await asyncio.sleep(0.02)
        names = [p["name"] for p in payloads]
        self.groups.append(names)
        if self.fail in names:
            raise RuntimeError("database hiccup")
        self.seen.extend(("variable_ready", p) for p in payloads)


def _reply(prompt: str) -> str:
    return "j" if prompt.startswith("Join") else f"s{prompt.split()[1]}"


async def test_a_fan_outs_values_are_told_together_each_once_in_order() -> None:
    store = SlowStore()
    # the map calls are held until all generate, then end together
    engine = ScriptedEngine(reply=_reply, gate=asyncio.Event())
    async with Manager({"e0": engine}, listeners=[store]) as m:
        rid = await m.create_run(SPEC)
        for _ in range(5000):
            if len(engine.generations) == FAN:
                break
            await asyncio.sleep(0.001)
        engine.gate.set()
        assert await m.get(rid, "y") == "j"
        log = [(e.type, e.payload) for e in m.runs[rid].log.events]
        values = {f"p{i}": f"s{i}" for i in range(FAN)}
        assert {k: m.runs[rid].values[k] for k in values} == values
    # every value once, some of them in one group (they end together; a write takes 20 ms)
    told = [n for g in store.groups for n in g]
    assert sorted(told) == sorted([*values, "y"])
    assert max(len(g) for g in store.groups) > 1
    # the listener and the log saw the same events in the same order
    assert [(t, p) for t, p in store.seen] == log
    # a call's value comes after its tokens and before its end
    for i in range(FAN):
        mine = [t for t, p in log if p.get("call") == f"m{i}"]
        assert mine[0] == "call_started" and mine[-1] == "call_finished"
        assert mine[-2] == "variable_ready" and "token" in mine[1:-2]


async def test_a_group_that_cannot_be_written_fails_its_values_calls_only() -> None:
    store = SlowStore(fail="p3")
    async with Manager({"e0": ScriptedEngine(reply=_reply)}, listeners=[store]) as m:
        rid = await m.create_run(SPEC)
        with pytest.raises(Exception, match="hiccup"):
            await m.get(rid, "y")
        run = m.runs[rid]
        failed_group = next(g for g in store.groups if "p3" in g)
        for i in range(FAN):
            name = f"p{i}"
            if name in failed_group:
                assert run.calls[f"m{i}"].state == "failed"
                assert "hiccup" in run.calls[f"m{i}"].error
                assert name not in run.values
            else:
                assert run.values[name] == f"s{i}"
        assert run.calls["r"].state != "finished"
