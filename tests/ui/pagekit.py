"""What the browser tests do on the page and ask the API (one place, so tests read as
steps)."""

from __future__ import annotations

import json

import httpx

DONE = (
    "() => parrotUI.stream && parrotUI.stream.closed && "
    "['done', 'failed', 'cancelled'].includes("
    "document.querySelector('#run-status').dataset.status)"
)


def open_page(page, url: str, path: str = "/ui") -> None:
    """Load the page and wait until it knows whether auth is on."""
    page.goto(url + path)
    page.wait_for_selector("body[data-ready=true][data-auth]")


def start_run(page, spec: dict) -> str:
    """Paste `spec` (a run as JSON) into the program box, run it; returns the run id."""
    page.select_option("#example", "")
    page.fill("#program-text", json.dumps(spec))
    page.click("#run")
    page.wait_for_function(
        "() => /^[0-9a-f]{32}$/.test(document.querySelector('#run-id').textContent)"
    )
    return page.inner_text("#run-id")


def wait_finished(page, timeout_ms: int = 60_000) -> dict:
    """Wait until the page's stream ended with the run; returns the page's snapshot.
    Fails at once when the run could not be created (the page shows the server's error)."""
    page.wait_for_function(
        f"() => ({DONE})() || document.querySelector('#program-error').textContent !== ''",
        timeout=timeout_ms,
    )
    error = page.text_content("#program-error")
    assert not error, f"the page could not start the run: {error}"
    # the final detail (timeline, statuses) is fetched right after run_finished
    page.wait_for_function("() => document.querySelectorAll('#timeline .tl-row').length > 0")
    return page.evaluate("() => parrotUI.snapshot()")


def api_detail(url: str, run_id: str, headers: dict | None = None) -> dict:
    """The run's detail from the API."""
    r = httpx.get(f"{url}/v1/runs/{run_id}", headers=headers or {}, timeout=30)
    r.raise_for_status()
    return r.json()


def api_events(url: str, run_id: str, headers: dict | None = None) -> list[dict]:
    """The run's whole event log, read over SSE without a browser."""
    with httpx.stream(
        "GET", f"{url}/v1/runs/{run_id}/events", headers=headers or {}, timeout=60
    ) as r:
        r.raise_for_status()
        return sse_events(r.read().decode())


def sse_events(raw: str) -> list[dict]:
    """`id:`/`event:`/`data:` blocks of an SSE body (comments and pings skipped)."""
    out = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        fields = {}
        for line in block.split("\n"):
            if line and not line.startswith(":"):
                key, _, value = line.partition(":")
                fields[key] = value.removeprefix(" ")
        if "data" in fields:
            out.append(
                {
                    "id": int(fields["id"]),
                    "event": fields["event"],
                    "data": json.loads(fields["data"]),
                }
            )
    return out


def api_values(detail: dict) -> dict[str, str]:
    """Generated variables and their values, from a run's detail."""
    return {
        name: v["value"]
        for name, v in detail["variables"].items()
        if v["producer_call"] is not None
    }


def streamed_by_variable(events: list[dict]) -> dict[str, str]:
    """Each variable's token texts, concatenated in stream order."""
    out: dict[str, str] = {}
    for e in events:
        if e["event"] == "token":
            name = e["data"]["variable"]
            out[name] = out.get(name, "") + e["data"]["text"]
    return out


def chat_call(name: str, user: str, output: str, max_tokens: int) -> dict:
    """A chat call of a test program."""
    return {
        "name": name,
        "messages": [
            {"role": "system", "content": "You are a test."},
            {"role": "user", "content": user},
            {"role": "assistant", "content": f"{{{{output:{output}}}}}"},
        ],
        "outputs": {output: {"max_tokens": max_tokens}},
    }
