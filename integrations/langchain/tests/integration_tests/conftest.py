"""One real `parrot-backend serve` (the default model, auth on) for the whole session."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "sk-langchain-tests"
START_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class ParrotServer:
    """Where the session's server listens and the key it accepts."""

    url: str
    api_key: str
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


@pytest.fixture(scope="session")
def parrot_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ParrotServer]:
    """`python -m parrot_backend.cli serve` on a free port with a temporary data dir."""
    data_dir = tmp_path_factory.mktemp("parrot-serve")
    log_path = data_dir / "serve.log"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "parrot_backend.cli",
        "serve",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--api-key",
        API_KEY,
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve exited with {proc.returncode}:\n{_log_tail(log_path)}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve did not answer in {START_TIMEOUT_S} s:\n{_log_tail(log_path)}")
            time.sleep(0.2)
        yield ParrotServer(url, API_KEY, log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # graceful: the store is closed cleanly
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


# Standard tests that fail with SmolLM2-135M because of what the model chooses, never
# because a reply is malformed. Each still runs: a failure whose report matches its
# pattern is reported as an expected failure (XFAIL, with the reason below); any other
# failure fails the run, and a pass shows as XPASS. Test name -> (pattern, what happens).
_REPEATS = (
    "forced with tool_choice='any' (OpenAI 'required', parallel calls allowed), it makes "
    "the right call, then the same call again; the test wants exactly one"
)
_LOOPS = (
    "greedy, it repeats 'A cat is a cat' inside the joke's setup string until max_tokens, "
    "so the object never gets its punchline"
)
MODEL_CHOICE_FAILURES: dict[str, tuple[str, str]] = {
    "test_tool_calling[model0]": (r"assert [2-9] == 1\s.*'name': 'magic_function'", _REPEATS),
    "test_tool_calling[model1]": (r"assert [2-9] == 1\s.*'name': 'magic_function'", _REPEATS),
    "test_tool_calling_async": (r"assert [2-9] == 1\s.*'name': 'magic_function'", _REPEATS),
    "test_tool_calling_with_no_arguments": (
        r"assert [2-9] == 1\s.*'name': 'magic_function_no_args'",
        _REPEATS,
    ),
    "test_structured_output[pydantic]": (r"\{'setup': 'A cat is a cat", _LOOPS),
    "test_structured_output_async[pydantic]": (r"\{'setup': 'A cat is a cat", _LOOPS),
    "test_structured_output_pydantic_2_v1": (r"\{'setup': 'A cat is a cat", _LOOPS),
    "test_json_mode": (
        r"punchline\s+(E\s+)?Field required",
        "in JSON mode (any object) it writes a valid object with 'setup' only, leaving out "
        "the 'punchline' the prompt asks for",
    ),
    "test_agent_loop[model0]": (
        r"where False = any\(<generator object .*test_agent_loop",
        "with tool_choice auto it answers the weather question in text instead of calling "
        "get_weather",
    ),
    "test_agent_loop[model1]": (
        r"where False = any\(<generator object .*test_agent_loop",
        "with tool_choice auto it answers the weather question in text instead of calling "
        "get_weather",
    ),
}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if report.when == "call" and report.failed:
        expected = MODEL_CHOICE_FAILURES.get(item.name)
        if expected is not None and re.search(expected[0], str(report.longrepr), re.S):
            report.outcome = "skipped"
            report.wasxfail = f"SmolLM2-135M's choice: {expected[1]}"
    return report
