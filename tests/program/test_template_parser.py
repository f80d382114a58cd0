"""Template parser: grammar, escapes, positioned errors, rendering values as data."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parrot_backend.program.errors import MissingInputError, TemplateError
from parrot_backend.program.template import (
    NAME_PATTERN,
    InputRef,
    OutputRef,
    Segment,
    Text,
    input_names,
    output_names,
    parse,
    render,
    unparse,
)

_FIRST = "abcxyzAZ_"
names = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from(_FIRST),
    st.text(alphabet=_FIRST + "09.-", max_size=6),
)
# text rich in the characters the grammar cares about
texts = st.text(alphabet=st.sampled_from("{}\\:ab _\n"), min_size=1, max_size=12)
# values that look like placeholders: they must come out verbatim
values = st.one_of(
    st.text(max_size=20),
    names.map(lambda n: f"{{{{input:{n}}}}}"),
    names.map(lambda n: f"{{{{output:{n}}}}}"),
    st.just("{{"),
    st.just("\\{{input:x}}"),
)


@st.composite
def segment_lists(draw: st.DrawFn) -> list[Segment]:
    """Normalized segment lists: merged text, each output once, no input/output clash."""
    out: list[Segment] = []
    kinds: dict[str, str] = {}
    for kind in draw(st.lists(st.sampled_from(["text", "input", "output"]), max_size=8)):
        if kind == "text":
            t = draw(texts)
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + t)
            else:
                out.append(Text(t))
            continue
        name = draw(names)
        if kinds.get(name, kind) != kind or (kind == "output" and name in kinds):
            continue
        kinds[name] = kind
        out.append(InputRef(name) if kind == "input" else OutputRef(name))
    return out


def expected_render(segments: list[Segment], vals: dict[str, str]) -> str:
    return "".join(s.text if isinstance(s, Text) else vals[s.name] for s in segments)


def safe_prefix(segments: list[Segment]) -> str:
    """Template source for `segments` that ends outside any escape."""
    return unparse([*segments, Text(" ")])


def test_parse_splits_text_inputs_and_outputs() -> None:
    segs = parse("Q: {{input:question}}\nA: {{output:answer}}")
    assert segs == [Text("Q: "), InputRef("question"), Text("\nA: "), OutputRef("answer")]
    assert input_names(segs) == ["question"]
    assert output_names(segs) == ["answer"]


def test_names_may_contain_dots_and_dashes() -> None:
    assert parse("{{input:agent.1-reply}}") == [InputRef("agent.1-reply")]


def test_input_used_twice_is_allowed_and_listed_once() -> None:
    segs = parse("{{input:a}} and {{input:a}}")
    assert segs == [InputRef("a"), Text(" and "), InputRef("a")]
    assert input_names(segs) == ["a"]


def test_escaped_braces_render_literally() -> None:
    assert parse(r"\{{input:x}}") == [Text("{{input:x}}")]


def test_double_backslash_before_placeholder_is_one_backslash() -> None:
    assert parse(r"\\{{input:x}}") == [Text("\\"), InputRef("x")]


def test_backslashes_and_braces_elsewhere_are_plain_text() -> None:
    source = r"C:\dir \frac{1}{2} {x} }} {"
    assert parse(source) == [Text(source)]


def test_brace_right_before_placeholder_needs_escape() -> None:
    assert parse(r"\{{{input:x}}") == [Text("{"), InputRef("x")]


@pytest.mark.parametrize(
    ("source", "position", "fragment"),
    [
        ("ab {{input:x", 3, "unclosed"),
        ("ab {{inputx}}", 3, "malformed"),
        ("ab {{inpt:x}}", 5, "unknown placeholder kind 'inpt'"),
        ("ab {{input:}}", 11, "empty variable name"),
        ("ab {{input:9x}}", 11, "invalid variable name"),
        ("ab {{output:x y}}", 13, "invalid variable name"),
        ("{{output:o}} {{output:o}}", 13, "appears twice"),
        ("{{input:v}} {{output:v}}", 12, "both an input and an output"),
        ("{{output:v}} {{input:v}}", 13, "both an input and an output"),
        ("{{ input:x}}", 2, "no spaces"),
        ("{{input:x }}", 9, "invalid variable name"),
    ],
)
def test_errors_point_at_the_fault(source: str, position: int, fragment: str) -> None:
    with pytest.raises(TemplateError, match=fragment) as info:
        parse(source)
    assert info.value.position == position
    assert f"position {position}" in str(info.value)


def test_template_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse("{{bad}}")


def test_render_reports_every_missing_variable() -> None:
    with pytest.raises(MissingInputError, match="'a', 'b'"):
        render(parse("{{input:a}}{{input:b}}{{input:a}}"), {})


@given(segment_lists())
def test_unparse_then_parse_round_trips(segments: list[Segment]) -> None:
    assert parse(unparse(segments)) == segments


@given(segment_lists(), st.data())
def test_substituted_values_are_never_parsed(segments: list[Segment], data: st.DataObject) -> None:
    refs = {s.name for s in segments if not isinstance(s, Text)}
    vals = {name: data.draw(values) for name in sorted(refs)}
    rendered = render(segments, vals)
    assert rendered == expected_render(segments, vals)


@given(values)
def test_value_with_placeholder_syntax_stays_literal(value: str) -> None:
    segments = parse("<{{input:v}}>")
    assert render(segments, {"v": value}) == f"<{value}>"


@given(segment_lists(), names.filter(lambda n: n not in ("input", "output")))
def test_unknown_kind_position_is_after_the_braces(segments: list[Segment], kind: str) -> None:
    prefix = safe_prefix(segments)
    with pytest.raises(TemplateError) as info:
        parse(prefix + f"{{{{{kind}:x}}}}")
    assert info.value.position == len(prefix) + 2


@given(segment_lists(), names, st.sampled_from(" !{$/"), st.sampled_from(["input", "output"]))
def test_invalid_name_position_is_the_bad_character(
    segments: list[Segment], name: str, bad: str, kind: str
) -> None:
    prefix = safe_prefix(segments)
    with pytest.raises(TemplateError, match="invalid variable name") as info:
        parse(prefix + f"{{{{{kind}:{name}{bad}z}}}}")
    assert info.value.position == len(prefix) + len(kind) + 3 + len(name)


@given(segment_lists(), names)
def test_unclosed_placeholder_position_is_its_opening(segments: list[Segment], name: str) -> None:
    prefix = safe_prefix(segments)
    with pytest.raises(TemplateError, match="unclosed") as info:
        parse(prefix + "{{input:" + name)
    assert info.value.position == len(prefix)


@given(segment_lists())
def test_repeated_output_position_is_the_second_use(segments: list[Segment]) -> None:
    fresh = "output_used_twice"  # longer than any generated name: never clashes
    prefix = safe_prefix([*segments, OutputRef(fresh)])
    with pytest.raises(TemplateError, match="appears twice") as info:
        parse(prefix + f"{{{{output:{fresh}}}}}")
    assert info.value.position == len(prefix)


def test_name_pattern_is_documented_in_errors() -> None:
    with pytest.raises(TemplateError, match=re.escape(NAME_PATTERN)):
        parse("{{input:-x}}")
