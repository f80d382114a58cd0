"""Program structure: calls, variables, the DAG, and the checks that name offenders."""

from __future__ import annotations

import pytest

from parrot_backend.program import (
    Call,
    CycleError,
    DuplicateCallError,
    DuplicateProducerError,
    GenerationConfig,
    MissingInputError,
    Program,
    ProgramError,
    TemplateError,
    UnknownVariableError,
    call_node,
    var_node,
)


def call(name: str, template: str) -> Call:
    return Call.from_template(name, template)


def chain() -> Program:
    return Program(
        [
            call("write", "Topic: {{input:topic}} Draft: {{output:draft}}"),
            call("review", "Draft: {{input:draft}} Review: {{output:review}}"),
        ]
    )


def test_variables_know_their_producer_and_consumers() -> None:
    p = chain()
    assert p.variables["topic"].is_input
    assert p.variables["draft"].producer == "write"
    assert p.variables["draft"].consumers == ["review"]
    assert p.inputs == ["topic"]


def test_graph_is_bipartite_between_calls_and_variables() -> None:
    g = chain().graph
    assert g.has_edge(var_node("topic"), call_node("write"))
    assert g.has_edge(call_node("write"), var_node("draft"))
    assert g.has_edge(var_node("draft"), call_node("review"))


def test_call_graph_and_topological_order() -> None:
    p = chain()
    assert list(p.call_graph().edges) == [("write", "review")]
    assert p.topological_calls() == ["write", "review"]
    assert p.producers("review") == ["write"]
    assert p.consumers("write") == ["review"]


def test_call_outputs_get_default_configs() -> None:
    c = Call.from_template("c", "{{output:a}} {{output:b}}", {"b": GenerationConfig(max_tokens=5)})
    assert c.outputs == ("a", "b")
    assert c.configs["a"] == GenerationConfig()
    assert c.configs["b"].max_tokens == 5


def test_config_for_output_not_in_template_is_rejected() -> None:
    with pytest.raises(ProgramError, match="'nope'"):
        Call.from_template("c", "{{output:a}}", {"nope": GenerationConfig()})


def test_template_error_names_the_call() -> None:
    with pytest.raises(TemplateError, match="call 'bad'") as info:
        Call.from_template("bad", "x {{input:}}")
    assert info.value.call == "bad"
    assert info.value.position == 10


def test_variable_produced_by_two_calls_names_both() -> None:
    with pytest.raises(DuplicateProducerError, match="'v' is produced by calls 'a', 'b'"):
        Program([call("a", "{{output:v}}"), call("b", "{{output:v}}")])


def test_duplicate_call_name_is_rejected() -> None:
    with pytest.raises(DuplicateCallError, match="'a'"):
        Program([call("a", "{{output:v}}"), call("a", "{{output:w}}")])


def test_cycle_is_named_with_its_variables() -> None:
    with pytest.raises(CycleError) as info:
        Program(
            [
                call("a", "{{input:z}} {{output:x}}"),
                call("b", "{{input:x}} {{output:y}}"),
                call("c", "{{input:y}} {{output:z}}"),
                call("d", "{{input:x}} {{output:w}}"),
            ]
        )
    err = info.value
    # the loop may start anywhere; rotate it to start at 'a'
    start = err.cycle.index("a")
    assert err.cycle[start:] + err.cycle[:start] == ["a", "b", "c"]
    assert err.via[start:] + err.via[:start] == ["x", "y", "z"]
    assert "'a' -(x)-> 'b'" in str(err) or "'b' -(y)-> 'c'" in str(err)


def test_failed_add_leaves_program_unchanged() -> None:
    p = chain()
    before = (dict(p.calls), set(p.variables), set(p.graph.edges))
    with pytest.raises(CycleError):
        p.add_call(call("loop", "{{input:review}} {{output:topic}}"))
    with pytest.raises(DuplicateProducerError):
        p.add_call(call("again", "{{output:draft}}"))
    assert (dict(p.calls), set(p.variables), set(p.graph.edges)) == before
    assert p.variables["topic"].producer is None
    assert p.variables["review"].consumers == []


def test_incremental_add_connects_to_existing_variables() -> None:
    p = chain()
    p.add_call(call("final", "{{input:review}} {{input:draft}} {{output:final}}"))
    assert p.producers("final") == ["review", "write"]
    assert p.topological_calls()[-1] == "final"


def test_closed_run_must_provide_every_input() -> None:
    p = Program([call("a", "{{input:x}} {{input:y}} {{output:o}}")])
    with pytest.raises(MissingInputError, match="'x', 'y'"):
        p.check_run(inputs=[])
    p.check_run(inputs=[], closed=False)
    p.check_run(inputs=["x", "y"], outputs=["o"])


def test_unknown_variables_are_named() -> None:
    p = chain()
    with pytest.raises(UnknownVariableError, match="'nope', 'gone'"):
        p.check_run(inputs=["topic", "nope"], outputs=["gone"])


def test_open_run_may_name_variables_of_later_calls() -> None:
    chain().check_run(inputs=["later_input"], outputs=["later_output"], closed=False)


def test_input_value_for_a_generated_variable_is_rejected() -> None:
    with pytest.raises(ProgramError, match="'draft' is produced by call 'write'"):
        chain().check_run(inputs=["topic", "draft"])
