"""`logit_bias` in a native program's output config (the tiny random model, through the
native API): a large bias forces its token in the value, a downstream call's own bias
applies to it alone, the stored program keeps the config (a replay gives the same
values), a config without one stores no new key, and bad biases are 400s naming the
output."""

from __future__ import annotations

import pytest

from .native_support import sse_events
from .test_typed_outputs import real  # noqa: F401  (the fixture: tiny engine, store, app)

PROGRAM = {
    "calls": [
        {
            "name": "a",
            "template": "Say {{input:x}}: {{output:y}}",
            "outputs": {"y": {"max_tokens": 4, "ignore_eos": True, "logit_bias": {"42": 100}}},
        },
        {
            "name": "b",
            "template": "Echo {{input:y}} then {{output:z}}",
            "outputs": {
                "z": {
                    "max_tokens": 3,
                    "ignore_eos": True,
                    "temperature": 1.0,
                    "seed": 4,
                    "logit_bias": {"77": 100.0, "42": -100},
                }
            },
        },
        {
            "name": "c",
            "template": "Plain {{input:y}} {{output:w}}",
            "outputs": {"w": {"max_tokens": 3, "ignore_eos": True}},
        },
    ]
}


async def _values(c, rid: str) -> dict[str, str]:
    events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    assert events[-1]["data"]["status"] == "finished", events[-3:]
    detail = (await c.get(f"/v1/runs/{rid}")).json()
    return {n: v["value"] for n, v in detail["variables"].items()}


async def test_a_bias_forces_its_token_and_is_stored_with_the_program(real):  # noqa: F811
    c, engine, _ = real
    r = await c.post("/v1/runs", json={"program": PROGRAM, "inputs": {"x": "parrots"}})
    assert r.status_code == 201, r.text
    rid = r.json()["run_id"]
    values = await _values(c, rid)
    assert values["y"] == engine.detokenize([42] * 4)
    assert values["z"] == engine.detokenize([77] * 3)
    # the unbiased call is unbiased: what the request-level route gives for its prompt
    prompt = f"Plain {values['y']} "
    plain = await c.post(
        "/v1/completions",
        json={
            "model": engine.model_name,
            "prompt": prompt,
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert plain.json()["choices"][0]["text"] == values["w"]
    detail = (await c.get(f"/v1/runs/{rid}")).json()
    outputs = {
        name: config
        for call in detail["program"]["calls"]
        for name, config in call["outputs"].items()
    }
    assert outputs["y"]["logit_bias"] == {"42": 100.0}
    assert "logit_bias" not in outputs["w"]  # a config without one stores no new key
    replay = await c.post(f"/v1/runs/{rid}/replay")
    assert replay.status_code in (200, 201), replay.text
    assert await _values(c, replay.json()["run_id"]) == values


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"parrot": 1}, "token ids"),
        ({"5": 101}, "less than or equal to 100"),
        ({"5": 1, "05": 2}, "twice"),
        ({"99999999": 1}, "outside the vocabulary"),
    ],
)
async def test_bad_biases_are_400s_naming_the_output(real, bias, message):  # noqa: F811
    c, _, _ = real
    program = {
        "calls": [
            {
                "name": "c",
                "template": "x {{output:answer}}",
                "outputs": {"answer": {"logit_bias": bias}},
            }
        ]
    }
    r = await c.post("/v1/runs", json={"program": program})
    assert r.status_code == 400, r.text
    error = r.json()["error"]["message"]
    assert "answer" in error and message in error, error
