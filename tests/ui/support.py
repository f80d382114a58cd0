"""Helpers of the browser tests: a paced scripted engine, a live server, a cutting proxy.

(A module name unique across test folders: tests/ dirs are imported as rootdir modules.)
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.runtime import NativeRuntime
from parrot_backend.store import Store
from parrot_backend.testing.fake_engine import ScriptedEngine

# ChatML, as SmolLM2's template renders it: enough for the examples' chat calls.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MARKUP = re.compile(r"<\|[^|]*\|>")


def reply_for(length: int | None = None):
    """A deterministic reply: the last words the call was asked (so values show where
    they came from and a replay equals its run); `length` repeats it to that many
    characters (one token each on the scripted engine)."""

    def reply(prompt: str) -> str:
        asked = prompt.rsplit("<|im_start|>assistant", 1)[0]
        words = _MARKUP.sub(" ", asked).split()
        text = "re: " + " ".join(words[-10:]) + "."
        if length is not None:
            text = (text + " ") * (length // (len(text) + 1) + 1)
            text = text[:length]
        return text

    return reply


@dataclass
class PacedEngine(ScriptedEngine):
    """The scripted engine with a chat template and a pause before each token
    (`delay_s`, changeable while it runs), so a test can act mid-stream."""

    delay_s: float = 0.0
    chat_template: str = CHATML

    def generate(self, context_id, parent_id, sampling, *, salt=None, priority=0):
        """The scripted stream, `delay_s` before each token."""
        inner = super().generate(context_id, parent_id, sampling, salt=salt, priority=priority)
        return self._paced(inner)

    async def _paced(self, inner: AsyncIterator) -> AsyncIterator:
        try:
            async for delta in inner:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield delta
        finally:
            await inner.aclose()


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveApp:
    """The app with the native API on a paced scripted engine, served by uvicorn on
    loopback in a thread (real sockets: the browser connects to it)."""

    def __init__(self, data_dir: Path, *, api_keys: dict[str, str] | None = None) -> None:
        self.engine = PacedEngine(reply=reply_for(), record=False)
        self.store = Store(f"sqlite:///{data_dir / 'parrot.db'}")
        self.runtime = NativeRuntime(self.store, {"e0": self.engine}, worker="ui-test")
        settings = ServerSettings(
            api_keys=dict(api_keys or {}),
            key_lookup=self.runtime.key_lookup if api_keys else None,
            sse_ping_s=5,
        )
        self.app = create_app(self.engine, settings=settings, native=self.runtime)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveApp:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.store.close()


@contextlib.contextmanager
def live_app(**kw) -> Iterator[LiveApp]:
    """A LiveApp on a fresh SQLite file, removed afterwards."""
    data_dir = Path(tempfile.mkdtemp(prefix="parrot-ui-"))
    try:
        with LiveApp(data_dir, **kw) as app:
            yield app
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


class CutProxy:
    """A TCP proxy on loopback in front of a server: `cut()` drops every open connection
    at once (mid-response, mid-event even), `block()` closes new connections as soon as
    they arrive until `unblock()`. What the browser sees is a network that goes away."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.blocked = threading.Event()
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        self.cuts = 0
        self.refused = 0
        self.closing = False
        self._mid_event: threading.Event | None = None  # armed: cut inside the next event
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.blocked.is_set():
                self.refused += 1
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self.lock:
                self.open.update((client, upstream))
            for a, b, down in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(a, b, down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while chunk := src.recv(65536):
                fired = self._mid_event
                at = chunk.find(b"event: token") if down and fired is not None else -1
                if at >= 0:
                    # half an event reaches the browser (its id line, not its end)
                    dst.sendall(chunk[: at + len(b"event: tok")])
                    self._mid_event = None
                    self.cut()
                    fired.set()
                    return
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with self.lock:
                self.open.discard(src)
                self.open.discard(dst)
            _close(src)
            _close(dst)

    def cut(self) -> int:
        """Drop every open connection now; returns how many sockets were open."""
        with self.lock:
            victims = list(self.open)
            self.open.clear()
        for s in victims:
            _close(s)
        self.cuts += 1
        return len(victims)

    def cut_mid_event(self, timeout: float = 30) -> None:
        """Drop every connection right inside the next token event the server sends:
        the browser gets the start of an event (its `id:` line) but never its end."""
        fired = threading.Event()
        self._mid_event = fired
        if not fired.wait(timeout):
            self._mid_event = None
            raise AssertionError("no token event went through the proxy to cut")

    def block(self) -> None:
        """Refuse (accept, then close) every new connection."""
        self.blocked.set()

    def unblock(self) -> None:
        """Let connections through again."""
        self.blocked.clear()

    def close(self) -> None:
        """Stop accepting and drop what is open."""
        self.closing = True
        _close(self.listener)
        self.cut()


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
