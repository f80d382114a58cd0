"""The run executor on a scripted engine: rendering, dependencies, multi-output calls,
open runs, cancellation, failures, prefix sharing, events."""

from __future__ import annotations

import asyncio

import pytest

from parrot_backend.manager.manager import Manager
from parrot_backend.manager.prefix import Prefix
from parrot_backend.manager.render import PromptTokenizer, plan_call
from parrot_backend.manager.runs import RunCancelled, RunClosedError, RunNotFound, VariableFailed
from parrot_backend.program import Call, CallSpec, RunSpec
from parrot_backend.testing.fake_engine import ScriptedEngine


def spec(*calls: dict, inputs: dict | None = None, outputs: dict | None = None, **kw) -> RunSpec:
    return RunSpec.model_validate(
        {"program": {"calls": list(calls)}, "inputs": inputs or {}, "outputs": outputs or {}, **kw}
    )


def echo(prompt: str) -> str:
    """Reply with the prompt's last word in brackets: values show where they came from."""
    return f"<{prompt.split()[-1] if prompt.split() else ''}>"


async def test_plan_prompt_is_the_whole_prompt_text_tokenized() -> None:
    engine = ScriptedEngine()
    call = Call.from_template(
        "c", "Sys: {{input:a}} and {{input:b}}! {{output:x}} tail {{output:y}} never"
    )
    plan = plan_call(call, {"a": "1", "b": "22"}, PromptTokenizer.for_engine(engine))
    assert plan.prompt == engine.tokenize("Sys: 1 and 22! ")
    assert [s.output for s in plan.steps] == ["x", "y"]
    assert plan.steps[0].then == engine.tokenize(" tail ")
    assert plan.steps[1].then == []  # text after the last output is never filled
    assert plan.n_tokens == len(plan.prompt) + len(plan.steps[0].then) + 2 * 128


async def test_dependent_calls_run_without_the_client() -> None:
    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec(
                {"name": "a", "template": "Start {{input:x}} {{output:y}}"},
                {"name": "b", "template": "Then {{input:y}} {{output:z}}"},
                {"name": "c", "template": "Finally {{input:z}} {{output:w}}"},
                inputs={"x": "go"},
            )
        )
        assert await m.get(rid, "w") == "<<<go>>>"
        prompts = [g.prompt for g in engine.generations]
        assert prompts == ["Start go ", "Then <go> ", "Finally <<go>> "]
        types = [
            (e.type, e.payload.get("name", e.payload.get("call"))) for e in m.runs[rid].log.events
        ]
        assert types.index(("variable_ready", "y")) < types.index(("call_started", "b"))
        assert types.index(("variable_ready", "z")) < types.index(("call_started", "c"))
        assert m.run_status(rid).state == "finished"


async def test_multi_output_call_generates_in_order_in_one_context() -> None:
    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec(
                {"name": "c", "template": "Q {{input:x}} A1: {{output:a}} A2: {{output:b}}"},
                inputs={"x": "hi"},
            )
        )
        assert await m.get(rid, "b") == "<A2:>"
        assert m.run_status(rid).values["a"] == "<A1:>"
        first, second = engine.generations
        assert first.prompt == "Q hi A1: "
        # the second output continues the first one's context: the prompt holds its value
        assert second.prompt == "Q hi A1: <A1:> A2: "
        assert second.context_id == first.context_id


async def test_multi_output_stop_string_refills_exactly_the_value() -> None:
    engine = ScriptedEngine(reply=lambda p: "yes. and more" if p.endswith("1: ") else "fine")
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec(
                {
                    "name": "c",
                    "template": "Q 1: {{output:a}} 2: {{output:b}}",
                    "outputs": {"a": {"stop": ["."]}},
                }
            )
        )
        assert await m.get(rid, "a") == "yes"
        await m.get(rid, "b")
        # the stop text "." is not in the context the second output reads
        assert engine.generations[1].prompt == "Q 1: yes 2: "


async def test_open_run_takes_calls_and_inputs_later() -> None:
    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec({"name": "a", "template": "Say {{input:x}} {{output:y}}"}, open=True)
        )
        await m.add_calls(rid, [CallSpec(template="Then {{input:y}} {{output:z}}")])
        getter = asyncio.create_task(m.get(rid, "z"))
        await asyncio.sleep(0)
        assert engine.generations == []  # x has no value yet
        await m.set_input(rid, "x", "late")
        assert await getter == "<<late>>"
        assert m.run_status(rid).state == "running"  # open runs go on until closed
        await m.close_run(rid)
        assert m.run_status(rid).state == "finished"
        with pytest.raises(RunClosedError):
            await m.add_calls(rid, [CallSpec(template="x {{output:q}}")])


