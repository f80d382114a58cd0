"""Drafts as a user meets them: `parrot-backend serve` with the default model answers a
greedy completion that copies from its prompt with the text `serve --speculate 0` gives,
streamed or not, a seeded sampled one too, and `/metrics` shows the drafts it checked and
kept."""

from __future__ import annotations

import json

import httpx
import pytest

from .serve_process import Serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = (
    "You keep a running summary of a long document.\nNext part:\n"
    "The river town of Alder keeps a lantern fair each autumn. The lantern fair brings "
    "boats from the coast, and the boats carry oil, rope and glass. The glass makers of "
    "Alder sell lanterns to the boats.\nUpdated summary:"
)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _answers(url: str) -> tuple[str, str, str, str]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    streamed = ""
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["text"]
    sampled = httpx.post(
        f"{url}/v1/completions", json={**body, "temperature": 0.7, "seed": 4}, timeout=120
    ).json()
    return (
        plain["choices"][0]["text"],
        streamed,
        httpx.get(f"{url}/metrics").text,
        sampled["choices"][0]["text"],
    )


def test_serve_with_drafts_answers_as_without(smollm2_dir, tmp_path):
    texts = {}
    for name, args in (("on", []), ("off", ["--speculate", "0"])):
        (tmp_path / name).mkdir()
        serve = Serve(smollm2_dir, tmp_path / name, None, args=args)
        url = serve.start()
        try:
            texts[name] = _answers(url)
        finally:
            serve.stop()
    on, off = texts["on"], texts["off"]
    assert on[0] == off[0] and on[1] == off[0] and off[1] == off[0] and on[0].strip()
    assert on[3] == off[3] and on[3].strip() and on[3] != on[0]  # sampled: the seed's text
    assert _metric(on[2], "parrot_engine_draft_tokens_accepted_total") > 0
    assert _metric(on[2], "parrot_engine_draft_tokens_total") >= _metric(
        on[2], "parrot_engine_draft_tokens_accepted_total"
    )
    assert _metric(off[2], "parrot_engine_draft_tokens_total") == 0
