"""The request body limit: the paper's shared-prompt program fits the default, and `serve
--max-body-bytes` sets it (a 413 beyond it names the limit and how to raise it)."""

from __future__ import annotations

import json

import httpx
import pytest

from parrot_backend.cli import build_parser
from parrot_backend.server import ServerSettings
from parrot_backend.server.settings import DEFAULT_MAX_BODY_BYTES

from .native_support import KEYS, native_app, run_body
from .serve_process import Serve

# ~6,144 SmolLM2 tokens of system prompt (about 4.5 characters a token on English text)
SYSTEM = "You are the help desk of a bakery. " * 790


def _paper_program(users: int) -> dict:
    calls = [
        {
            "name": f"u{i}",
            "template": SYSTEM + f"\nUser: {{{{input:q{i}}}}} {{{{output:a{i}}}}}",
        }
        for i in range(users)
    ]
    return run_body(
        *calls,
        inputs={f"q{i}": f"question{i}" for i in range(users)},
        outputs={f"a{i}": "latency" for i in range(users)},
    )


async def test_sixty_four_users_of_a_long_system_prompt_fit_the_default_limit(tmp_path):
    body = _paper_program(64)
    size = len(json.dumps(body).encode())
    assert 1 << 20 < size < DEFAULT_MAX_BODY_BYTES  # over the 1 MiB the limit once was
    async with native_app(tmp_path, settings=ServerSettings(api_keys=dict(KEYS))) as (c, _):
        r = await c.post("/v1/runs", json=body)
        assert r.status_code in (200, 201), r.text
        run = r.json()["run_id"]
        for i in (0, 63):
            got = await c.get(f"/v1/runs/{run}/variables/a{i}", params={"timeout": 30})
            assert got.status_code == 200 and got.json()["value"] == f"<question{i}>"


def test_body_sizes_on_the_command_line(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve"]).max_body_bytes == DEFAULT_MAX_BODY_BYTES == 8 << 20
    for text, value in [("4096", 4096), ("512K", 512 << 10), ("16M", 16 << 20), ("1GiB", 1 << 30)]:
        assert parser.parse_args(["serve", "--max-body-bytes", text]).max_body_bytes == value
    for bad in ["12", "-1M", "lots", "", "1.5M"]:
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--max-body-bytes", bad])
        assert "--max-body-bytes" in capsys.readouterr().err


def test_serve_applies_its_body_limit(tiny_model_dir, tmp_path):
    server = Serve(tiny_model_dir, tmp_path, None, args=["--max-body-bytes", "4K"])
    try:
        url = server.start()
        small = {"model": "x", "prompt": "hello " * 100, "max_tokens": 2}
        big = {"model": "x", "prompt": "hello " * 800, "max_tokens": 2}
        with httpx.Client(base_url=url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            r = c.post("/v1/completions", json={**big, "model": model})
            assert r.status_code == 413, r.text
            message = r.json()["error"]["message"]
            assert "4096 bytes" in message and "--max-body-bytes" in message, message
            ok = c.post("/v1/completions", json={**small, "model": model})
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()
