"""Retry delays and URL handling of the HTTP layer."""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime, timedelta

import httpx
from hypothesis import given
from hypothesis import strategies as st

from langchain_parrot._http import MAX_RETRY_AFTER_S, Endpoint, SSELines, retry_delay


def answer(retry_after: str | None) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return httpx.Response(429, headers=headers)


def test_retry_after_seconds_is_honoured() -> None:
    assert retry_delay(answer("3"), 0) == 3.0
    assert retry_delay(answer("0.25"), 5) == 0.25


def test_retry_after_http_date_is_honoured() -> None:
    when = datetime.now(UTC) + timedelta(seconds=30)
    delay = retry_delay(answer(email.utils.format_datetime(when, usegmt=True)), 0)
    assert 25 <= delay <= 30


def test_retry_after_is_capped_and_never_negative() -> None:
    assert retry_delay(answer("100000"), 0) == MAX_RETRY_AFTER_S
    assert retry_delay(answer("-5"), 0) == 0.0
    past = email.utils.format_datetime(datetime.now(UTC) - timedelta(hours=1), usegmt=True)
    assert retry_delay(answer(past), 0) == 0.0


def test_without_a_usable_retry_after_the_backoff_grows_with_jitter() -> None:
    for header in (None, "soon", "nan"):
        assert 0.25 <= retry_delay(answer(header), 0) <= 0.5
        assert 1.0 <= retry_delay(answer(header), 2) <= 2.0
    assert 4.0 <= retry_delay(None, 10) <= 8.0  # capped


def test_endpoint_url_accepts_a_root_or_a_v1_base() -> None:
    for base in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert Endpoint(base, None, None, 0).url("/v1/models") == "http://h:1/v1/models"


# U+2028, U+2029, NEL and the other separators Python's splitlines (so httpx's iter_lines)
# breaks at: the server sends them raw inside JSON strings, and SSE ends lines at CR/LF only
SEPARATORS = "\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e"


@given(st.text(alphabet="ab\r\n" + SEPARATORS, max_size=40), st.data())
def test_sse_lines_end_at_cr_lf_or_crlf_only_however_the_text_is_cut(text, data) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=5)))
    lines = SSELines()
    got: list[str] = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        got += lines.feed(text[start:end])
    got += lines.end()
    want = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if want[-1] == "":
        want.pop()  # a line ended by the stream's last CR/LF
    assert got == want


def test_a_stream_chunk_holding_a_unicode_line_separator_is_one_line() -> None:
    from langchain_parrot import ChatParrot, ParrotLLM

    from .fakes import FakeServer, chat_stream, completion_stream, stream

    text = "a\u2028b\x85c"
    server = FakeServer(stream(chat_stream("x", text)))
    chat = ChatParrot(base_url="http://parrot.test", **server.clients())
    assert "".join(c.text for c in chat.stream("hi")) == "x" + text
    server = FakeServer(stream(completion_stream(text, "y")))
    llm = ParrotLLM(base_url="http://parrot.test", **server.clients())
    assert "".join(llm.stream("hi")) == text + "y"