async def test_cancel_frees_contexts_and_fails_waiters() -> None:
    engine = ScriptedEngine(reply=lambda p: "long reply", gate=asyncio.Event())
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec(
                {"name": "a", "template": "Shared system prompt here. {{input:x}} {{output:y}}"},
                {"name": "b", "template": "Shared system prompt here. {{input:x}}! {{output:z}}"},
                inputs={"x": "go"},
            )
        )
        waiter = asyncio.create_task(m.get(rid, "y"))
        while len(engine.generating) < 2:
            await asyncio.sleep(0)
        await m.cancel(rid)
        with pytest.raises(RunCancelled):
            await waiter
        call_contexts = [c for c in engine.contexts if not str(c).startswith("pfx:")]
        assert call_contexts == []
        assert m.run_status(rid).state == "cancelled"
        assert m.runs[rid].log.events[-1].payload == {"status": "cancelled"}


async def test_engine_failure_fails_downstream_and_spares_other_runs() -> None:
    engine = ScriptedEngine(reply=echo, fail_if=lambda p: "boom" in p)
    async with Manager({"e0": engine}) as m:
        bad = await m.create_run(
            spec(
                {"name": "a", "template": "Do {{input:x}} {{output:y}}"},
                {"name": "b", "template": "Use {{input:y}} {{output:z}}"},
                inputs={"x": "boom"},
            )
        )
        good = await m.create_run(
            spec({"name": "a", "template": "Do {{input:x}} {{output:y}}"}, inputs={"x": "fine"})
        )
        with pytest.raises(VariableFailed, match="'z'.*input 'y' failed.*scripted failure"):
            await m.get(bad, "z")
        assert await m.get(good, "y") == "<fine>"
        status = m.run_status(bad)
        assert status.state == "failed"
        assert status.calls["a"].state == "failed" and status.calls["b"].state == "failed"
        assert "EngineError" in status.failed["y"]
        assert [c for c in engine.contexts if not str(c).startswith("pfx:")] == []


async def test_shared_system_prompt_is_filled_once_across_runs() -> None:
    engine = ScriptedEngine(reply=echo)
    system = "You are a helpful assistant. "
    async with Manager({"e0": engine}) as m:
        runs = []
        for q in ("one", "two", "three"):
            runs.append(
                await m.create_run(
                    spec(
                        {"name": "a", "template": system + "{{input:q}} {{output:y}}"},
                        inputs={"q": q},
                    )
                )
            )
            await m.get(runs[-1], "y")
        system_fills = [f for f in engine.fills if f.text == system]
        assert len(system_fills) == 1 and system_fills[0].parent_id is None
        forked = [f for f in engine.fills if f.parent_id == system_fills[0].context_id]
        assert [f.text for f in forked] == ["one ", "two ", "three "]
        assert m.sharing.fills["e0"] == 1


async def test_tenants_do_not_share_a_private_prefix_but_public_programs_do() -> None:
    engine = ScriptedEngine(reply=echo)
    system = "A long enough system prompt. "
    call = {"name": "a", "template": system + "{{input:q}} {{output:y}}"}
    async with Manager({"e0": engine}) as m:
        for tenant in ("t1", "t2"):
            await m.get(await m.create_run(spec(call, inputs={"q": "x"}), tenant=tenant), "y")
        assert len([f for f in engine.fills if f.text == system]) == 2
        public = {"program": {"calls": [call], "public": True}, "inputs": {"q": "x"}}
        for tenant in ("t1", "t2"):
            await m.get(await m.create_run(RunSpec.model_validate(public), tenant=tenant), "y")
        assert len([f for f in engine.fills if f.text == system]) == 3


async def test_dynamic_prefix_is_filled_once_for_its_readers() -> None:
    engine = ScriptedEngine(reply=lambda p: "PLAN" if p.startswith("Plan") else echo(p))
    readers = [
        {
            "name": f"r{i}",
            "template": "Team plan: {{input:plan}} Role " + str(i) + " {{output:o" + str(i) + "}}",
        }
        for i in range(3)
    ]
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec(
                {"name": "p", "template": "Plan {{input:x}} {{output:plan}}"},
                *readers,
                inputs={"x": "go"},
            )
        )
        values = [await m.get(rid, f"o{i}") for i in range(3)]
        assert values == ["<0>", "<1>", "<2>"]
        plan_fills = [f for f in engine.fills if "PLAN" in f.text]
        assert len(plan_fills) == 1  # the generated value's tokens were computed once
        prefix_ctx = plan_fills[0].context_id
        role_fills = [f for f in engine.fills if f.parent_id == prefix_ctx]
        assert sorted(f.text for f in role_fills) == [" Role 0 ", " Role 1 ", " Role 2 "]


