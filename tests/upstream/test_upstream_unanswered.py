"""A request whose connection fails before any answer (a pooled keep-alive connection the
upstream closed meanwhile: "Server disconnected without sending a response", seen on
llama-server between back-to-back generations) is sent again, up to
`RETRIES_UNANSWERED` times; after that the engine is unavailable, as before. A stream
that broke after its answer began is never sent again (its tokens were read)."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.contract.errors import EngineUnavailable
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engines.upstream import UpstreamEngine
from parrot_backend.engines.upstream.engine import RETRIES_UNANSWERED

from .fake_upstream import CharTokenizer, FakeUpstream


class DroppingUpstream(FakeUpstream):
    """Drops the next `drops` generation requests without answering."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.drops = 0
        self.dropped = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.drops and request.url.path.endswith(("/completion", "/completions")):
            self.drops -= 1
            self.dropped += 1
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response.", request=request
            )
        return await super().handle(request)


async def _connect(fake: FakeUpstream) -> UpstreamEngine:
    kw = {} if fake.kind == "llama.cpp" else {"tokenizer": CharTokenizer()}
    return await UpstreamEngine.connect(
        "http://up:1/v1", transport=fake.transport(), sync_transport=fake.sync_transport(), **kw
    )


async def _generate(engine: UpstreamEngine, cid: str) -> str:
    await engine.fill(cid, None, [ord(c) for c in "hi"])
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        return "".join([d.text async for d in engine.generate(cid, None, params)])
    finally:
        await engine.free(cid)


@pytest.mark.parametrize("kind", ["llama.cpp", "vllm"])
async def test_a_request_nobody_answered_is_sent_again(kind) -> None:
    fake = DroppingUpstream(kind)
    async with await _connect(fake) as engine:
        want = await _generate(engine, "a")
        assert want == "abcd"
        fake.drops = RETRIES_UNANSWERED
        assert await _generate(engine, "b") == want
        assert fake.dropped == RETRIES_UNANSWERED
        fake.drops = RETRIES_UNANSWERED + 1
        with pytest.raises(EngineUnavailable, match="disconnected without sending"):
            await _generate(engine, "c")
        fake.drops = 0
        assert await _generate(engine, "d") == want  # and the engine serves on


async def test_a_stream_cut_after_its_answer_began_is_not_sent_again() -> None:
    fake = DroppingUpstream("llama.cpp")
    fake.cut_after = 2  # the stream ends after 2 events, without a finish
    async with await _connect(fake) as engine:
        with pytest.raises(EngineUnavailable, match="before the end"):
            await _generate(engine, "a")
    assert len([p for p, _ in fake.requests if p.endswith("/completion")]) == 1
