"""ChatParrot's tool calling and structured output against a scripted server: what is sent
(tools, tool_choice, response_format, tool messages back) and what comes back (tool calls,
streamed tool-call chunks merged by index, parsed structured output, include_raw)."""

from __future__ import annotations

import json
from typing import TypedDict

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from langchain_parrot import ChatParrot

from .fakes import MODEL, USAGE, FakeServer, chat_body, ok, sse, stream


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


class Person(BaseModel):
    """A person."""

    name: str = Field(description="their name")
    age: int


class PersonDict(TypedDict):
    """A person."""

    name: str
    age: int


PERSON_JSON = {
    "title": "Person",
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def chat(server: FakeServer, **kwargs) -> ChatParrot:
    return ChatParrot(base_url="http://parrot.test", **server.clients(), **kwargs)


def calls_body(
    *calls: tuple[str, str], content: str | None = None, finish: str = "tool_calls"
) -> dict:
    body = chat_body(content or "", finish)
    message = body["choices"][0]["message"]
    message["content"] = content
    message["tool_calls"] = [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)
    ]
    return body


def calls_stream(*pieces: dict) -> bytes:
    def chunk(delta: dict, finish=None) -> dict:
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    payloads = [chunk({"role": "assistant", "content": ""})]
    payloads += [chunk({"tool_calls": [p]}) for p in pieces]
    payloads += [
        chunk({}, "tool_calls"),
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [],
            "usage": USAGE,
        },
    ]
    return sse(*payloads)


@pytest.mark.parametrize(
    ("choice", "sent"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ("any", "required"),
        ("get_weather", {"type": "function", "function": {"name": "get_weather"}}),
        (True, {"type": "function", "function": {"name": "get_weather"}}),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
)
def test_bind_tools_sends_openai_tools_and_tool_choice(choice, sent) -> None:
    server = FakeServer(ok(calls_body(("get_weather", '{"city": "Paris"}'))))
    chat(server).bind_tools([get_weather], tool_choice=choice).invoke("Weather?")
    body = server.bodies[0]
    assert body["tool_choice"] == sent
    (function,) = [t["function"] for t in body["tools"]]
    assert function["name"] == "get_weather" and function["description"]
    assert function["parameters"]["properties"] == {"city": {"type": "string"}}


def test_tool_calls_come_back_as_langchain_tool_calls() -> None:
    server = FakeServer(
        ok(calls_body(("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Ro')))
    )
    result = chat(server).bind_tools([get_weather]).invoke("Weather?")
    assert result.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_0", "type": "tool_call"}
    ]
    (bad,) = result.invalid_tool_calls  # cut by max_tokens: kept, not raised
    assert bad["args"] == '{"city": "Ro' and bad["name"] == "get_weather"
    assert result.response_metadata["finish_reason"] == "tool_calls"


def test_streamed_tool_calls_merge_by_index() -> None:
    server = FakeServer(
        stream(
            calls_stream(
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                },
                {"index": 0, "function": {"arguments": '{"city": '}},
                {"index": 0, "function": {"arguments": '"Paris"}'}},
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            )
        )
    )
    chunks = list(chat(server).bind_tools([get_weather]).stream("Weather?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert isinstance(merged, AIMessageChunk)
    assert [(c["id"], c["args"]) for c in merged.tool_calls] == [
        ("call_a", {"city": "Paris"}),
        ("call_b", {"city": "Rome"}),
    ]
    assert merged.response_metadata["finish_reason"] == "tool_calls"


def test_tool_results_go_back_with_the_calls_they_answer() -> None:
    server = FakeServer(ok(chat_body("It is sunny.")))
    history = [
        HumanMessage("Weather?"),
        AIMessage(
            "", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_0"}]
        ),
        ToolMessage("sunny in Paris", tool_call_id="call_0"),
    ]
    chat(server).bind_tools([get_weather]).invoke(history)
    messages = server.bodies[0]["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "content": "sunny in Paris", "tool_call_id": "call_0"}


@pytest.mark.parametrize(
    "schema", [Person, PersonDict, PERSON_JSON], ids=["pydantic", "typeddict", "json-schema"]
)
def test_json_schema_method_sends_the_schema_and_parses_the_reply(schema) -> None:
    server = FakeServer(ok(chat_body('{"name": "Ada", "age": 36}')))
    result = chat(server).with_structured_output(schema, strict=True).invoke("Who?")
    fmt = server.bodies[0]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["properties"]["age"] == {"type": "integer"}
    assert fmt["json_schema"]["name"] in ("Person", "PersonDict")
    expected = {"name": "Ada", "age": 36}
    assert (result == Person(**expected)) if schema is Person else result == expected


@pytest.mark.parametrize(
    "schema", [Person, PersonDict, PERSON_JSON], ids=["pydantic", "typeddict", "json-schema"]
)
def test_function_calling_method_forces_one_call_and_parses_its_arguments(schema) -> None:
    name = "Person" if schema is not PersonDict else "PersonDict"
    server = FakeServer(ok(calls_body((name, '{"name": "Ada", "age": 36}'))))
    result = chat(server).with_structured_output(schema, method="function_calling").invoke("x")
    body = server.bodies[0]
    assert body["tool_choice"] == {"type": "function", "function": {"name": name}}
    assert body["parallel_tool_calls"] is False and "response_format" not in body
    expected = {"name": "Ada", "age": 36}
    assert (result == Person(**expected)) if schema is Person else result == expected


def test_json_mode_asks_for_any_object() -> None:
    server = FakeServer(ok(chat_body('{"name": "Ada", "age": 36}')))
    result = chat(server).with_structured_output(Person, method="json_mode").invoke("x")
    assert server.bodies[0]["response_format"] == {"type": "json_object"}
    assert result == Person(name="Ada", age=36)
    server = FakeServer(ok(chat_body('{"anything": [1]}')))
    assert chat(server).with_structured_output(method="json_mode").invoke("x") == {"anything": [1]}


def test_include_raw_returns_the_message_and_the_parsing_error() -> None:
    server = FakeServer(
        ok(chat_body('{"name": "Ada", "age": 36}')), ok(chat_body('{"name": "Ada", "age": "old"}'))
    )
    model = chat(server).with_structured_output(Person, include_raw=True)
    good = model.invoke("x")
    assert good["parsed"] == Person(name="Ada", age=36) and good["parsing_error"] is None
    assert isinstance(good["raw"], AIMessage)
    bad = model.invoke("x")
    assert bad["parsed"] is None and bad["parsing_error"] is not None
    assert bad["raw"].content == '{"name": "Ada", "age": "old"}'


def test_structured_output_is_traced_with_its_schema() -> None:
    from langchain_core.callbacks import BaseCallbackHandler

    seen = []

    class Options(BaseCallbackHandler):
        def on_chat_model_start(self, *args, **kwargs):
            seen.append(kwargs["invocation_params"])

    server = FakeServer(ok(chat_body('{"name": "Ada", "age": 36}')))
    chat(server).with_structured_output(Person).invoke("x", config={"callbacks": [Options()]})
    assert "ls_structured_output_format" not in server.bodies[0]
    assert json.loads(json.dumps(seen[0]["response_format"]))["type"] == "json_schema"


def test_bad_structured_output_arguments_are_value_errors() -> None:
    model = ChatParrot(base_url="http://parrot.test")
    with pytest.raises(ValueError, match="needs a schema"):
        model.with_structured_output(None)
    with pytest.raises(ValueError, match="method must be"):
        model.with_structured_output(Person, method="xml")
    with pytest.raises(ValueError, match="exactly one tool"):
        model.bind_tools([get_weather, Person], tool_choice=True)
