"""compile_chain without a server: template text escaping, the plan, and refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from langchain_core.output_parsers import JsonOutputParser, StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnableLambda

from langchain_parrot import ChatParrot, ParrotLLM, compile_chain
from langchain_parrot._lower import Text, Var, template_of

LLM = ParrotLLM(base_url="http://127.0.0.1:9", temperature=0)
PROMPT = PromptTemplate.from_template("About {x}:")


@given(
    st.lists(
        st.one_of(st.text(alphabet="ab{}\\ :", max_size=6), st.sampled_from(["v1", "v2"]).map(Var)),
        max_size=6,
    )
)
def test_literal_text_survives_the_template_syntax(pieces):
    parse = pytest.importorskip("parrot_backend.program").parse
    from parrot_backend.program import InputRef, OutputRef
    from parrot_backend.program import Text as Literal

    seen: set[str] = set()
    kept = []
    for p in pieces:  # an input once per template (as the lowering never repeats one either)
        if isinstance(p, Var):
            if p.name in seen:
                continue
            seen.add(p.name)
        kept.append(p)
    segments = parse(template_of(Text(tuple(kept)), "out"))
    assert isinstance(segments[-1], OutputRef) and segments[-1].name == "out"
    rendered = []
    for seg in segments[:-1]:
        rendered.append(seg.text if isinstance(seg, Literal) else Var(seg.name))
        assert isinstance(seg, (Literal, InputRef))
    want: list = []
    for p in kept:
        if isinstance(p, str) and want and isinstance(want[-1], str):
            want[-1] += p
        elif p != "":
            want.append(p)
    assert rendered == want


def test_plan_of_a_chain_with_a_lambda_in_the_middle():
    chain = (
        PROMPT | LLM | RunnableLambda(str.upper) | PromptTemplate.from_template("Again {y}") | LLM
    )
    plan = compile_chain(chain).plan()
    assert [s["where"] for s in plan["steps"]] == ["server", "client", "server"]
    assert plan["round_trips"] == 1 and plan["requests"] == 2


def test_plan_of_a_chain_ending_on_the_client_needs_no_request_after_it():
    plan = compile_chain(PROMPT | LLM | JsonOutputParser()).plan()
    assert plan["round_trips"] == 1 and plan["requests"] == 1
    assert compile_chain(PROMPT | LLM | StrOutputParser()).plan() == {
        "steps": [{"step": "ParrotLLM", "where": "server"}],
        "round_trips": 0,
        "requests": 1,
    }


def test_a_lambda_on_the_input_costs_no_round_trip():
    chain = RunnableLambda(lambda d: {"x": d["q"].strip()}) | PROMPT | LLM
    plan = compile_chain(chain).plan()
    assert plan["round_trips"] == 0 and plan["requests"] == 1


def test_chains_it_cannot_compile_are_refused():
    with pytest.raises(ValueError, match="no ChatParrot or ParrotLLM"):
        compile_chain(PROMPT | RunnableLambda(str))
    other = ChatParrot(base_url="http://127.0.0.1:10")
    with pytest.raises(ValueError, match="several servers"):
        compile_chain({"a": PROMPT | LLM, "b": PROMPT | other})
    with pytest.raises(ValueError, match="objective"):
        compile_chain(PROMPT | LLM, objective="fast")


def test_models_under_fallbacks_retries_or_configurable_fields_are_found():
    from langchain_core.runnables import ConfigurableField

    chat = ChatParrot(base_url="http://127.0.0.1:9", temperature=0)
    for step in (LLM.with_fallbacks([LLM]), LLM.with_retry()):  # these run on the client
        plan = compile_chain(PROMPT | step).plan()
        assert [s["where"] for s in plan["steps"]] == ["client"]
        assert plan["round_trips"] == 0 and plan["requests"] == 0
    configurable = chat.configurable_fields(temperature=ConfigurableField(id="t"))
    plan = compile_chain(PROMPT | configurable).plan()  # lowered as configured
    assert plan["steps"] == [{"step": "ChatParrot", "where": "server"}]
    # a fallback's server does not count: only the lowered steps' runs go anywhere
    other = ParrotLLM(base_url="http://127.0.0.1:10")
    assert compile_chain(PROMPT | LLM | PROMPT | LLM.with_fallbacks([other])).plan()


def test_a_model_bound_to_tools_or_a_response_format_plans_as_a_client_step():
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str

    chat = ChatParrot(base_url="http://127.0.0.1:9", temperature=0)
    for chain in (PROMPT | chat.with_structured_output(Person), PROMPT | chat.bind_tools([Person])):
        plan = compile_chain(chain).plan()
        assert {s["where"] for s in plan["steps"]} == {"client"}  # as it runs: request-level
        assert plan["requests"] == 0 and plan["round_trips"] == 0
    plan = compile_chain(PROMPT | chat.bind(stop=["\n"], max_tokens=4)).plan()
    assert plan["steps"] == [{"step": "ChatParrot", "where": "server"}]
