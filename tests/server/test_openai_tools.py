"""Tool calling and response formats on the OpenAI routes, through the official `openai`
client: calls parsed out of text (whole and streamed as OpenAI streams them: id and name
first, then argument deltas), forced calls whose arguments always match the function's
schema on the tiny *random* model, response formats, tool messages sent back, and how tools
reach the prompt."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from parrot_backend.engine.grammar_tools import OPEN
from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.chat_template import render_chat
from parrot_backend.server.openai_prep import chat_messages, tool_messages
from parrot_backend.server.openai_schemas import ChatCompletionRequest
from parrot_backend.testing.fake_engine import FakeEngine

from .conftest import LiveServer

pytestmark = pytest.mark.timeout(180)

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
}
TIME = {
    "type": "object",
    "additionalProperties": False,
    "required": ["tz"],
    "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather and time in Paris?"}]
CALLS_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    '{"tz": "CET"}}\n</tool_call>'
)


def _streamed(chunks) -> tuple[str, list[dict], str | None]:
    """Assemble an OpenAI chat stream as a client does: content, and per call index the id
    and name of its first delta and the concatenated argument deltas."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                if part.index not in calls:
                    assert part.id and part.type == "function" and part.function.name
                    calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
                else:
                    assert part.id is None and part.function.name is None
                calls[part.index]["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ----------------------------------------------------------------- parsing (scripted engine)
@pytest.fixture
async def fake_client():
    engine = FakeEngine(reply=CALLS_TEXT, max_model_len=4096)  # bytes are tokens here
    app = create_app(engine, settings=ServerSettings())
    client = openai.AsyncOpenAI(
        base_url="http://t/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t"),
    )
    yield client, engine
    await client.close()


async def test_calls_in_text_become_tool_calls(fake_client):
    client, engine = fake_client
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "CET"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)
    assert engine.generations[-1].sampling.constraint is None  # 'auto' leaves the model free


async def test_streamed_calls_arrive_as_openai_streams_them(fake_client):
    client, _ = fake_client
    whole = (
        await client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS)
    ).choices[0]
    stream = await client.chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, stream=True
    )
    chunks = [c async for c in stream]
    content, calls, finish = _streamed(chunks)
    assert finish == "tool_calls" and content == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    # the arguments really came in pieces (one character per token here), not at once
    pieces = [p for ch in chunks for c in ch.choices for p in c.delta.tool_calls or []]
    assert len(pieces) > 10


async def test_text_without_calls_and_tool_choice_none_stay_content(fake_client):
    client, engine = fake_client
    engine.reply = "Paris is sunny."
    r = await client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS)
    assert r.choices[0].message.content == "Paris is sunny."
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    engine.reply = CALLS_TEXT
    r = await client.chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, tool_choice="none"
    )
    assert r.choices[0].message.content == CALLS_TEXT and r.choices[0].message.tool_calls is None


async def test_a_cut_call_keeps_finish_reason_length(fake_client):
    client, _ = fake_client
    r = await client.chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, max_tokens=85
    )  # inside the arguments
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls[0].function.name == "get_weather"


async def test_a_next_call_cut_inside_its_tag_leaks_no_markup(fake_client):
    client, engine = fake_client
    first = CALLS_TEXT[CALLS_TEXT.index(OPEN) : CALLS_TEXT.index("</tool_call>") + 12]
    for cut in range(1, len(OPEN)):
        engine.reply = first + "\n" + OPEN[:cut]
        for stream in (False, True):
            r = await client.chat.completions.create(
                model="fake-model", messages=USER, tools=TOOLS, stream=stream
            )
            if stream:
                content, calls, _ = _streamed([c async for c in r])
                names = [c["name"] for c in calls]
            else:
                content = r.choices[0].message.content
                names = [c.function.name for c in r.choices[0].message.tool_calls]
            assert not content and names == ["get_weather"], (cut, stream, content)


