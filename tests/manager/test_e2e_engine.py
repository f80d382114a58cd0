"""Manager end to end on the real engine (greedy): outputs equal running each call alone.

The reference path runs every call by itself, in dependency order, on a fresh engine with
no sharing: fill the rendered prompt (tokenized as one text, as a request-level client
would send it) into a new context, generate, fill what follows (each segment alone),
generate the next output. After an output that stopped on a stop string
with more to generate, it starts a fresh context holding the tokens before the output plus
the value's tokens: the same rule the manager follows (see manager/call_task.py).
"""

from __future__ import annotations

import copy
import itertools

import pytest

from parrot_backend.engine.engine import Engine
from parrot_backend.manager.manager import Manager
from parrot_backend.manager.render import PromptTokenizer
from parrot_backend.program import InputRef, OutputRef, RunSpec, Text

_ref_ids = itertools.count()


def load(model_dir) -> Engine:
    # no token-level prefix cache: every shared token the engine skips is the manager's doing
    return Engine.from_pretrained(model_dir, num_blocks=256, progress=False, prefix_cache=False)


async def run_alone(engine: Engine, spec: RunSpec) -> dict[str, str]:
    """Every call of `spec` run by itself, in dependency order; returns all values."""
    program = spec.build()
    values = dict(spec.inputs)
    for name in program.topological_calls():
        call = program.calls[name]
        ctx = f"ref:{next(_ref_ids)}"
        text = ""
        segments = list(call.segments)
        while segments and not isinstance(segments[0], OutputRef):
            seg = segments.pop(0)
            text += seg.text if isinstance(seg, Text) else values[seg.name]
        await engine.fill(ctx, None, engine.tokenize(text))
        contexts = [ctx]
        while segments:
            out = segments.pop(0)
            config = call.configs[out.name]
            before = engine.context_tokens(ctx)
            deltas = [d async for d in engine.generate(ctx, None, config.to_sampling())]
            values[out.name] = "".join(d.text for d in deltas)
            more = any(isinstance(s, OutputRef) for s in segments)
            if more and config.stop and deltas[-1].finish_reason == "stop":
                ctx = f"ref:{next(_ref_ids)}"
                await engine.fill(ctx, None, before + engine.tokenize(values[out.name], data=True))
                contexts.append(ctx)
            following: list[int] = []
            while segments and not isinstance(segments[0], OutputRef):
                seg = segments.pop(0)
                assert isinstance(seg, (Text, InputRef))
                if isinstance(seg, Text):
                    following += engine.tokenize(seg.text)
                else:
                    following += engine.tokenize(values[seg.name], data=True)
            if following and more:
                await engine.fill(ctx, None, following)
        for c in reversed(contexts):
            await engine.free(c)
    return values


async def reference(model_dir, *specs: RunSpec) -> tuple[list[dict[str, str]], int]:
    """Values of each run alone, and the tokens the engine computed for them."""
    engine = load(model_dir)
    async with engine:
        values = [await run_alone(engine, s) for s in specs]
    return values, engine.stats_now().tokens_computed


async def managed(model_dir, *specs: RunSpec) -> tuple[list[dict[str, str]], Manager, Engine]:
    """Run every spec through one manager at once; the client only waits for final values."""
    engine = load(model_dir)
    async with engine, Manager({"e0": engine}) as manager:
        ids = [await manager.create_run(s) for s in specs]
        for rid, s in zip(ids, specs, strict=True):
            for name in s.outputs:
                await manager.get(rid, name)
            async for _ in manager.subscribe(rid):
                pass  # until the run ends: calls nobody waits for finish too
        values = [manager.run_status(rid).values for rid in ids]
        assert all(manager.run_status(rid).state == "finished" for rid in ids)
        assert engine.stats_now().contexts == len(manager.sharing.table)  # calls freed
        serving = copy.deepcopy(manager.sharing.table)
    assert engine.stats_now().contexts == 0  # a stopped manager leaves no prefix behind
    manager.sharing.table = serving  # tests inspect the prefixes as they were while serving
    return values, manager, engine