async def test_listener_is_awaited_before_get_sees_the_value() -> None:
    seen: list[str] = []

    class SlowStore:
        async def on_event(self, run_id: str, type: str, payload: dict) -> None:
            await asyncio.sleep(0.01)  # a write that takes a while
            seen.append(f"{type}:{payload.get('name', '')}")

    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}, listeners=[SlowStore()]) as m:
        rid = await m.create_run(
            spec({"name": "a", "template": "Do {{input:x}} {{output:y}}"}, inputs={"x": "it"})
        )
        assert await m.get(rid, "y") == "<it>"
        assert "variable_ready:y" in seen  # written before get returned
        await asyncio.sleep(0.1)
        logged = [e.type for e in m.runs[rid].log.events]
        assert [s.split(":")[0] for s in seen] == logged  # same events, same order
        assert [e.seq for e in m.runs[rid].log.events] == list(range(1, len(logged) + 1))


async def test_failing_listener_keeps_the_value_invisible() -> None:
    class Refuses:
        async def on_event(self, run_id: str, type: str, payload: dict) -> None:
            if type == "variable_ready":
                raise OSError("disk full")

    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}, listeners=[Refuses()]) as m:
        rid = await m.create_run(
            spec({"name": "a", "template": "Do {{input:x}} {{output:y}}"}, inputs={"x": "it"})
        )
        with pytest.raises(VariableFailed, match="disk full"):
            await m.get(rid, "y")
        assert "y" not in m.run_status(rid).values


async def test_latency_waits_get_engine_priority_zero() -> None:
    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}) as m:
        chat = await m.create_run(
            spec(
                {"template": "Chat {{input:x}} {{output:y}}"},
                inputs={"x": "a"},
                outputs={"y": "latency"},
            )
        )
        batch = await m.create_run(
            spec(
                {"template": "Batch {{input:x}} {{output:y}}"},
                inputs={"x": "b"},
                outputs={"y": "throughput"},
            )
        )
        await m.get(chat, "y", perf="latency")
        await m.get(batch, "y", perf="throughput")
        by_prompt = {g.prompt.split()[0]: g.priority for g in engine.generations}
        assert by_prompt == {"Chat": 0, "Batch": 1}


async def test_subscribe_replays_then_follows_until_the_run_ends() -> None:
    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec({"name": "a", "template": "Do {{input:x}} {{output:y}}"}, inputs={"x": "it"})
        )
        events = [e async for e in m.subscribe(rid)]
        assert events[0].type == "run_created" and events[-1].type == "run_finished"
        tokens = "".join(e.payload["text"] for e in events if e.type == "token")
        assert tokens == "<it>"
        later = [e.seq async for e in m.subscribe(rid, after=len(events) - 2)]
        assert later == [len(events) - 1, len(events)]


async def test_known_values_are_not_generated_again() -> None:
    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec(
                {"name": "a", "template": "Do {{input:x}} {{output:y}}"},
                {"name": "b", "template": "Then {{input:y}} {{output:z}}"},
                inputs={"x": "it"},
            ),
            known={"y": "<recovered>"},
        )
        assert await m.get(rid, "z") == "<<recovered>>"
        assert [g.prompt for g in engine.generations] == ["Then <recovered> "]


async def test_idle_prefixes_are_evicted_when_the_engine_runs_short() -> None:
    engine = ScriptedEngine(reply=echo, capacity_tokens=16 * 40)
    async with Manager({"e0": engine}) as m:
        for i in range(3):
            system = f"System prompt number {i} is long. "
            rid = await m.create_run(
                spec(
                    {
                        "template": system + "{{input:x}} {{output:y}}",
                        "outputs": {"y": {"max_tokens": 590}},
                    },
                    inputs={"x": "q"},
                )
            )
            await m.get(rid, "y")
        prefixes = [c for c in engine.contexts if str(c).startswith("pfx:")]
        assert len(prefixes) == 1  # each older idle prompt made room for the next call
        assert any(str(c).startswith("pfx:") for c in engine.freed)


