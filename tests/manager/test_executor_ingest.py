"""The manager's cached program building agrees with the program package's own."""

from __future__ import annotations

import re

import pytest

from parrot_backend.manager.ingest import CallBuilder
from parrot_backend.program import CallSpec, GenerationConfig, ProgramError, RunSpec


def test_cached_calls_equal_freshly_parsed_ones() -> None:
    builder = CallBuilder()
    spec = CallSpec(
        template="Sys {{input:a}} \\{{not}} {{output:b}} then {{output:c}}",
        outputs={"c": GenerationConfig(max_tokens=3)},
    )
    first, second = builder.call(spec, 0), builder.call(spec, 1)
    fresh = spec.build(1)
    assert (second.name, second.segments, second.configs) == (
        fresh.name,
        fresh.segments,
        fresh.configs,
    )
    assert (second.inputs, second.outputs) == (fresh.inputs, fresh.outputs)
    assert first.name == "#0" and second.segments is first.segments  # parsed once


def test_cached_template_with_a_bad_config_still_fails() -> None:
    builder = CallBuilder()
    builder.call(CallSpec(template="x {{output:a}}"), 0)
    with pytest.raises(ProgramError, match="'zzz'"):
        builder.call(CallSpec(template="x {{output:a}}", outputs={"zzz": GenerationConfig()}), 1)


def test_program_checks_the_run_like_runspec_build() -> None:
    spec = RunSpec.model_validate(
        {"program": {"calls": [{"template": "{{input:q}} {{output:a}}"}]}, "inputs": {}}
    )
    with pytest.raises(ProgramError, match="'q'"):
        CallBuilder().program(spec)
    with pytest.raises(ProgramError, match="'q'"):
        spec.build()


def test_calls_with_default_configs_are_shared_between_runs() -> None:
    builder = CallBuilder()
    spec = CallSpec(name="w", template="Topic {{input:t}} Draft {{output:d}}")
    first, again = builder.call(spec, 0), builder.call(spec, 5)
    fresh = spec.build(0)
    assert again is first
    assert (again.name, again.segments, again.configs) == (
        fresh.name,
        fresh.segments,
        fresh.configs,
    )
    # another name, or configs of its own, is another call
    other = builder.call(CallSpec(template=spec.template), 2)
    assert other.name == "#2" and other.segments is first.segments
    tuned = builder.call(
        CallSpec(name="w", template=spec.template, outputs={"d": GenerationConfig(max_tokens=2)}),
        0,
    )
    assert tuned is not first and tuned.configs["d"].max_tokens == 2


def _run(inputs: dict[str, str], *, open: bool = False, public: bool = False, **extra) -> RunSpec:
    calls = [
        {"name": "a", "template": "Q {{input:q}} A {{output:x}}", **extra},
        {"name": "b", "template": "Use {{input:x}}: {{output:y}}"},
    ]
    return RunSpec.model_validate(
        {"program": {"calls": calls, "public": public}, "inputs": inputs, "open": open}
    )


def test_closed_runs_of_one_workflow_share_their_program() -> None:
    builder = CallBuilder()
    first = builder.program(_run({"q": "1"}))
    again = builder.program(_run({"q": "2"}))
    assert again is first  # built and checked once
    fresh = _run({"q": "2"}).build()
    assert list(again.calls) == list(fresh.calls) and again.inputs == fresh.inputs
    assert {n: (v.producer, v.consumers) for n, v in again.variables.items()} == {
        n: (v.producer, v.consumers) for n, v in fresh.variables.items()
    }
    # each run is still checked against the shared program
    with pytest.raises(ProgramError, match="'q'"):
        builder.program(_run({}))
    # public programs, open runs and calls with configs of their own get their own
    assert builder.program(_run({"q": "1"}, public=True)) is not first
    assert builder.program(_run({"q": "1"}, public=True)).public
    opened = builder.program(_run({}, open=True))
    assert opened is not first and opened is not builder.program(_run({}, open=True))
    tuned = _run({"q": "1"}, outputs={"x": {"max_tokens": 2}})
    assert builder.program(tuned) is not builder.program(tuned)


def test_a_program_that_failed_its_check_is_not_kept() -> None:
    builder = CallBuilder()
    with pytest.raises(ProgramError):
        builder.program(_run({}))
    assert not builder._programs
    ok = builder.program(_run({"q": "1"}))
    assert builder.program(_run({"q": "3"})) is ok


async def test_open_run_adding_calls_leaves_shared_programs_alone() -> None:
    from parrot_backend.manager.manager import Manager
    from parrot_backend.testing.fake_engine import ScriptedEngine

    async with Manager({"e0": ScriptedEngine(reply=lambda p: "r")}) as m:
        closed = await m.create_run(_run({"q": "1"}))
        opened = await m.create_run(_run({"q": "1"}, open=True))
        await m.add_calls(opened, [CallSpec(name="c", template="More {{input:y}} {{output:z}}")])
        assert "c" not in m.runs[closed].program.calls
        assert m.builder.program(_run({"q": "5"})).calls.keys() == {"a", "b"}
        await m.close_run(opened)
        assert await m.get(opened, "z") == "r" and await m.get(closed, "y") == "r"


def test_program_json_equals_the_specs_dump_and_is_shared_with_the_program() -> None:
    builder = CallBuilder()
    for spec in (
        _run({"q": "1"}),
        _run({"q": "2"}),
        _run({"q": "1"}, public=True),
        _run({}, open=True),
        _run({"q": "1"}, outputs={"x": {"max_tokens": 2, "stop": ["."]}}),
    ):
        program, dumped = builder.build(spec)
        assert dumped == spec.program.model_dump(mode="json")
        assert program is builder.build(spec)[0] or spec.open or spec.program.calls[0].outputs
    first, again = builder.build(_run({"q": "1"})), builder.build(_run({"q": "9"}))
    assert again[1] is first[1]  # one JSON form per workflow, as one program


@pytest.mark.parametrize(
    "inputs, outputs",
    [
        ({}, {}),  # an input missing
        ({"q": "1", "zz": "2"}, {}),  # an unknown input
        ({"q": "1", "x": "2"}, {}),  # a generated variable given as an input
        ({"q": "1"}, {"nope": "latency"}),  # an unknown output
        ({"q": "1"}, {"y": "latency"}),  # fine
    ],
)
def test_a_shared_program_checks_each_run_as_a_fresh_build(
    inputs: dict[str, str], outputs: dict[str, str]
) -> None:
    builder = CallBuilder()
    builder.program(_run({"q": "0"}))  # cached
    spec = _run(inputs).model_copy(update={"outputs": outputs})
    try:
        spec.build()
    except ProgramError as e:
        with pytest.raises(type(e), match=re.escape(str(e))):
            builder.program(spec)
    else:
        assert builder.program(spec) is builder.program(_run({"q": "0"}))
