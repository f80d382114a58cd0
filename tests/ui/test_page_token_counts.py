"""The page's token count of a variable, once its call finished, is that output's
completion tokens (`call_finished`'s `output_tokens`), not the number of its token
events: a token with no text (here the scripted engine's EOS, as a real engine's) has no
event but was generated."""

from __future__ import annotations

import pytest

from .pagekit import api_events, open_page, start_run, wait_finished
from .support import live_app, reply_for

# `a` ends with the EOS (the reply is short); `b` stops at its max_tokens, its last token
# carrying text
RUN = {
    "program": {
        "calls": [
            {
                "name": "two",
                "template": "Say {{input:q}}: {{output:a}} then {{output:b}}",
                "outputs": {"a": {"max_tokens": 50}, "b": {"max_tokens": 5}},
            }
        ]
    },
    "inputs": {"q": "hi"},
}


@pytest.fixture(scope="module")
def app():
    """One live server for the module (auth off, loopback)."""
    with live_app() as app:
        app.engine.reply = reply_for()
        yield app


def test_each_variable_shows_its_outputs_completion_tokens(page, app):
    open_page(page, app.url)
    run_id = start_run(page, RUN)
    snap = wait_finished(page)
    events = api_events(app.url, run_id)
    [finished] = [e["data"] for e in events if e["event"] == "call_finished"]
    token_events = {
        name: sum(e["event"] == "token" and e["data"]["variable"] == name for e in events)
        for name in ("a", "b")
    }
    assert finished["output_tokens"] == {"a": token_events["a"] + 1, "b": token_events["b"]}
    for name in ("a", "b"):
        count = page.text_content(f"#variables article[data-variable={name}] .count")
        assert count == f"{finished['output_tokens'][name]} tokens", name
        assert snap["variables"][name]["tokens"] == finished["output_tokens"][name], name
    assert page.console_errors == []