async def test_errors_name_the_problem() -> None:
    engine = ScriptedEngine(reply=echo)
    async with Manager({"e0": engine}) as m:
        with pytest.raises(RunNotFound):
            m.run_status("nope")
        rid = await m.create_run(
            spec({"name": "a", "template": "Do {{input:x}} {{output:y}}"}, inputs={"x": "it"})
        )
        with pytest.raises(RunClosedError):
            await m.set_input(rid, "x", "again")
        with pytest.raises(ValueError, match="perf"):
            await m.get(rid, "y", perf="fast")  # type: ignore[arg-type]


async def test_get_times_out_without_stopping_the_run() -> None:
    engine = ScriptedEngine(reply=echo, gate=asyncio.Event())
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec({"name": "a", "template": "Do {{input:x}} {{output:y}}"}, inputs={"x": "it"})
        )
        with pytest.raises(TimeoutError):
            await m.get(rid, "y", timeout=0.01)
        engine.gate.set()
        assert await m.get(rid, "y") == "<it>"


async def test_making_room_never_evicts_the_prefix_the_call_forks_from() -> None:
    engine = ScriptedEngine(reply=echo, capacity_tokens=16 * 40)
    system = "The same system prompt every time. "
    async with Manager({"e0": engine}) as m:
        for q in ("a", "b"):
            rid = await m.create_run(
                spec(
                    {
                        "template": system + "{{input:x}} {{output:y}}",
                        "outputs": {"y": {"max_tokens": 600}},
                    },
                    inputs={"x": q},
                )
            )
            await m.get(rid, "y")
        assert len([f for f in engine.fills if f.text == system]) == 1


async def test_a_call_waiting_on_a_prefix_whose_filler_was_cancelled_fills_it_itself() -> None:
    class SlowPrefixFill(ScriptedEngine):
        async def fill(self, context_id, parent_id, token_ids, **kw):
            if str(context_id).startswith("pfx:"):
                await self.prefix_gate.wait()
            return await super().fill(context_id, parent_id, token_ids, **kw)

    engine = SlowPrefixFill(reply=echo)
    engine.prefix_gate = asyncio.Event()
    system = "A system prompt both runs share. "
    call = {"name": "a", "template": system + "{{input:x}} {{output:y}}"}
    async with Manager({"e0": engine}) as m:
        first = await m.create_run(spec(call, inputs={"x": "one"}))
        second = await m.create_run(spec(call, inputs={"x": "two"}))
        table = m.sharing.table
        while not any(table.get(k).refcount == 2 for k in table.held("e0")):
            await asyncio.sleep(0)  # until both calls use the prefix (one fills, one waits)
        await m.cancel(first)  # the call filling the shared prefix goes away
        assert await m.get(second, "y") == "<two>"
        assert [f.text for f in engine.fills] == [system + "two "]
        assert len(m.sharing.table) == 0  # the unfilled prefix is forgotten


async def test_calls_added_after_an_input_failed_fail_without_running() -> None:
    engine = ScriptedEngine(reply=echo, fail_if=lambda p: "boom" in p)
    async with Manager({"e0": engine}) as m:
        rid = await m.create_run(
            spec(
                {"name": "a", "template": "Do {{input:x}} {{output:y}}"},
                inputs={"x": "boom"},
                open=True,
            )
        )
        with pytest.raises(VariableFailed):
            await m.get(rid, "y")
        [late] = await m.add_calls(rid, [CallSpec(name="b", template="{{input:y}} {{output:z}}")])
        with pytest.raises(VariableFailed, match="call 'b' not run: input 'y' failed"):
            await m.get(rid, "z")
        assert len(engine.generations) == 1 and late == "b"


async def test_make_room_asks_the_engine_only_when_a_prefix_could_be_evicted() -> None:
    from parrot_backend.manager.sharing import SharedPrefixes

    class Counting(ScriptedEngine):
        asked = 0

        async def stats(self):
            self.asked += 1
            return await super().stats()

    engine = Counting(capacity_tokens=16 * 4)
    sharing = SharedPrefixes({"e0": engine}, lambda: 0.0)
    await sharing.make_room("e0", 1000)  # nothing filled: nothing to evict, no question
    attached = await sharing.attach("e0", [Prefix("k", 1, 3)], engine.tokenize("abc"), "t:", 1)
    await sharing.make_room("e0", 1000)  # the only prefix is in use: still nothing
    assert engine.asked == 0
    await sharing.release("e0", attached.keys)
    await sharing.make_room("e0", 1000)  # idle now, and the engine is short: evicted
    assert engine.asked == 1 and len(sharing.table) == 0
