"""Constraints travel over the engine API: a RemoteEngine generates exactly what the
in-process engine does under the same constraint, and a refused one is an InvalidRequest
naming the problem."""

from __future__ import annotations

import json

import httpx
import pytest

from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import Constraint, SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engines.remote import RemoteEngine
from parrot_backend.server.engine_api import create_engine_app

from .helpers import collect

KEY = "sk-engine"
CONSTRAINTS = [
    Constraint(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
                },
                "required": ["tags"],
                "additionalProperties": False,
            }
        ),
    ),
    Constraint("regex", r"[0-9]{2}-[a-z]{2}"),
    Constraint("choice", ("left", "right", 'with "quotes"')),
]


@pytest.fixture
async def engines(tiny_model_dir):
    local = Engine.from_pretrained(tiny_model_dir, num_blocks=128, progress=False)
    async with local:
        app = create_engine_app(local, api_key=KEY)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://e",
            headers={"Authorization": f"Bearer {KEY}"},
        )
        info = (await client.get("/engine/info")).json()
        remote = RemoteEngine(
            "http://e", api_key=KEY, info=info, tokenizer=local.tokenizer, client=client
        )
        try:
            yield local, remote
        finally:
            await client.aclose()


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["json_schema", "regex", "choice"])
async def test_remote_constrained_generation_equals_in_process(engines, constraint):
    local, remote = engines
    prompt = local.tokenize("Answer:")
    outputs = []
    for i, engine in enumerate((local, remote)):
        await engine.fill(f"p{i}", None, prompt)
        tokens, text, deltas = await collect(
            engine,
            f"p{i}",
            None,
            SamplingParams(max_tokens=40, temperature=1.0, seed=7, constraint=constraint),
        )
        outputs.append((tokens, text, deltas[-1].finish_reason))
        await engine.free(f"p{i}")
    assert outputs[0] == outputs[1]
    assert outputs[0][2] == "stop"


async def test_remote_refusal_names_the_unsupported_keyword(engines):
    _, remote = engines
    await remote.fill("r", None, [1, 2, 3])
    bad = Constraint("json_schema", json.dumps({"type": "array", "uniqueItems": True}))
    with pytest.raises(InvalidRequest, match="uniqueItems"):
        await collect(remote, "r", None, SamplingParams(constraint=bad))
    with pytest.raises(InvalidRequest, match="kind must be one of"):
        await collect(remote, "r", None, SamplingParams(constraint=Constraint("sql", "x")))
