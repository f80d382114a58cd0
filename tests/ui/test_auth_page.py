"""The page and its events grants with auth on: the page asks for a key and rejects a
wrong one; EventSource reads a run's events with a short-lived, signed, per-run cookie
that nothing else accepts; tenants stay apart; the key never appears in a URL."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from parrot_backend.server.auth import (
    GRANT_COOKIE,
    GRANT_TTL_S,
    events_grant_tenant,
    grant_key,
    mint_events_grant,
)

from .conftest import save_screenshot
from .pagekit import (
    api_detail,
    api_events,
    api_values,
    chat_call,
    open_page,
    start_run,
    streamed_by_variable,
    wait_finished,
)
from .support import CutProxy, live_app, reply_for

KEYS = {"sk-ui-alice": "alice", "sk-ui-bob": "bob"}
ALICE = {"Authorization": "Bearer sk-ui-alice"}
BOB = {"Authorization": "Bearer sk-ui-bob"}
RUN = {
    "program": {
        "calls": [
            {
                "name": "say",
                "template": "Say {{input:w}}: {{output:out}}",
                "outputs": {"out": {"max_tokens": 12}},
            }
        ]
    },
    "inputs": {"w": "hi"},
    "outputs": {"out": "latency"},
}


@pytest.fixture(scope="module")
def app():
    """One live server with two tenants' keys for the module."""
    with live_app(api_keys=KEYS) as app:
        yield app


def _run(app, headers=ALICE) -> str:
    r = httpx.post(f"{app.url}/v1/runs", json=RUN, headers=headers, timeout=30)
    assert r.status_code == 201, r.text
    run_id = r.json()["run_id"]
    v = httpx.get(
        f"{app.url}/v1/runs/{run_id}/variables/out?timeout=30", headers=headers, timeout=40
    )
    assert v.json()["status"] == "ready"
    return run_id


def _grant(app, run_id: str, headers=ALICE) -> httpx.Response:
    return httpx.post(f"{app.url}/v1/runs/{run_id}/events/grant", headers=headers, timeout=30)


def _events(app, run_id: str, token: str) -> httpx.Response:
    """The events route with the grant as the only credential (as EventSource sends it)."""
    return httpx.get(
        f"{app.url}/v1/runs/{run_id}/events",
        headers={"Cookie": f"{GRANT_COOKIE}={token}".encode()},
        timeout=30,
    )


def test_page_asks_for_a_key_rejects_a_wrong_one_and_streams_with_the_right_one(page, app):
    urls: list[str] = []
    page.on("request", lambda req: urls.append(req.url))
    events_auth: list[str | None] = []
    page.on(
        "request",
        lambda req: (
            events_auth.append(req.headers.get("authorization"))
            if req.url.split("?")[0].endswith("/events")
            else None
        ),
    )
    open_page(page, app.url)
    assert page.get_attribute("body", "data-auth") == "needed"
    assert page.is_visible("#api-key")
    page.fill("#api-key", "sk-ui-wrong")
    page.click("#auth button[type=submit]")
    page.wait_for_selector("body[data-auth=rejected]")
    assert "invalid API key" in page.inner_text("#auth-error")
    assert page.eval_on_selector_all(".history-item", "bs => bs.length") == 0
    save_screenshot(page, "auth-wrong-key")
    bobs = _run(app, BOB)  # bob's run: alice's page never lists it
    page.fill("#api-key", "sk-ui-alice")
    page.click("#auth button[type=submit]")
    page.wait_for_selector("body[data-auth=accepted]")
    page.select_option("#example", "chain")
    page.click("#run")
    snap = wait_finished(page)
    run_id = snap["runId"]
    values = api_values(api_detail(app.url, run_id, ALICE))
    assert {n: snap["variables"][n]["streamed"] for n in values} == values
    tokens = [e for e in api_events(app.url, run_id, ALICE) if e["event"] == "token"]
    assert snap["stream"]["tokens"] == len(tokens) > 0
    listed = page.eval_on_selector_all(".history-item", "bs => bs.map(b => b.dataset.runId)")
    assert run_id in listed and bobs not in listed
    # the grant: HttpOnly (no script sees it), SameSite=Strict, only on this run's events
    cookies = [c for c in page.context.cookies() if c["name"] == GRANT_COOKIE]
    assert [c["path"] for c in cookies] == [f"/v1/runs/{run_id}/events"]
    assert cookies[0]["httpOnly"] and cookies[0]["sameSite"] == "Strict"
    assert GRANT_COOKIE not in page.evaluate("() => document.cookie")
    assert events_auth and set(events_auth) == {None}  # EventSource sends no header...
    assert not [u for u in urls if "sk-ui" in u]  # ...and the key is in no URL
    # bob's run, asked for by alice's page: the same answer as a run that does not exist
    page.evaluate(f"() => parrotUI.openRun('{bobs}')")
    page.wait_for_selector("#stream-state[data-state=error]")
    assert f"no run '{bobs}'" in page.inner_text("#run-error")
    page.click("#forget-key")
    page.wait_for_selector("body[data-auth=needed]")
    assert page.evaluate("() => sessionStorage.length") == 0


