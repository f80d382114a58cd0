"""`serve` keeps an idle keep-alive connection open longer than httpx's clients keep it
in their pools (5 s): with uvicorn's default of 5 s, a client reusing a pooled connection
just as the server closed it got a ReadError for a request never answered."""

from __future__ import annotations

import socket
import time

import httpx

from parrot_backend.server.settings import KEEP_ALIVE_S

from .serve_process import Serve


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:  # the server closed the connection
            break
        data += chunk
    return data


def test_an_idle_connection_outlives_httpx_pool_expiry(tiny_model_dir, tmp_path):
    assert KEEP_ALIVE_S > httpx.Limits().keepalive_expiry
    server = Serve(tiny_model_dir, tmp_path, None)
    try:
        url = server.start()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert _get(sock).startswith(b"HTTP/1.1 200")
            time.sleep(6.5)  # past uvicorn's default keep-alive of 5 s
            second = _get(sock)
            assert second.startswith(b"HTTP/1.1 200"), second
    finally:
        server.stop()
