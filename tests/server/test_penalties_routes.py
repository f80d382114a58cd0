"""Presence and frequency penalties through the OpenAI routes and a program's outputs, on
the tiny random model (whose greedy text changes under a negative penalty, which rewards a
repeat): the routes pass them to the engine as they are."""

from __future__ import annotations

from parrot_backend.contract.sampling import SamplingParams

from .native_support import sse_events
from .test_typed_outputs import real  # noqa: F401  (the fixture: a real engine and store)

PROMPT = "The parrot said"


async def test_completions_pass_penalties_to_the_engine(real):  # noqa: F811
    c, engine, _ = real
    body = {"model": engine.model_name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    body["ignore_eos"] = True
    plain = await c.post("/v1/completions", json=body)
    pen = await c.post("/v1/completions", json={**body, "frequency_penalty": -2.0})
    both = await c.post(
        "/v1/chat/completions",
        json={
            "model": engine.model_name,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 12,
            "temperature": 0,
            "presence_penalty": -1.5,
            "frequency_penalty": 0.5,
        },
    )
    assert plain.status_code == pen.status_code == both.status_code == 200, pen.text
    text = pen.json()["choices"][0]["text"]
    assert text != plain.json()["choices"][0]["text"]
    await engine.fill("direct", None, engine.tokenize(PROMPT))
    direct = [
        d.text
        async for d in engine.generate(
            "direct",
            None,
            SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=-2.0),
        )
    ]
    await engine.free("direct")
    assert "".join(direct) == text


async def test_a_program_output_is_generated_with_its_penalties(real):  # noqa: F811
    c, _, _ = real

    def program(**config) -> dict:
        return {
            "calls": [
                {
                    "name": "say",
                    "template": "The parrot {{input:x}} said {{output:y}}",
                    "outputs": {"y": {"max_tokens": 12, "temperature": 0, **config}},
                }
            ]
        }

    values = []
    for config in ({}, {"frequency_penalty": -2.0}, {"presence_penalty": -2.0}):
        r = await c.post("/v1/runs", json={"program": program(**config), "inputs": {"x": "a"}})
        assert r.status_code == 201, r.text
        rid = r.json()["run_id"]
        assert sse_events((await c.get(f"/v1/runs/{rid}/events")).text)[-1]["event"] == (
            "run_finished"
        )
        values.append((await c.get(f"/v1/runs/{rid}")).json()["variables"]["y"]["value"])
    assert values[1] != values[0] and values[2] != values[0]
    bad = await c.post(
        "/v1/runs", json={"program": program(frequency_penalty=2.5), "inputs": {"x": "a"}}
    )
    assert bad.status_code == 400 and "frequency_penalty" in bad.text, bad.text