def spec(calls: list[tuple[str, str]], inputs: dict[str, str], final: str, **outs) -> RunSpec:
    return RunSpec.model_validate(
        {
            "program": {
                "calls": [{"name": n, "template": t, "outputs": outs.get(n, {})} for n, t in calls]
            },
            "inputs": inputs,
            "outputs": {final: "latency"},
        }
    )


GEN = {"max_tokens": 5}


def started_after_ready(manager: Manager, var: str, call: str) -> bool:
    """Whether `call` started only after `var` became ready, in every run that has both."""
    for run in manager.runs.values():
        kinds = [(e.type, e.payload.get("name", e.payload.get("call"))) for e in run.log.events]
        if ("call_started", call) in kinds:
            if kinds.index(("variable_ready", var)) > kinds.index(("call_started", call)):
                return False
    return True


async def test_chain_equals_calls_run_alone(tiny_model_dir) -> None:
    chain = spec(
        [
            ("a", "Topic: {{input:topic}}. Idea: {{output:idea}}"),
            ("b", "Expand the idea {{input:idea}} into: {{output:draft}}"),
            ("c", "Polish {{input:draft}} now: {{output:final}}"),
        ],
        {"topic": "parrots"},
        "final",
        a={"idea": GEN},
        b={"draft": GEN},
        c={"final": GEN},
    )
    want, _ = await reference(tiny_model_dir, chain)
    got, manager, _ = await managed(tiny_model_dir, chain)
    assert got == want
    assert started_after_ready(manager, "idea", "b") and started_after_ready(manager, "draft", "c")


async def test_map_reduce_equals_calls_run_alone(tiny_model_dir) -> None:
    chunks = {f"chunk{i}": f"text of part {i} about birds" for i in range(3)}
    calls = [
        (f"map{i}", f"Summarize: {{{{input:chunk{i}}}}} Summary: {{{{output:s{i}}}}}")
        for i in range(3)
    ]
    calls.append(
        ("reduce", "Summaries: {{input:s0}} | {{input:s1}} | {{input:s2}} All: {{output:total}}")
    )
    outs = {f"map{i}": {f"s{i}": GEN} for i in range(3)} | {"reduce": {"total": GEN}}
    job = spec(calls, chunks, "total", **outs)
    want, _ = await reference(tiny_model_dir, job)
    got, manager, _ = await managed(tiny_model_dir, job)
    assert got == want
    assert all(started_after_ready(manager, f"s{i}", "reduce") for i in range(3))
    # one prefix context per static text: "Summarize: " (filled once for the three maps)
    # and "Summaries: " (the reduce's, kept for later runs); every call forked from one
    assert manager.sharing.fills["e0"] == 2 and manager.sharing.forks["e0"] == 4


async def test_multi_agent_dynamic_prefix_filled_once(tiny_model_dir) -> None:
    agents = 3
    calls = [("plan", "You are the planner. Task: {{input:task}} Plan: {{output:plan}}")]
    calls += [
        (
            f"agent{i}",
            f"Team plan: {{{{input:plan}}}} You are agent {i}. Do: {{{{output:part{i}}}}}",
        )
        for i in range(agents)
    ]
    parts = " ".join(f"{{{{input:part{i}}}}}" for i in range(agents))
    calls.append(("merge", f"Parts: {parts} Final: {{{{output:final}}}}"))
    outs = {"plan": {"plan": {"max_tokens": 8}}, "merge": {"final": GEN}}
    outs |= {f"agent{i}": {f"part{i}": GEN} for i in range(agents)}
    program = spec(calls, {"task": "build a nest"}, "final", **outs)
    want, ref_computed = await reference(tiny_model_dir, program)
    got, manager, engine = await managed(tiny_model_dir, program)
    assert got == want
    # "Team plan: <plan>" is one prefix context (forked from the static "Team plan:"), each
    # up to the start of its last pre-token (render.py)
    tokens = PromptTokenizer.for_engine(engine)

    def shared(text: str) -> int:
        return len(tokens.text(text[: tokens.stable_cut(text)]))

    plan_tokens = shared("Team plan: " + got[0]["plan"])
    table = manager.sharing.table
    [dynamic] = [table.get(k) for k in table.held("e0") if table.get(k).n_tokens == plan_tokens]
    assert table.get(dynamic.parent).n_tokens == shared("Team plan: ")
    saved = ref_computed - engine.stats_now().tokens_computed
    # the agent that fills it forks in the fill's step (engine `scheduler.py`, forks join
    # their parent), computing no token of the prefix again
    assert engine.scheduler.joins >= 1
    assert saved >= (agents - 1) * plan_tokens
    assert started_after_ready(manager, "plan", "agent0")


