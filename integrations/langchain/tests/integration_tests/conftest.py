"""One real `parrot-backend serve` (the default model, auth on) for the whole session."""

from __future__ import annotations

import os
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