def test_stream_with_auth_resumes_after_offline_with_a_fresh_grant(page, app):
    """The connection drops (proxy) while the browser is offline (Playwright): the
    grant and reconnect requests fail until it is back online; then the page gets a new
    grant and resumes after its last event. Nothing is lost or repeated."""
    app.engine.delay_s = 0.01
    app.engine.reply = reply_for(length=300)
    proxy = CutProxy(app.port)
    grants: list[int] = []
    page.on(
        "response", lambda r: grants.append(r.status) if r.url.endswith("/events/grant") else None
    )
    try:
        open_page(page, proxy.url)
        page.fill("#api-key", "sk-ui-alice")
        page.click("#auth button[type=submit]")
        page.wait_for_selector("body[data-auth=accepted]")
        spec = {
            "program": {
                "calls": [
                    chat_call("one", "About {{input:w}}.", "a", 100),
                    chat_call("two", "After {{input:a}}.", "b", 100),
                ]
            },
            "inputs": {"w": "birds"},
            "outputs": {"b": "latency"},
        }
        run_id = start_run(page, spec)
        page.wait_for_function("() => parrotUI.stream.stats.tokens >= 30")
        page.context.set_offline(True)
        proxy.cut()
        page.wait_for_selector("#stream-state[data-state=reconnecting]")
        at_cut = page.evaluate("() => parrotUI.stream.stats.tokens")
        time.sleep(1.0)
        assert page.evaluate("() => parrotUI.stream.stats.tokens") == at_cut
        page.context.set_offline(False)
        snap = wait_finished(page)
    finally:
        app.engine.delay_s = 0.0
        app.engine.reply = reply_for()
        proxy.close()
    events = api_events(app.url, run_id, ALICE)
    stats = snap["stream"]
    assert stats["duplicates"] == stats["missing"] == 0 and stats["reconnects"] >= 1
    assert stats["tokens"] == sum(e["event"] == "token" for e in events) == 200
    assert stats["events"] == len(events)
    assert len(grants) >= 2 and set(grants) == {204}  # one per connection
    streamed = streamed_by_variable(events)
    values = api_values(api_detail(app.url, run_id, ALICE))
    for name in ("a", "b"):
        assert snap["variables"][name]["streamed"] == streamed[name] == values[name]


def test_grant_needs_a_valid_key_and_is_a_scoped_short_lived_cookie(app):
    run_id = _run(app)
    assert _grant(app, run_id, {}).status_code == 401
    assert _grant(app, run_id, {"Authorization": "Bearer sk-ui-wrong"}).status_code == 401
    assert _grant(app, run_id, BOB).status_code == 404  # another tenant's run
    r = _grant(app, run_id)
    assert r.status_code == 204
    header = r.headers["set-cookie"]
    parts = {p.strip().split("=")[0].lower(): p.strip() for p in header.split(";")}
    assert parts["path"] == f"Path=/v1/runs/{run_id}/events"
    assert parts["max-age"] == f"Max-Age={GRANT_TTL_S}"
    assert "httponly" in parts and parts["samesite"].lower() == "samesite=strict"
    assert "secure" not in parts  # plain http on loopback; set under https
    token = r.cookies[GRANT_COOKIE]
    assert "sk-ui" not in token and "alice" not in token  # the tenant is encoded, signed
    events = _events(app, run_id, token)
    assert events.status_code == 200 and "event: run_finished" in events.text


