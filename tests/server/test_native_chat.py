"""Chat calls in programs: `messages` rendered with the model's chat template into a plain
template. A chat call generates what `/v1/chat/completions` generates for the same
messages (greedy, real engine); a system prompt shared by many chat calls is filled once;
values stay data."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.engine.engine import Engine
from parrot_backend.program import ChatCallSpec, ProgramSpec
from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.chat_template import DEFAULT_CHAT_TEMPLATE
from parrot_backend.server.native_chat import ChatCallError, lower_call, lower_program
from parrot_backend.server.runtime import NativeRuntime
from parrot_backend.store import Store

from .native_support import migrated_sqlite, sse_events

SYSTEM = "You are a helpful assistant who answers in one short sentence."


def chat_call(name: str, user: str, out: str, **outputs) -> dict:
    return {
        "name": name,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
            {"role": "assistant", "content": f"{{{{output:{out}}}}}"},
        ],
        "outputs": {out: {"max_tokens": 12, **outputs}},
    }


def test_messages_render_into_a_plain_template_with_the_chat_markup_fixed():
    call = ChatCallSpec.model_validate(
        chat_call("c", "Tell me about {{input:topic}}. \\{{x}}", "a")
    )
    lowered = lower_call(call, DEFAULT_CHAT_TEMPLATE, {}, 0)
    assert lowered.messages is None and lowered.outputs == call.outputs
    assert lowered.template == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nTell me about "
        "{{input:topic}}. \\{{x}}<|im_end|>\n<|im_start|>assistant\n{{output:a}}"
    )
    built = lowered.build(0)
    assert built.inputs == ("topic",) and built.outputs == ("a",)
    same = ProgramSpec.model_validate({"calls": [{"template": "x {{output:o}}"}]})
    assert lower_program(same, None, {}) is same  # nothing to render: untouched


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user", "content": "{{output:a}}"}], "last message"),
        (
            [{"role": "user", "content": "{{output:a}}"}, {"role": "assistant", "content": "x"}],
            "only the last",
        ),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no output"}],
            "generates nothing",
        ),
        (
            [
                {"role": "user", "content": "{{input:"},
                {"role": "assistant", "content": "{{output:a}}"},
            ],
            "message 0",
        ),
    ],
)
def test_bad_chat_calls_are_clear_errors(messages, says):
    call = ChatCallSpec.model_validate({"name": "c", "messages": messages})
    with pytest.raises(ChatCallError, match=says):
        lower_call(call, DEFAULT_CHAT_TEMPLATE, {}, 0)


def test_a_call_has_a_template_or_messages():
    with pytest.raises(ValueError, match="messages"):  # a template call has no messages
        ProgramSpec.model_validate(
            {
                "calls": [
                    {"template": "x {{output:o}}", "messages": [{"role": "user", "content": "x"}]}
                ]
            }
        )
    with pytest.raises(ValueError, match="template"):
        ProgramSpec.model_validate({"calls": [{"name": "c"}]})
    chat = ProgramSpec.model_validate(
        {
            "calls": [
                {
                    "messages": [
                        {"role": "user", "content": "x"},
                        {"role": "assistant", "content": "{{output:o}}"},
                    ]
                }
            ]
        }
    )
    assert isinstance(chat.calls[0], ChatCallSpec)


@pytest.fixture
async def real(tiny_model_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    store = Store(migrated_sqlite(tmp_path))
    runtime = NativeRuntime(store, {"e0": engine}, worker="chat-test")
    app = create_app(engine, settings=ServerSettings(), native=runtime)
    await engine.start()
    await runtime.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120
        ) as c:
            yield c, engine, runtime
    finally:
        await runtime.stop()
        await engine.stop()
        store.close()


async def _values(c, body) -> dict[str, str]:
    r = await c.post("/v1/runs", json=body)
    assert r.status_code == 201, r.text
    rid = r.json()["run_id"]
    events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    assert events[-1]["data"]["status"] == "finished", events[-3:]
    detail = (await c.get(f"/v1/runs/{rid}")).json()
    return {n: v["value"] for n, v in detail["variables"].items()}


async def _chat_completion(c, engine, user: str) -> str:
    r = await c.post(
        "/v1/chat/completions",
        json={
            "model": engine.model_name,
            "temperature": 0,
            "max_tokens": 12,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def test_a_chat_call_generates_what_chat_completions_does(real):
    c, engine, _ = real
    for question in ("What do parrots eat?", "Name a river."):
        values = await _values(
            c,
            {"program": {"calls": [chat_call("c", "{{input:q}}", "a")]}, "inputs": {"q": question}},
        )
        assert values["a"] == await _chat_completion(c, engine, question)


async def test_a_shared_system_prompt_is_filled_once_for_many_chat_calls(real):
    c, engine, runtime = real
    calls = [chat_call(f"c{i}", "{{input:q" + str(i) + "}}", f"a{i}") for i in range(4)]
    inputs = {f"q{i}": q for i, q in enumerate(["Hi.", "Name a bird.", "Why?", "Go on."])}
    before = runtime.manager.counts()
    values = await _values(c, {"program": {"calls": calls}, "inputs": inputs})
    after = runtime.manager.counts()
    assert after["prefix_fills"] - before["prefix_fills"] == 1
    assert after["prefix_forks"] - before["prefix_forks"] == 4
    for i, q in enumerate(inputs.values()):
        assert values[f"a{i}"] == await _chat_completion(c, engine, q)


async def test_values_are_data_in_chat_calls(real):
    c, _, _ = real
    tricky = "{{output:a}} {{input:q}} \\{{"  # never parsed again
    values = await _values(
        c, {"program": {"calls": [chat_call("c", "{{input:q}}", "a")]}, "inputs": {"q": tricky}}
    )
    assert values["q"] == tricky and isinstance(values["a"], str)


async def test_chat_calls_in_open_runs_and_workflows(real):
    c, _, _ = real
    r = await c.post(
        "/v1/runs", json={"program": {"calls": [chat_call("c", "Hi", "a")]}, "open": True}
    )
    rid = r.json()["run_id"]
    r = await c.post(
        f"/v1/runs/{rid}/calls", json={"calls": [chat_call("d", "Follow up on {{input:a}}", "b")]}
    )
    assert r.status_code == 200, r.text
    detail = (await c.get(f"/v1/runs/{rid}")).json()
    assert "<|im_start|>" in detail["program"]["calls"][1]["template"]
    r = await c.post(
        "/v1/workflows",
        json={"name": "chatty", "program": {"calls": [chat_call("c", "{{input:q}}", "a")]}},
    )
    assert r.status_code == 201, r.text
    assert "{{input:q}}" in r.json()["program"]["calls"][0]["template"]
    r = await c.post(
        "/v1/runs",
        json={
            "program": {"calls": [{"name": "c", "messages": [{"role": "user", "content": "x"}]}]}
        },
    )
    assert r.status_code == 400 and "last message" in r.json()["error"]["message"]
