"""`parrot-backend serve` as a real process: it serves, and it dies loudly with its engine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(port) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["id"]


def _start(model_dir, env_extra=None):
    port = _free_port()
    # never the user's own database: a temporary data dir per server
    data_dir = tempfile.mkdtemp(prefix="parrot-serve-test-")
    env = {**os.environ, "PARROT_DATA_DIR": data_dir, **(env_extra or {})}
    env.pop("PARROT_DATABASE_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "parrot_backend.cli",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--num-blocks",
            "64",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited early: {proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("serve did not come up")


def test_serve_exits_non_zero_when_the_engine_dies(tiny_model_dir):
    proc, port = _start(tiny_model_dir, {"PARROT_FAULT_ENGINE_STEP": "2"})
    try:
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=30,
            json={"model": _model(port), "prompt": "hello there", "max_tokens": 8},
        )
        assert r.status_code >= 500 or r.status_code == 200
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert code == 1
    assert "engine failed" in proc.stdout.read()


def test_serve_answers_and_shuts_down_cleanly_on_sigint(tiny_model_dir):
    import signal

    proc, port = _start(tiny_model_dir)
    try:
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=30,
            json={"model": _model(port), "prompt": "hello there", "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 4
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert code == 0
