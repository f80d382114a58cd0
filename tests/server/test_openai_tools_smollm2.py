"""The "done when" of structured output, as a user sees it: the official `openai` client
against `parrot-backend serve` with the default model (SmolLM2-135M-Instruct, greedy),
forcing a tool call and asking for a JSON schema. What the 135M model picks may be silly;
that the result parses and matches the schema is what decoding guarantees."""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest

from .serve_process import Serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    }
]
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
}


@pytest.fixture(scope="module")
def client(smollm2_dir, tmp_path_factory):
    serve = Serve(smollm2_dir, tmp_path_factory.mktemp("serve"), None)
    url = serve.start()
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        client.model = client.models.list().data[0].id  # named after the converted folder
        yield client
    finally:
        serve.stop()


def test_required_tool_call_and_its_result(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=client.model,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        parallel_tool_calls=False,
        max_tokens=64,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert jsonschema_rs.validator_for(WEATHER).is_valid(args)
    # the result goes back as a tool message; the model answers in text
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    answer = client.chat.completions.create(
        model=client.model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=32,
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_streamed_forced_call_equals_the_whole_one(client):
    kw = dict(
        model=client.model,
        tools=TOOLS,
        temperature=0,
        max_tokens=64,
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "Weather in Rome, please."}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    name, arguments = None, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name = name or part.function.name
            arguments += part.function.arguments or ""
    assert (name, arguments) == (whole.function.name, whole.function.arguments)


def test_response_format_json_schema_and_json_object(client):
    messages = [{"role": "user", "content": "Invent a person with a name and an age."}]
    r = client.chat.completions.create(
        model=client.model,
        messages=messages,
        temperature=0,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    assert r.choices[0].finish_reason == "stop"
    assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(
        model=client.model,
        messages=messages,
        temperature=0,
        max_tokens=96,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":  # a free object may outgrow the budget
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
