"""Extreme but valid sampling values on both APIs against the real engine (tiny model):
every request succeeds and the engine keeps serving. Before, `temperature` 1e-300, 5e-324,
1e-38 or 1e-45, or `top_p` 1e-300 made the sampler raise on the compute thread: a 503
and a dead engine (serve exited 1)."""

from __future__ import annotations

import random

import httpx
import pytest

from parrot_backend.engine.engine import Engine
from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.runtime import NativeRuntime
from parrot_backend.store import Store

from .native_support import migrated_sqlite, sse_events

pytestmark = pytest.mark.timeout(300)

OPENAI_TEMPERATURES = [0, 5e-324, 1e-300, 1e-45, 1e-38, 1e-8, 1e-5, 0.5, 1.0, 2.0]  # <= 2
TEMPERATURES = [*OPENAI_TEMPERATURES, 1e30, 1.7e308]
TOP_PS = [5e-324, 1e-300, 1e-45, 0.1, 1.0]
TOP_KS = [0, 1, 3, 49152]


async def test_extreme_sampling_on_openai_and_native_routes(tiny_model_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    store = Store(migrated_sqlite(tmp_path))
    runtime = NativeRuntime(store, {"e0": engine}, worker="extreme-test")
    app = create_app(engine, settings=ServerSettings(), native=runtime)
    rng = random.Random(7)
    await engine.start()
    await runtime.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120
        ) as c:
            model = engine.model_name
            for i in range(24):
                sampling = {
                    "temperature": rng.choice(TEMPERATURES if i % 3 == 2 else OPENAI_TEMPERATURES),
                    "top_p": rng.choice(TOP_PS),
                    "seed": i,
                }
                if i % 3 == 0:
                    r = await c.post(
                        "/v1/chat/completions",
                        json={
                            "model": model,
                            "max_tokens": 4,
                            "top_k": rng.choice(TOP_KS),
                            "messages": [{"role": "user", "content": "Hi"}],
                            **sampling,
                        },
                    )
                elif i % 3 == 1:
                    r = await c.post(
                        "/v1/completions",
                        json={
                            "model": model,
                            "prompt": "A parrot",
                            "max_tokens": 4,
                            "stream": True,
                            **sampling,
                        },
                    )
                    assert '"error"' not in r.text, r.text
                else:
                    config = {"max_tokens": 4, "top_k": rng.choice(TOP_KS), **sampling}
                    r = await c.post(
                        "/v1/runs",
                        json={
                            "program": {
                                "calls": [
                                    {
                                        "template": "Say {{input:x}}: {{output:y}}",
                                        "outputs": {"y": config},
                                    }
                                ]
                            },
                            "inputs": {"x": "hi"},
                        },
                    )
                    assert r.status_code == 201, r.text
                    events = sse_events((await c.get(f"/v1/runs/{r.json()['run_id']}/events")).text)
                    assert events[-1]["data"]["status"] == "finished", events[-3:]
                assert r.status_code in (200, 201), (sampling, r.text)
            assert engine.error is None
            assert (await c.get("/healthz")).status_code == 200
    finally:
        await runtime.stop()
        await engine.stop()
        store.close()
