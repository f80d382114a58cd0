"""The page against a real `parrot-backend serve` process (a tiny random Llama, so it is
quick on a CPU): an example runs end to end and the page ends with the API's values."""

from __future__ import annotations

import pytest
from server.serve_process import Serve

from .conftest import save_screenshot
from .pagekit import (
    api_detail,
    api_events,
    api_values,
    open_page,
    streamed_by_variable,
    wait_finished,
)


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory):
    """`serve` on loopback, auth off, as `make serve` starts it (but on the tiny model)."""
    process = Serve(tiny_model_dir, tmp_path_factory.mktemp("ui-serve"), None)
    try:
        process.start()
        yield process
    finally:
        process.stop()


def test_example_runs_end_to_end_on_a_real_serve(page, serve):
    open_page(page, serve.url)
    assert page.get_attribute("body", "data-auth") == "off"
    page.select_option("#example", "multi-agent")
    page.click("#run")
    try:
        snap = wait_finished(page, timeout_ms=180_000)
    except Exception as exc:  # say where it stood: the page's view and the server's log
        state = page.evaluate("() => parrotUI.snapshot()")
        raise AssertionError(
            f"the run did not finish on the page: {state}\n"
            f"serve log:\n{serve.log.read_text()[-3000:]}"
        ) from exc
    detail = api_detail(serve.url, snap["runId"])
    values = api_values(detail)
    assert detail["run"]["status"] == "done" and snap["status"] == "done"
    assert set(values) == {"question", "optimist_view", "skeptic_view", "engineer_view", "verdict"}
    streamed = streamed_by_variable(api_events(serve.url, snap["runId"]))
    for name, value in values.items():
        assert snap["variables"][name]["shown"] == value, name
        assert snap["variables"][name]["streamed"] == streamed.get(name, "") == value, name
    assert set(snap["dag"].values()) == {"done"}
    # the three agents read the question the host generated: one shared dynamic prefix
    marks = page.eval_on_selector_all(
        "#dag g.call[data-prefix]", "gs => gs.map(g => [g.dataset.call, g.dataset.prefix])"
    )
    assert sorted(marks) == [["engineer", "P1"], ["optimist", "P1"], ["skeptic", "P1"]]
    assert "{{input:question}}" in page.inner_text("#prefix-legend")
    save_screenshot(page, "real-serve-multi-agent")
