"""The JSON form shared by the HTTP API and the store."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from parrot_backend.program import (
    CycleError,
    GenerationConfig,
    MissingInputError,
    ProgramError,
    ProgramSpec,
    RunSpec,
    TemplateError,
    UnknownVariableError,
)

MAP_REDUCE = {
    "calls": [
        {"name": "map0", "template": "Summarize {{input:chunk0}}: {{output:s0}}"},
        {"name": "map1", "template": "Summarize {{input:chunk1}}: {{output:s1}}"},
        {
            "template": "Merge {{input:s0}} {{input:s1}}: {{output:summary}}",
            "outputs": {"summary": {"max_tokens": 64, "stop": ["\n"]}},
        },
    ],
}


def test_build_names_unnamed_calls_by_index() -> None:
    program = ProgramSpec.model_validate(MAP_REDUCE).build()
    assert list(program.calls) == ["map0", "map1", "#2"]
    assert program.calls["#2"].configs["summary"].max_tokens == 64
    assert program.producers("#2") == ["map0", "map1"]


def test_spec_round_trips_through_json() -> None:
    spec = RunSpec.model_validate(
        {
            "program": MAP_REDUCE,
            "inputs": {"chunk0": "a", "chunk1": "b"},
            "outputs": {"summary": "latency"},
        }
    )
    again = RunSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert again.build().inputs == ["chunk0", "chunk1"]


def test_json_schema_is_exported() -> None:
    schema = ProgramSpec.model_json_schema()
    json.dumps(schema)
    assert "GenerationConfig" in schema["$defs"]
    assert schema["properties"]["calls"]["minItems"] == 1


def test_program_needs_a_call() -> None:
    with pytest.raises(ValidationError):
        ProgramSpec.model_validate({"calls": []})


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"max_tokens": "5"},
        {"max_tokens": True},
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"seed": -1},
        {"stop": [""]},
        {"stop_token_ids": [-3]},
        {"max_token": 5},
    ],
)
def test_generation_config_rejects(bad: dict) -> None:
    with pytest.raises(ValidationError):
        GenerationConfig.model_validate(bad)


def test_generation_config_rejects_nan_in_json() -> None:
    with pytest.raises(ValidationError):
        GenerationConfig.model_validate_json('{"temperature": NaN}')


def test_to_sampling_carries_every_field() -> None:
    config = GenerationConfig(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=11,
        stop=["x"],
        stop_token_ids=[2],
    )
    params = config.to_sampling()
    params.validate()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5, 0.9, 3)
    assert (params.seed, params.stop, params.stop_token_ids) == (11, ["x"], [2])


def test_call_name_must_be_identifier_like() -> None:
    with pytest.raises(ValidationError):
        ProgramSpec.model_validate({"calls": [{"name": "#0", "template": "{{output:x}}"}]})


def test_config_for_output_missing_from_template_is_a_program_error() -> None:
    spec = ProgramSpec.model_validate(
        {"calls": [{"name": "c", "template": "{{output:a}}", "outputs": {"b": {}}}]}
    )
    with pytest.raises(ProgramError, match="call 'c'.*'b'"):
        spec.build()


def test_template_error_surfaces_from_build() -> None:
    spec = ProgramSpec.model_validate({"calls": [{"template": "{{input:a}}{{oops:b}}"}]})
    with pytest.raises(TemplateError, match="call '#0'") as info:
        spec.build()
    assert info.value.position == 13


def test_cycle_surfaces_from_build() -> None:
    spec = ProgramSpec.model_validate(
        {
            "calls": [
                {"template": "{{input:a}}{{output:b}}"},
                {"template": "{{input:b}}{{output:a}}"},
            ]
        }
    )
    with pytest.raises(CycleError):
        spec.build()


def test_closed_run_without_inputs_fails_open_run_passes() -> None:
    closed = RunSpec.model_validate({"program": MAP_REDUCE, "inputs": {"chunk0": "a"}})
    with pytest.raises(MissingInputError, match="'chunk1'"):
        closed.build()
    opened = closed.model_copy(update={"open": True})
    assert opened.build().inputs == ["chunk0", "chunk1"]


def test_awaited_output_must_exist_in_a_closed_run() -> None:
    run = RunSpec.model_validate(
        {
            "program": MAP_REDUCE,
            "inputs": {"chunk0": "a", "chunk1": "b"},
            "outputs": {"sumary": "latency"},
        }
    )
    with pytest.raises(UnknownVariableError, match="'sumary'"):
        run.build()


def test_unknown_criterion_is_rejected() -> None:
    with pytest.raises(ValidationError):
        RunSpec.model_validate({"program": MAP_REDUCE, "outputs": {"summary": "fast"}})


def test_program_package_imports_without_torch() -> None:
    code = "import sys, parrot_backend.program; assert 'torch' not in sys.modules, 'torch loaded'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
