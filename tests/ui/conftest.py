"""Fixtures of the browser tests: Debian's Chromium driven by Playwright for Python.

Playwright's own browser download (`playwright install`) is never used: the tests launch
the system's `/usr/bin/chromium` (Debian's package), installing it with apt when it is
missing. A test is skipped, saying why, only when it cannot be installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# What the environment needs: no sandbox as root, no GPU, and no background traffic to
# hosts this closed network refuses.
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
ARTIFACTS = Path(
    os.environ.get(
        "PARROT_UI_ARTIFACTS", Path(__file__).resolve().parents[2] / "build" / "ui-artifacts"
    )
)


def _install_chromium() -> str | None:
    """Install Debian's chromium with apt; None when done, else why it could not be."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(cmd)} failed: {exc}"
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}"
    return None


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """Debian's Chromium, installed with apt when missing (skip only if that fails)."""
    if not os.path.exists(CHROMIUM):
        why = _install_chromium()
        if why is not None or not os.path.exists(CHROMIUM):
            pytest.skip(
                f"browser tests need Debian's chromium at {CHROMIUM}, and it could "
                f"not be installed: {why or 'apt-get put nothing there'}"
            )
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium_path) -> Iterator:
    """One headless Chromium per module (each test gets its own context). Not one per
    session: while Playwright's sync API runs, its event loop is the thread's running
    loop, and pytest-asyncio's tests after these would fail to start theirs."""
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="playwright for Python is not installed (the [test] extra installs it)",
    )
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path, headless=True, args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, request) -> Iterator:
    """A fresh page (own cookies and storage) whose console errors fail the test; a
    screenshot of it is kept under ARTIFACTS when the test fails."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on(
        "console",
        lambda msg: (
            errors.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error" and "net::" not in msg.text and "401" not in msg.text
            else None
        ),
    )
    page.console_errors = errors
    yield page
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        save_screenshot(page, f"FAILED-{request.node.name}")
    context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Remember each phase's report on the item (the page fixture screenshots failures)."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def save_screenshot(page, name: str) -> Path:
    """A full-page screenshot under ARTIFACTS (build/ui-artifacts by default)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
