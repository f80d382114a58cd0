"""A program output's `ignore_eos` (the OpenAI routes' extension, for programs): the value
runs to `max_tokens` past the end-of-sequence token, on the real tiny engine. The engine's
EOS is set to the token the model generates third, so the plain output stops there."""

from __future__ import annotations

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.program import GenerationConfig

from .native_support import sse_events
from .test_typed_outputs import real  # noqa: F401  (the fixture: a real engine and store)

TEMPLATE = "The parrot {{input:x}} said {{output:y}}"


def _program(**config) -> dict:
    out = {"max_tokens": 10, "temperature": 0, **config}
    return {"calls": [{"name": "say", "template": TEMPLATE, "outputs": {"y": out}}]}


async def _value(c, program: dict) -> tuple[str, int]:
    r = await c.post("/v1/runs", json={"program": program, "inputs": {"x": "a"}})
    assert r.status_code == 201, r.text
    rid = r.json()["run_id"]
    events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    assert events[-1]["event"] == "run_finished", events[-1]
    detail = (await c.get(f"/v1/runs/{rid}")).json()
    return detail["variables"]["y"]["value"], detail["calls"][0]["completion_tokens"]


async def test_an_output_with_ignore_eos_runs_past_eos_to_max_tokens(real):  # noqa: F811
    c, engine, store = real
    prompt = engine.tokenize("The parrot a said ")
    await engine.fill("probe", None, prompt)
    free = [
        d.token_id
        async for d in engine.generate(
            "probe", None, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        )
    ]
    await engine.free("probe")
    assert len(free) == 10
    eos = free[2]
    first = free.index(eos)  # (it may come earlier than third)
    engine.eos_ids = frozenset({eos})

    plain, plain_n = await _value(c, _program())
    forced, forced_n = await _value(c, _program(ignore_eos=True))
    # stopped at the (new) EOS: counted as generated (as OpenAI usage counts it), not text
    assert plain_n == first + 1 and first < 9
    assert forced_n == 10
    assert forced == engine.detokenize(free)
    assert forced.startswith(plain) and len(forced) > len(plain)


async def test_ignore_eos_is_checked_and_stored_only_when_set(real):  # noqa: F811
    c, _, _ = real
    bad = await c.post(
        "/v1/runs", json={"program": _program(ignore_eos="yes"), "inputs": {"x": "a"}}
    )
    assert bad.status_code == 400 and "ignore_eos" in bad.text, bad.text
    typed = await c.post(
        "/v1/runs",
        json={"program": _program(ignore_eos=True, regex="[a-z]+"), "inputs": {"x": "a"}},
    )
    assert typed.status_code == 400 and "ignore_eos cannot be combined" in typed.text
    # a text output's JSON (stored programs, workflow comparisons) gains no key unless set
    assert "ignore_eos" not in GenerationConfig().model_dump()
    assert GenerationConfig(ignore_eos=True).model_dump()["ignore_eos"] is True
    assert GenerationConfig(ignore_eos=True).to_sampling().ignore_eos is True
