"""`parrot-backend serve` as a real process, for tests that restart or kill it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`python -m parrot_backend.cli serve` on a port, with a data dir or a database URL."""

    def __init__(
        self,
        model_dir,
        data_dir,
        database_url: str | None,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        self.cmd = [
            sys.executable,
            "-m",
            "parrot_backend.cli",
            "serve",
            "--model",
            str(model_dir),
            "--num-blocks",
            "256",
            "--data-dir",
            str(data_dir),
            "--worker-id",
            "recovery-test",
            *(args or []),
        ]
        if database_url:
            self.cmd += ["--database-url", database_url]
        self.proc: subprocess.Popen | None = None
        self.log = data_dir / "serve.log"
        self.env = {**os.environ, **(env or {})}

    def start(self) -> str:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [*self.cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited early:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("serve did not come up")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
