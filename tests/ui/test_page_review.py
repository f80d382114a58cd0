"""The /ui page on what a user can throw at it: untrusted text, links to runs that do not
exist or are no run id, runs that are cancelled, templates that start with a placeholder,
calls named like JavaScript's object properties, a link opened before the key is given."""

from __future__ import annotations

import time

import httpx
import pytest

from .pagekit import api_detail, chat_call, open_page, start_run, wait_finished
from .support import live_app, reply_for

ALICE = {"Authorization": "Bearer sk-rev-alice"}


@pytest.fixture(scope="module")
def app():
    """One live server for the module (auth off, loopback)."""
    with live_app() as app:
        yield app


@pytest.fixture(autouse=True)
def _engine_defaults(app):
    app.engine.delay_s = 0.0
    app.engine.reply = reply_for()
    app.engine.fail_if = lambda prompt: False


def _pwn(n: int) -> str:
    """Markup that sets window.__pwn when a page renders it as HTML."""
    return (
        f'<img src=x onerror="window.__pwn={n}"></script><script>window.__pwn={n}</script>'
        f'<svg onload="window.__pwn={n}"><b id=pwn{n}>bold</b>'
    )


def _run_api(app, spec: dict, headers: dict | None = None) -> str:
    r = httpx.post(f"{app.url}/v1/runs", json=spec, headers=headers or {}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["run_id"]


def _DETAIL(url: str) -> bool:
    """A run's detail, GET /v1/runs/{id} (not its events, not the list)."""
    return "/v1/runs/" in url and url.rstrip("/").split("/")[-2] == "runs"


def _no_markup(page) -> None:
    assert page.evaluate("() => window.__pwn") is None
    injected = "#run-panel img, #run-panel script, #run-panel b, #run-panel svg svg"
    assert page.eval_on_selector_all(injected, "es => es.length") == 0


def test_markup_in_prompts_inputs_outputs_and_errors_is_shown_as_text(page, app):
    app.engine.reply = lambda prompt: "out " + _pwn(3)
    app.engine.fail_if = lambda prompt: prompt.startswith("Then")  # call b fails
    spec = {
        "program": {
            "calls": [
                {
                    "name": "a",
                    "template": "Echo " + _pwn(1) + " {{input:v}} {{output:out}}",
                    "outputs": {"out": {"max_tokens": 200}},
                },
                {
                    "name": "b",
                    "template": "Then {{input:out}}: {{output:fails}}",
                    "outputs": {"fails": {"max_tokens": 5}},
                },
            ]
        },
        "inputs": {"v": _pwn(2)},
    }
    open_page(page, app.url)
    start_run(page, spec)
    snap = wait_finished(page)
    assert snap["status"] == "failed" and snap["dag"] == {"a": "done", "b": "failed"}
    assert snap["variables"]["fails"]["status"] == "failed"
    assert snap["variables"]["v"]["shown"] == _pwn(2)
    assert snap["variables"]["out"]["shown"] == "out " + _pwn(3)
    _no_markup(page)
    # a server error that quotes what was sent is text too
    bad = {"program": {"calls": [{"name": "a", "template": "{{input:" + _pwn(4) + "}}"}]}}
    page.fill("#program-text", str(bad).replace("'", '"'))
    page.wait_for_timeout(400)
    page.click("#run")
    page.wait_for_function("() => document.querySelector('#program-error').textContent")
    _no_markup(page)
    page.console_errors[:] = [e for e in page.console_errors if "400" not in e]
    assert page.console_errors == []


def test_a_link_to_a_missing_run_says_so_and_stops(page, app):
    missing = "0" * 32
    events: list[str] = []
    page.on("request", lambda r: events.append(r.url) if "/events" in r.url else None)
    open_page(page, app.url, f"/ui#run={missing}")
    page.wait_for_selector("#stream-state[data-state=error]", timeout=10_000)
    assert f"no run '{missing}'" in page.inner_text("#run-error")
    assert page.get_attribute("#run-status", "data-status") == ""
    assert page.is_disabled("#replay") and page.is_disabled("#cancel")
    tries = len(events)
    time.sleep(2.0)  # no reconnect loop behind the message
    assert len(events) == tries <= 2
    assert page.get_attribute("#stream-state", "data-state") == "error"


def test_a_link_that_is_no_run_id_says_so(page, app):
    open_page(page, app.url, "/ui#run=<b>nope</b>")
    page.wait_for_function("() => document.querySelector('#run-error').textContent")
    assert "not a run id" in page.inner_text("#run-error")
    assert page.inner_text("#run-id") == "–"
    assert page.eval_on_selector_all("#run-panel b", "es => es.length") == 0


def test_changing_the_address_hash_opens_that_run(page, app):
    first = _run_api(
        app,
        {"program": {"calls": [chat_call("a", "One {{input:w}}", "x", 5)]}, "inputs": {"w": "w1"}},
    )
    second = _run_api(
        app,
        {"program": {"calls": [chat_call("b", "Two {{input:w}}", "y", 5)]}, "inputs": {"w": "w2"}},
    )
    open_page(page, app.url, f"/ui#run={first}")
    page.wait_for_selector("#dag g[data-call=a]")
    page.evaluate(f"() => {{ location.hash = '#run={second}'; }}")
    page.wait_for_function(f"() => parrotUI.view.runId === '{second}'", timeout=10_000)
    page.wait_for_selector("#dag g[data-call=b]")
    page.go_back()  # back to the first run's address
    page.wait_for_function(f"() => parrotUI.view.runId === '{first}'", timeout=10_000)
    snap = wait_finished(page)
    assert snap["dag"] == {"a": "done"}


def test_a_cancelled_runs_unfinished_variables_say_cancelled(page, app):
    app.engine.delay_s = 0.02
    app.engine.reply = reply_for(length=400)
    spec = {
        "program": {
            "calls": [
                chat_call("one", "About {{input:w}}.", "a", 400),
                chat_call("two", "After {{input:a}}.", "b", 400),
            ]
        },
        "inputs": {"w": "birds"},
    }
    open_page(page, app.url)
    run_id = start_run(page, spec)
    page.wait_for_function("() => parrotUI.stream.stats.tokens >= 10")
    page.route(_DETAIL, lambda route: route.fulfill(status=503, body="{}"))  # stream alone
    page.click("#cancel")
    page.wait_for_function("() => parrotUI.stream.closed")
    snap = page.evaluate("() => parrotUI.snapshot()")
    detail = api_detail(app.url, run_id)
    assert detail["run"]["status"] == snap["status"] == "cancelled"
    a = snap["variables"]["a"]
    assert a["status"] == "cancelled" and a["shown"] == a["streamed"] != ""
    assert snap["variables"]["b"]["status"] == "cancelled"
    badges = page.eval_on_selector_all(
        "#variables .variable", "vs => vs.map(v => [v.dataset.variable, v.dataset.status])"
    )
    assert dict(badges) == {"w": "ready", "a": "cancelled", "b": "cancelled"}
    assert "streaming" not in page.inner_text("#variables")
    assert snap["dag"] == {"one": "cancelled", "two": "cancelled"}
    page.console_errors[:] = [e for e in page.console_errors if "503" not in e]


def test_templates_may_start_with_a_placeholder(page, app):
    open_page(page, app.url)
    page.select_option("#example", "")
    page.fill(
        "#program-text",
        "{{input:q}} is asked. Answer: {{output:a}}\n---\n[{{input:a}}] {{output:b}}",
    )
    page.wait_for_function("() => document.querySelectorAll('#inputs textarea').length === 1")
    assert page.inner_text("#program-error") == ""
    page.fill("#inputs textarea[name=q]", "why")
    page.click("#run")
    snap = wait_finished(page)
    assert snap["status"] == "done" and snap["variables"]["b"]["status"] == "ready"
    # text that is neither JSON nor a template still says why
    page.fill("#program-text", "{not json")
    page.wait_for_function("() => document.querySelector('#program-error').textContent")
    assert "not valid JSON" in page.inner_text("#program-error")


def test_calls_named_like_object_properties_get_no_prefix_mark(page, app):
    spec = {
        "program": {
            "calls": [
                {
                    "name": "constructor",
                    "template": "A {{input:q}} {{output:x}}",
                    "outputs": {"x": {"max_tokens": 3}},
                },
                {
                    "name": "toString",
                    "template": "B {{output:y}}",
                    "outputs": {"y": {"max_tokens": 3}},
                },
                {
                    "name": "__proto__",
                    "template": "C {{input:x}} {{output:z}}",
                    "outputs": {"z": {"max_tokens": 3}},
                },
            ]
        },
        "inputs": {"q": "hi"},
    }
    open_page(page, app.url)
    start_run(page, spec)
    snap = wait_finished(page)
    assert snap["status"] == "done" and snap["variables"]["z"]["status"] == "ready"
    marks = page.eval_on_selector_all(
        "#dag g.call",
        "gs => gs.map(g => [g.dataset.call, g.dataset.state, g.dataset.prefix || null])",
    )
    assert sorted(marks) == [
        ["__proto__", "done", None],
        ["constructor", "done", None],
        ["toString", "done", None],
    ]
    assert page.eval_on_selector_all("#dag .prefix-tag", "ts => ts.length") == 0


@pytest.fixture(scope="module")
def auth_app():
    with live_app(api_keys={"sk-rev-alice": "alice"}) as app:
        yield app


def test_a_run_link_opened_before_the_key_opens_once_the_key_is_given(page, auth_app):
    spec = {"program": {"calls": [chat_call("a", "Hi {{input:w}}", "x", 5)]}, "inputs": {"w": "k"}}
    run_id = _run_api(auth_app, spec, ALICE)
    open_page(page, auth_app.url, f"/ui#run={run_id}")
    assert page.get_attribute("body", "data-auth") == "needed"
    page.fill("#api-key", "sk-rev-alice")
    page.click("#auth button[type=submit]")
    page.wait_for_selector("body[data-auth=accepted]")
    page.wait_for_function(f"() => parrotUI.view.runId === '{run_id}'", timeout=10_000)
    snap = wait_finished(page)
    assert snap["variables"]["x"]["status"] == "ready"
    # forgetting the key leaves nothing of the tenant's run on screen
    page.click("#forget-key")
    page.wait_for_selector("body[data-auth=needed]")
    assert page.inner_text("#run-id") == "–"
    assert page.eval_on_selector_all("#variables .variable, #dag g", "es => es.length") == 0
    assert page.evaluate("() => parrotUI.snapshot().runId") is None


def test_a_failed_call_shows_as_failed_from_the_stream_alone(page, app):
    """The run's detail never answers (503): the stream's call_failed events are enough
    to show the failed call's outputs, and those of the calls after it, as failed."""
    app.engine.fail_if = lambda prompt: prompt.startswith("Then")
    spec = {
        "program": {
            "calls": [
                {
                    "name": "a",
                    "template": "Echo {{input:v}} {{output:x}}",
                    "outputs": {"x": {"max_tokens": 20}},
                },
                {
                    "name": "b",
                    "template": "Then {{input:x}}: {{output:y}}",
                    "outputs": {"y": {"max_tokens": 20}},
                },
                {
                    "name": "c",
                    "template": "Last {{input:y}}: {{output:z}}",
                    "outputs": {"z": {"max_tokens": 20}},
                },
            ]
        },
        "inputs": {"v": "go"},
    }
    page.route(
        _DETAIL,
        lambda route: (
            route.fulfill(status=503, body="{}")
            if route.request.method == "GET"
            else route.continue_()
        ),
    )
    open_page(page, app.url)
    start_run(page, spec)
    page.wait_for_function("() => parrotUI.stream && parrotUI.stream.closed")
    snap = page.evaluate("() => parrotUI.snapshot()")
    assert snap["status"] == "failed"
    assert snap["dag"] == {"a": "done", "b": "failed", "c": "failed"}
    assert snap["variables"]["x"]["status"] == "ready"
    y, z = snap["variables"]["y"], snap["variables"]["z"]
    assert y["status"] == z["status"] == "failed"
    # the stream's variable_failed names the call; a page from before it came shows the
    # call's own error: either way the engine's reason is on the card
    assert y["shown"].startswith("failed: ") and "EngineError: scripted failure" in y["shown"]
    assert "input 'y' failed" in z["shown"]
    page.console_errors[:] = [e for e in page.console_errors if "503" not in e]


def test_a_finished_run_opened_again_never_shows_as_running(page, app):
    """The run's detail (done) lands before its log's first event (run_created): the
    badge stays done and Cancel stays off while the log streams again."""
    app.engine.reply = reply_for(length=300)
    spec = {
        "program": {"calls": [chat_call("a", "Hi {{input:w}}", "x", 300)]},
        "inputs": {"w": "k"},
    }
    run_id = _run_api(app, spec)
    r = httpx.get(f"{app.url}/v1/runs/{run_id}/variables/x?timeout=30", timeout=40)
    assert r.json()["status"] == "ready"

    def late_events(route):
        time.sleep(1.0)  # the detail's answer reaches the page meanwhile
        route.continue_()

    page.route("**/events*", late_events)
    open_page(page, app.url)
    page.evaluate(
        """() => {
          window.__badges = [];
          const badge = document.querySelector('#run-status');
          new MutationObserver(() => window.__badges.push(
            [badge.dataset.status, document.querySelector('#cancel').disabled]
          )).observe(badge, {attributes: true, childList: true});
        }"""
    )
    page.evaluate(f"() => parrotUI.openRun('{run_id}')")
    snap = wait_finished(page)
    assert snap["variables"]["x"]["tokens"] > 0
    seen = page.evaluate("() => window.__badges")
    first_done = next(i for i, (status, _) in enumerate(seen) if status == "done")
    assert all(status == "done" and cancel_off for status, cancel_off in seen[first_done:]), seen


def test_page_files_are_revalidated_and_the_page_answers_head(app):
    """The page's modules are never taken from a heuristic cache (one version of the page
    and its modules after an upgrade), are not sniffed, and answer 304 when unchanged."""
    for name in ("app.js", "view.js", "style.css"):
        r = httpx.get(f"{app.url}/ui/static/{name}", timeout=10)
        assert r.status_code == 200
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-content-type-options"] == "nosniff"
        again = httpx.get(
            f"{app.url}/ui/static/{name}", headers={"If-None-Match": r.headers["etag"]}
        )
        assert again.status_code == 304 and again.headers["cache-control"] == "no-cache"
    head = httpx.head(f"{app.url}/ui", timeout=10)
    assert (
        head.status_code == 200 and "script-src 'self'" in head.headers["content-security-policy"]
    )


def test_a_detail_answered_after_the_streams_end_does_not_make_the_run_running(page, app):
    """Every detail answers 1.5 s late: one read while the run ran lands after the
    stream's run_finished. The badge stays done (Cancel off) from the end on."""

    def late_detail(route):
        answer = route.fetch()  # the run's state now, shown 1.5 s later
        time.sleep(1.5)
        route.fulfill(response=answer)

    page.route(_DETAIL, late_detail)
    open_page(page, app.url)
    page.evaluate(
        """() => {
          window.__badges = [];
          const badge = document.querySelector('#run-status');
          new MutationObserver(() => window.__badges.push(
            [badge.dataset.status, document.querySelector('#cancel').disabled]
          )).observe(badge, {attributes: true, childList: true});
        }"""
    )
    app.engine.delay_s = 0.01
    app.engine.reply = reply_for(length=200)  # 400 tokens: 4 s or more
    spec = {
        "program": {
            "calls": [
                chat_call("one", "About {{input:w}}.", "a", 200),
                chat_call("two", "After {{input:a}}.", "b", 200),
            ]
        },
        "inputs": {"w": "birds"},
    }
    start_run(page, spec)
    snap = wait_finished(page)
    time.sleep(3.5)  # the late details land
    assert snap["status"] == "done"
    assert page.evaluate("() => parrotUI.view.status") == "done"
    seen = page.evaluate("() => window.__badges")
    first_done = next(i for i, (status, _) in enumerate(seen) if status == "done")
    assert all(status == "done" and cancel_off for status, cancel_off in seen[first_done:]), seen


def test_names_of_200_characters_stay_inside_their_boxes(page, app):
    """Call, input and output names may be 200 characters long: the DAG cuts them to its
    boxes (the full name in a title), the cards wrap them; the page never gets wider."""
    call, out, inp = "call_" + "W" * 195, "out_" + "m" * 196, "in_" + "q" * 197
    app.engine.reply = lambda prompt: "z" * 500
    spec = {
        "program": {
            "calls": [
                {
                    "name": call,
                    "template": "A {{input:" + inp + "}} {{output:" + out + "}}",
                    "outputs": {out: {"max_tokens": 500}},
                },
                {
                    "name": "b",
                    "template": "B {{input:" + out + "}} {{output:w}}",
                    "outputs": {"w": {"max_tokens": 20}},
                },
            ]
        },
        "inputs": {inp: "hi"},
    }
    open_page(page, app.url)
    start_run(page, spec)
    wait_finished(page)
    width = page.evaluate("() => [document.documentElement.scrollWidth, innerWidth]")
    assert width[0] <= width[1], width
    fits = page.evaluate(
        """() => [...document.querySelectorAll('#dag text.call-name, #dag text.input-name')]
          .map(t => [t.textContent, t.getComputedTextLength()])"""
    )
    assert all(px <= 190 - 20 for _, px in fits), fits
    assert any(text.startswith("call_WWW") and text.endswith("…") for text, _ in fits)
    labels = page.eval_on_selector_all(
        "#dag text.edge-label", "ts => ts.map(t => t.getComputedTextLength())"
    )
    assert labels and max(labels) <= 64, labels
    titles = page.eval_on_selector_all("#dag title", "ts => ts.map(t => t.textContent)")
    assert call in titles and f"input {inp}" in titles
    cards = page.eval_on_selector_all(
        "#variables .variable", "vs => vs.map(v => v.scrollWidth <= v.clientWidth)"
    )
    assert cards == [True, True, True], cards
