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
