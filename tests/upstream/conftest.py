"""Fixtures for upstream-engine tests: a real llama.cpp `llama-server` on SmolLM2's GGUF.

The binary is built once into the cache (`make llama-server` prebuilds it); these fixtures
find it there, or build it when missing. They skip only when this machine cannot build it
(no cmake or compiler, no sdist); a build that starts and fails is an error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parrot_backend.testing.llama_server import (
    LlamaServer,
    LlamaServerUnavailable,
    cached_binary,
    llama_server_binary,
    smollm2_gguf,
)

# The first test's setup may compile llama.cpp (minutes on 2 shared cores); the suite's
# 300 s per-test timeout would cut that build. Only then are these tests given longer.
BUILD_TIMEOUT_S = 3600

# Slots and context of the shared server: 4 slots of 2,048 tokens each (llama-server splits
# --ctx-size between slots unless the KV cache is unified).
PARALLEL = 4
CTX_SIZE = 4 * 2048

# One compute thread: llama.cpp's threads spin at every barrier, so two threads on two cores
# that other work also wants decode ~20x slower (measured: 2 tok/s vs 40 with one thread
# while a benchmark ran beside it); one thread is steady on a busy or quiet machine.
THREADS = 1


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.fspath)).parents]
    if mine and cached_binary() is None:
        for item in mine:
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))


@pytest.fixture(scope="session")
def llama_server_bin(request) -> Path:
    """The cached llama-server, built first when missing (progress shown live)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    try:
        if capture is not None:
            with capture.global_and_fixture_disabled():
                return llama_server_binary()
        return llama_server_binary()
    except LlamaServerUnavailable as exc:
        pytest.skip(f"llama-server cannot be built on this machine: {exc}")


@pytest.fixture(scope="session")
def llama_server(llama_server_bin, tmp_path_factory):
    """One llama-server for the session: SmolLM2 Q4_1, 4 slots, /metrics and /slots on."""
    log = tmp_path_factory.mktemp("llama-server") / "llama-server.log"
    server = LlamaServer(
        llama_server_bin,
        smollm2_gguf(),
        ctx_size=CTX_SIZE,
        parallel=PARALLEL,
        threads=THREADS,
        log_path=log,
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """Our tokenizer: transformers' of the converted SmolLM2 (the engine's own)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))