async def test_constraints_follow_tool_choice_and_response_format(fake_client):
    client, engine = fake_client

    async def constraint(**kw):
        await client.chat.completions.create(model="fake-model", messages=USER, **kw)
        return engine.generations[-1].sampling.constraint

    forced = await constraint(tools=TOOLS, tool_choice="required")
    assert forced.kind == "lark" and "get_weather" in forced.spec and "get_time" in forced.spec
    named = await constraint(
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert "get_time" in named.spec and "get_weather" not in named.spec
    single = await constraint(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert '("\\n" call)*' in forced.spec and '("\\n" call)*' not in single.spec
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    schema = await constraint(response_format=fmt)
    assert (schema.kind, json.loads(schema.spec)) == ("json_schema", WEATHER)
    anything = await constraint(response_format={"type": "json_object"})
    assert json.loads(anything.spec) == {"type": "object"}
    either = await constraint(tools=TOOLS, response_format=fmt)  # auto: a call or the format
    assert either.kind == "lark" and "content: %json" in either.spec
    assert (
        await constraint(tools=TOOLS, tool_choice="none", response_format={"type": "text"}) is None
    )


# ----------------------------------------------------------------- prompts
SMOL = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# a template that renders tools and calls itself, as Qwen2.5's and Llama-3.1's do
NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|"
    "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}"
    "({{ c.function.arguments.city }})]{% endfor %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}"
)
HISTORY = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
]


def _render(template: str, messages: list[dict], **kw) -> str:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": TOOLS, **kw}
    )
    from parrot_backend.server.chat_template import takes_tools

    native = takes_tools(template)
    msgs = chat_messages(body, native_tools=native)
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if not native:
        msgs, tools = tool_messages(msgs, tools), None
    return render_chat(template, msgs, tools=tools)


def test_a_template_without_tools_gets_them_in_the_system_message():
    text = _render(SMOL, HISTORY)
    assert text.startswith("<|im_start|>system\nYou can call these functions.")
    assert json.dumps(TOOLS[0]) in text and json.dumps(TOOLS[1]) in text
    # the earlier call as the model would have written it, the result as a tool response
    assert (
        f'<|im_start|>assistant\n{OPEN}\n{{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>'
    ) in text
    assert "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>" in text
    with_system = _render(SMOL, [{"role": "system", "content": "Be brief."}, *HISTORY])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these")


def test_a_template_with_tools_renders_them_itself():
    text = _render(NATIVE, HISTORY)
    assert text.split("|") == [
        "TOOLS:get_weather;get_time;",
        "user: Weather and time in Paris?",
        "assistant: [get_weather(Paris)]",
        "tool: 22 C, sunny#call_1",
        "",
    ]


# ----------------------------------------------------------------- forced calls, real engine
@pytest.fixture(scope="module")
def live_tiny(tiny_model_dir):
    from parrot_backend.engine.engine import Engine

    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=512, progress=False)
    app = create_app(engine, settings=ServerSettings(manage_engine=True))
    with LiveServer(app) as live:
        yield (
            openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120),
            engine,
        )


def _check_call(name: str, arguments: str, allowed=SCHEMAS) -> None:
    assert name in allowed
    assert jsonschema_rs.validator_for(allowed[name]).is_valid(json.loads(arguments)), arguments


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_forced_calls_of_noise_always_match_their_schema(live_tiny, seed):
    client, engine = live_tiny
    r = client.chat.completions.create(
        model=engine.model_name,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=200,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check_call(call.function.name, call.function.arguments)


def test_a_named_function_is_the_one_called_streamed_or_not(live_tiny):
    client, engine = live_tiny
    kw = dict(
        model=engine.model_name,
        messages=USER,
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = _streamed(client.chat.completions.create(**kw, stream=True))
    assert whole.finish_reason == finish == "tool_calls" and not content
    assert [c.function.name for c in whole.message.tool_calls] == ["get_time"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    for c in calls:
        _check_call(c["name"], c["arguments"])


def test_parallel_forced_calls_all_match(live_tiny):
    client, engine = live_tiny
    for seed in (5, 6):
        r = client.chat.completions.create(
            model=engine.model_name,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=250,
        )
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            _check_call(call.function.name, call.function.arguments)


class Bird(BaseModel):
    name: str = Field(max_length=10)
    loud: bool
    wings: int = Field(ge=0, le=4)


def test_response_format_json_schema_parses_into_the_model(live_tiny):
    client, engine = live_tiny
    for seed in (1, 2, 3):
        r = client.chat.completions.parse(
            model=engine.model_name,
            messages=USER,
            response_format=Bird,
            temperature=1.0,
            seed=seed,
            max_tokens=100,
        )
        assert isinstance(r.choices[0].message.parsed, Bird), r.choices[0].message.content


def test_tool_messages_are_accepted_back(live_tiny):
    client, engine = live_tiny
    r = client.chat.completions.create(
        model=engine.model_name,
        messages=HISTORY,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert engine.contexts == {}