async def test_generated_prefix_shared_by_readers_ready_one_after_another(tiny_model_dir) -> None:
    # reviewers each read the generated design, but each also reads the previous one's
    # note: they become ready one at a time, never two in one dispatcher round
    readers = 4
    calls = [("arch", "You design. Task: {{input:task}} Design: {{output:design}}")]
    calls += [
        (
            f"rev{i}",
            "Review against the design: {{input:design}} Earlier note: "
            + ("{{input:task}}" if i == 0 else f"{{{{input:note{i - 1}}}}}")
            + f" Note: {{{{output:note{i}}}}}",
        )
        for i in range(readers)
    ]
    outs = {"arch": {"design": {"max_tokens": 24}}}
    outs |= {f"rev{i}": {f"note{i}": {"max_tokens": 3}} for i in range(readers)}
    program = spec(calls, {"task": "a nest"}, f"note{readers - 1}", **outs)
    want, ref_computed = await reference(tiny_model_dir, program)
    got, manager, engine = await managed(tiny_model_dir, program)
    assert got == want
    tokens = PromptTokenizer.for_engine(engine)
    text = "Review against the design: " + got[0]["design"]
    design_prefix = len(tokens.text(text[: tokens.stable_cut(text)]))
    table = manager.sharing.table
    assert design_prefix in [table.get(k).n_tokens for k in table.held("e0")]
    # the design prefix is computed once, not once per reader: P + N x suffix
    saved = ref_computed - engine.stats_now().tokens_computed
    assert saved >= (readers - 1) * design_prefix
    assert all(started_after_ready(manager, f"note{i - 1}", f"rev{i}") for i in range(1, readers))


@pytest.mark.parametrize(
    "model", ["tiny_model_dir", pytest.param("smollm2_dir", marks=pytest.mark.slow)]
)
async def test_two_runs_share_a_system_prompt_filled_once(model, request) -> None:
    model_dir = request.getfixturevalue(model)
    system = "You are a concise assistant. Answer every question in one short line. "
    runs = [
        spec(
            [("ask", system + "Question: {{input:q}} Answer: {{output:a}}")],
            {"q": q},
            "a",
            ask={"a": GEN},
        )
        for q in ("Why do parrots talk?", "What do parrots eat?")
    ]
    want, ref_computed = await reference(model_dir, *runs)
    got, manager, engine = await managed(model_dir, *runs)
    assert got == want
    assert manager.sharing.fills["e0"] == 1 and manager.sharing.forks["e0"] == 2
    saved = ref_computed - engine.stats_now().tokens_computed
    assert saved >= len(engine.tokenize(system))  # the second run never computed it


@pytest.mark.slow
async def test_smollm2_chain_with_multi_output_and_stop(smollm2_dir) -> None:
    program = spec(
        [
            ("facts", "List two facts about parrots.\n1. {{output:f1}}\n2. {{output:f2}}"),
            ("short", "Fact: {{input:f1}}\nShorter: {{output:s}}"),
        ],
        {},
        "s",
        facts={"f1": {"max_tokens": 12, "stop": ["\n"]}, "f2": {"max_tokens": 6}},
        short={"s": {"max_tokens": 6}},
    )
    want, _ = await reference(smollm2_dir, program)
    got, manager, _ = await managed(smollm2_dir, program)
    assert got == want
    assert started_after_ready(manager, "f1", "short")


