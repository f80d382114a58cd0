"""Programs and the request-level oracle shared by the upstream end-to-end tests.

The oracle runs each call alone, in dependency order: its template up to its output with
the input values substituted, tokenized as one text (what a request-level client sends),
completed greedily by `complete(token ids, generation config) -> text`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from parrot_backend.manager.manager import Manager
from parrot_backend.program import GenerationConfig, InputRef, OutputRef, RunSpec, Text

SYSTEM = (
    "You are a careful research assistant. You read passages about birds and answer "
    "in one short sentence, with no preamble.\n"
)


def spec(calls: list[tuple[str, str, dict]], inputs: dict[str, str], final: str) -> RunSpec:
    return RunSpec.model_validate(
        {
            "program": {"calls": [{"name": n, "template": t, "outputs": o} for n, t, o in calls]},
            "inputs": inputs,
            "outputs": {final: "latency"},
        }
    )


def map_reduce(n: int, max_tokens: int = 12) -> RunSpec:
    """n maps sharing a system prompt, each summarizing one passage; a reduce of them."""
    gen = {"max_tokens": max_tokens, "stop": ["\n"]}
    passages = {
        f"p{i}": f"Passage {i}: parrot species number {i} eats seeds and fruit "
        f"and lives {i + 2} decades."
        for i in range(n)
    }
    calls = [
        (f"map{i}", SYSTEM + f"{{{{input:p{i}}}}}\nSummary:{{{{output:s{i}}}}}", {f"s{i}": gen})
        for i in range(n)
    ]
    joined = "\n".join(f"- {{{{input:s{i}}}}}" for i in range(n))
    calls.append(
        ("reduce", SYSTEM + f"Summaries:\n{joined}\nOverall:{{{{output:total}}}}", {"total": gen})
    )
    return spec(calls, passages, "total")


def chain(max_tokens: int = 10) -> RunSpec:
    """Three calls, each reading the previous one's output."""
    gen = {"max_tokens": max_tokens}
    return spec(
        [
            ("idea", SYSTEM + "Topic: {{input:topic}}\nOne idea:{{output:idea}}", {"idea": gen}),
            (
                "draft",
                SYSTEM + "Expand this idea: {{input:idea}}\nDraft:{{output:draft}}",
                {"draft": gen},
            ),
            (
                "title",
                SYSTEM + "Give a title to: {{input:draft}}\nTitle:{{output:title}}",
                {"title": gen},
            ),
        ],
        {"topic": "how parrots learn words"},
        "title",
    )


def reference(
    run: RunSpec,
    tokenize: Callable[[str], list[int]],
    complete: Callable[[list[int], GenerationConfig], str],
) -> dict[str, str]:
    """Every value of `run`, each call sent alone (single-output calls only)."""
    program = run.build()
    values = dict(run.inputs)
    for name in program.topological_calls():
        call = program.calls[name]
        out, text = prompt_of(call, values)
        values[out] = complete(tokenize(text), call.configs[out])
    return values


def prompt_of(call, values: dict[str, str]) -> tuple[str, str]:
    """A single-output call's output name and its prompt: the template up to the output,
    with `values` substituted (as a request-level client renders it)."""
    [out] = [s for s in call.segments if isinstance(s, OutputRef)]
    text = "".join(
        s.text if isinstance(s, Text) else values[s.name]
        for s in call.segments[: call.segments.index(out)]
        if isinstance(s, (Text, InputRef))
    )
    return out.name, text


async def managed(
    engines: dict, *runs: RunSpec, on_started=None
) -> tuple[list[dict[str, str]], Manager]:
    """Run every spec through one manager at once; their values once all finished."""
    async with Manager(engines) as manager:
        ids = [await manager.create_run(r) for r in runs]
        if on_started is not None:
            await on_started(manager)
        for rid, r in zip(ids, runs, strict=True):
            for name in r.outputs:
                await asyncio.wait_for(manager.get(rid, name), 240)
            async for _ in manager.subscribe(rid):
                pass
        states = [manager.run_status(rid).state for rid in ids]
        assert states == ["finished"] * len(runs)
        return [manager.run_status(rid).values for rid in ids], manager