def test_grant_opens_only_the_events_route_of_its_run(app):
    run_id, other_id = _run(app), _run(app)
    token = _grant(app, run_id).cookies[GRANT_COOKIE]
    cookie = {"Cookie": f"{GRANT_COOKIE}={token}"}
    assert _events(app, other_id, token).status_code == 401  # alice's other run: no
    for method, path in (
        ("GET", f"/v1/runs/{run_id}"),
        ("GET", "/v1/runs"),
        ("POST", f"/v1/runs/{run_id}/replay"),
        ("POST", f"/v1/runs/{run_id}/cancel"),
        ("POST", f"/v1/runs/{run_id}/events/grant"),
        ("GET", f"/v1/runs/{run_id}/variables/out"),
    ):
        r = httpx.request(method, app.url + path, headers=cookie, timeout=30)
        assert r.status_code == 401, (method, path)
    # not with a method other than GET either
    r = httpx.post(f"{app.url}/v1/runs/{run_id}/events", headers=cookie, timeout=30)
    assert r.status_code == 401


def test_forged_altered_expired_and_foreign_grants_are_rejected(app):
    run_id = _run(app)
    key = app.app.state.parrot.authenticator.grant_key
    good = mint_events_grant(key, "alice", run_id)
    assert _events(app, run_id, good).status_code == 200
    forged = mint_events_grant(grant_key(b"another server's secret"), "alice", run_id)
    expired = mint_events_grant(key, "alice", run_id, now=time.time() - GRANT_TTL_S - 1)
    body, sig = good.split(".")
    altered = mint_events_grant(key, "bob", run_id).split(".")[0] + "." + sig
    for token in (forged, expired, altered, body, good + "x", "", "a.b", "....", "ünï.cødé"):
        r = _events(app, run_id, token)
        assert r.status_code == 401, token
        assert r.json()["error"]["type"] == "authentication_error"
    # a valid grant of another tenant for alice's run: tenant scoping still holds (404)
    bobs = mint_events_grant(key, "bob", run_id)
    assert _events(app, run_id, bobs).status_code == 404


def test_grant_tokens_verify_only_unaltered_unexpired_and_for_their_run():
    key = grant_key(b"secret")
    run, other = "a" * 32, "b" * 32
    token = mint_events_grant(key, "alice", run, ttl_s=60, now=1000.0)
    assert events_grant_tenant(key, token, run, now=1059.0) == "alice"
    assert events_grant_tenant(key, token, run, now=1060.0) is None  # expired
    assert events_grant_tenant(key, token, other, now=1000.0) is None
    assert events_grant_tenant(grant_key(b"other"), token, run, now=1000.0) is None
    body, sig = token.split(".")
    for bad in (
        None,
        "",
        "x",
        "a.b.c",
        "%%%.%%%",
        token.upper(),
        "." + sig,
        f"{body}.é",
        f"é.{sig}",
        f"{body}.\udcff",
        "x" * 3000 + "." + sig,
    ):
        assert events_grant_tenant(key, bad, run, now=1000.0) is None


def test_page_and_its_files_are_open_everything_else_stays_closed(app):
    for path in ("/ui", "/ui/static/app.js", "/ui/static/style.css"):
        assert httpx.get(app.url + path, timeout=10).status_code == 200, path
    root = httpx.get(app.url + "/", timeout=10)
    assert root.status_code == 307 and root.headers["location"] == "/ui"
    page = httpx.get(app.url + "/ui", timeout=10)
    assert "script-src 'self'" in page.headers["content-security-policy"]
    slash = httpx.get(app.url + "/ui/", timeout=10)
    assert slash.status_code == 307 and slash.headers["location"].endswith("/ui")
    for path in (
        "/uix",
        "/ui/other",
        "/ui/static",
        "/v1/runs",
        "/metrics",
        "/ui/static/../../v1/runs",
        "/ui/static/%2e%2e/%2e%2e/v1/runs",
    ):
        r = httpx.get(app.url + path, timeout=10)
        assert r.status_code in (401, 404), (path, r.status_code)
    # a path that climbs out of the static folder, sent as it is (clients normalize it)
    with socket.create_connection(("127.0.0.1", app.port), timeout=10) as s:
        s.sendall(b"GET /ui/static/../../v1/runs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 404"), answer[:200]
