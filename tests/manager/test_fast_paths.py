"""Each manager shortcut against its plain twin: the no-listener paths of `emit` and
`set_value` give the event log the listener path gives, and `EventLog.append` makes the
`Event` the named tuple's constructor makes."""

from __future__ import annotations

import pytest

from parrot_backend.manager.events import Event, EventLog
from parrot_backend.manager.manager import Manager
from parrot_backend.program import RunSpec
from parrot_backend.testing.fake_engine import ScriptedEngine


class PassThrough:
    """A listener that accepts every event: the manager takes its listener path."""

    async def on_event(self, run_id: str, type: str, payload: dict) -> None:
        return None


def _echo(prompt: str) -> str:
    return f"<{prompt.split()[-1]}>"


MAP_REDUCE = RunSpec.model_validate(
    {
        "program": {
            "calls": [
                *(
                    {
                        "name": f"m{i}",
                        "template": f"S. Part {i} of {{{{input:x}}}} {{{{output:p{i}}}}}",
                    }
                    for i in range(3)
                ),
                {
                    "name": "r",
                    "template": "Join {{input:p0}} {{input:p1}} {{input:p2}} {{output:y}}",
                },
                {"name": "c", "template": "Then {{input:y}} {{output:z}}"},
            ]
        },
        "inputs": {"x": "doc"},
        "outputs": {"z": "latency"},
    }
)


async def _log(listeners: list) -> list[tuple[int, str, dict]]:
    async with Manager({"e0": ScriptedEngine(reply=_echo)}, listeners=listeners) as m:
        rid = await m.create_run(MAP_REDUCE)
        await m.get(rid, "z")
        async for _ in m.subscribe(rid):  # until the run's end is logged
            pass
        return [(e.seq, e.type, e.payload) for e in m.runs[rid].log.events]


def _by_call(log: list[tuple[int, str, dict]]) -> dict[str | None, list[tuple[str, dict]]]:
    """Each call's events in log order (None: the run's own). With listeners a call's
    `call_started` is logged once recorded while the engine already runs (call_task.py),
    so events of different calls may interleave otherwise than on the fast path; one
    call's events, and the run's, keep their order."""
    out: dict[str | None, list[tuple[str, dict]]] = {}
    for _, type, payload in log:
        out.setdefault(payload.get("call"), []).append((type, payload))
    return out


@pytest.mark.parametrize("attempt", range(3))
async def test_no_listener_paths_log_what_the_listener_path_logs(attempt: int) -> None:
    plain = await _log([PassThrough()])
    fast = await _log([])
    assert [seq for seq, _, _ in fast] == list(range(1, len(plain) + 1))
    assert [seq for seq, _, _ in plain] == list(range(1, len(plain) + 1))
    assert _by_call(fast) == _by_call(plain)
    assert set(_by_call(plain)) == {None, "m0", "m1", "m2", "r", "c"}
    assert plain[-1][1] == "run_finished"


def test_append_makes_the_event_the_constructor_makes() -> None:
    log = EventLog("r1")
    payload = {"name": "y", "value": "v"}
    made = log.append("variable_ready", payload)
    assert made == Event("r1", 1, "variable_ready", payload)
    assert type(made) is Event
    assert (made.run_id, made.seq, made.type, made.payload) == ("r1", 1, "variable_ready", payload)
