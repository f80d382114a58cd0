"""Retry delays and URL handling of the HTTP layer."""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime, timedelta

import httpx

from langchain_parrot._http import MAX_RETRY_AFTER_S, Endpoint, retry_delay


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
