"""The manager's cached program building agrees with the program package's own."""

from __future__ import annotations

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
