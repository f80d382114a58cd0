"""The five examples of `examples/`, each run as a user runs it (`python examples/X.py
--url ...`, a subprocess) against a real `parrot-backend serve` on the tiny random model,
at small sizes: each must finish, print its report (the per-call table read back from the
server) and, for the LangChain one, give the compiled chain the plain chain's output."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    """`parrot-backend serve` on the tiny model (positions up to 512: small sizes below)."""
    port = _free_port()
    data = tmp_path_factory.mktemp("examples-data")
    log = data / "serve.log"
    cmd = [
        *(sys.executable, "-m", "parrot_backend.cli", "serve"),
        *("--model", str(tiny_model_dir), "--port", str(port), "--data-dir", str(data)),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited ({proc.returncode}):\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


CASES = {
    "chain_summary.py": (
        ["--parts", "3", "--part-tokens", "40", "--max-tokens", "6"],
        [r"final summary \([\d.]+ s, one request for 3 dependent calls\)"],
        3,
    ),
    "langchain_map_reduce.py": (
        ["--max-tokens", "6"],
        [r"plain chain: 5 requests", r"compiled chain: 1 request\(s\)", r"same output: True"],
        0,
    ),
    "multi_agent.py": (
        [
            *("--engineers", "2", "--rounds", "1", "--design-tokens", "12"),
            *("--code-tokens", "6", "--review-tokens", "6"),
        ],
        [r"design after [\d.]+ s", r"whole team: [\d.]+ s for \d+ calls"],
        6,
    ),
    "gpts_apps.py": (
        ["--apps", "2", "--users", "2", "--prompt-tokens", "60", "--max-tokens", "6"],
        [r"app 0 \(.*\): 2 users answered", r"app 1 \(.*\): 2 users answered", r"all 4 users"],
        4,
    ),
    "chat_shared_prompt.py": (
        ["--users", "2", "--turns", "2", "--prompt-tokens", "60", "--max-tokens", "6"],
        [r"turn 1: all 2 users answered", r"turn 2: all 2 users answered"],
        4,
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", sorted(CASES))
def test_example_runs_against_a_real_server(server, example):
    args, expected, calls = CASES[example]
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "--url", server, *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    out = done.stdout
    assert done.returncode == 0, f"{example} failed:\n{out}\n{done.stderr}"
    for pattern in expected:
        assert re.search(pattern, out), f"{pattern!r} not in {example}'s output:\n{out}"
    if calls:
        # the per-call table (read back from GET /v1/runs/{id}): one row per call at least,
        # each with the tokens it generated
        rows = re.findall(r"^\s+\S.*\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$", out, re.M)
        assert len(rows) >= calls, f"call table of {example}:\n{out}"
        assert all(int(n) > 0 for n in rows)