async def test_forks_of_a_shared_prompt_fill_in_one_step(tiny_model_dir, monkeypatch) -> None:
    """Users sharing a system prompt: the call that fills the prefix and the calls waiting
    for that fill all fork in the fill's own step (the filler does not wait for its fill,
    the waiters are told when it is sent, and the engine's forks join their parent's
    step), and the values equal each call run alone. (Through the server:
    tests/server/test_fork_alignment.py.)"""
    users = 4
    system = "You are a helpful assistant for a bird shop. " * 6
    job = spec(
        [
            (f"u{i}", system + f"User {i}: {{{{input:q{i}}}}} Answer: {{{{output:a{i}}}}}")
            for i in range(users)
        ],
        {f"q{i}": f"what do parrots eat, part {i}?" for i in range(users)},
        "a0",
        **{f"u{i}": {f"a{i}": GEN} for i in range(users)},
    )
    job.outputs = {f"a{i}": "latency" for i in range(users)}
    want, _ = await reference(tiny_model_dir, job)

    async def fork_steps() -> tuple[list[dict[str, str]], list[tuple[int, bool]]]:
        """Values, and for each step with fork fills in it, how many, and whether the
        prefix's own fill is in that step too."""
        steps: list[tuple[int, bool]] = []
        real = Engine.from_pretrained

        def spying(*a, **kw):
            engine = real(*a, **kw)
            schedule = engine.scheduler.schedule

            def spy():
                out = schedule()
                forks = [w for w in out[0] if w.req.kind == "fill" and w.req.ctx.parent]
                if forks:
                    root = any(w.req.kind == "fill" and not w.req.ctx.parent for w in out[0])
                    steps.append((len(forks), root))
                return out

            engine.scheduler.schedule = spy
            return engine

        with monkeypatch.context() as m:
            m.setattr(Engine, "from_pretrained", spying)
            got, _, _ = await managed(tiny_model_dir, job)
        return got, steps

    got, steps = await fork_steps()
    assert got == want
    # all of them in the step that fills the prefix: they join it (engine `scheduler.py`)
    assert steps == [(users, True)], steps


async def test_a_lone_system_prompt_is_not_filled_on_its_own_when_the_engine_caches(
    tiny_model_dir,
) -> None:
    """One call with a system prompt, on an engine with its token-level prefix cache on:
    the manager sends the whole prompt (no prefix context first, which would cost the call
    an engine step before its own tokens), the values equal the call run alone, and the
    next run with that prompt reuses its blocks from the engine's cache. With the cache
    off the prompt is filled on its own (the next run forks from it), and the call's fork
    joins the fill's step: no step more (there was one before forks joined)."""
    system = "You are a helpful assistant for a bird shop. Answer in one line. " * 3
    runs = [
        spec(
            [("ask", system + "Question: {{input:q}} Answer: {{output:a}}")],
            {"q": q},
            "a",
            ask={"a": GEN},
        )
        for q in ("Why do parrots talk?", "What do parrots eat?")
    ]
    want, _ = await reference(tiny_model_dir, *runs)

    async def one_by_one(prefix_cache: bool):
        engine = Engine.from_pretrained(
            tiny_model_dir, num_blocks=256, progress=False, prefix_cache=prefix_cache
        )
        values, steps, hits = [], [], []
        async with engine, Manager({"e0": engine}) as manager:
            for s in runs:
                before, hits0 = engine.stats_now().steps, engine.stats_now().prefix_cache_hits
                rid = await manager.create_run(s)
                async for _ in manager.subscribe(rid):
                    pass
                values.append(manager.run_status(rid).values)
                steps.append(engine.stats_now().steps - before)
                hits.append(engine.stats_now().prefix_cache_hits - hits0)
            fills = manager.sharing.fills["e0"]
        return values, steps, hits, fills, len(engine.tokenize(system))

    got, steps_on, hits, fills, n_system = await one_by_one(prefix_cache=True)
    assert got == want
    assert fills == 0
    assert hits[0] == 0 and hits[1] >= n_system // 16 * 16 > 0
    got_off, steps_off, _, fills_off, _ = await one_by_one(prefix_cache=False)
    assert got_off == want
    assert fills_off == 1
    assert steps_on[0] == steps_off[0], (steps_on, steps_off)
