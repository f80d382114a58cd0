"""Helpers the examples share: the connection, deterministic texts and a timing table.

Not an example itself. The texts come from `benchmarks/appbench/texts.py` (seeded, nothing
downloaded), so every example and the benchmark see the same documents and prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.appbench import texts  # noqa: E402
from parrot_backend.client import HttpBackend, Session, run_sync  # noqa: E402

__all__ = ["HttpBackend", "Session", "arguments", "escape", "finish", "show_calls", "texts"]


def arguments(doc: str) -> argparse.ArgumentParser:
    """An argument parser with `--url` (the server) and the example's docstring."""
    ap = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="a running `parrot-backend serve` (default %(default)s)",
    )
    return ap


def escape(text: str) -> str:
    """Text safe to put into a template verbatim (braces cannot open a placeholder)."""
    return text.replace("{", "(").replace("}", ")")


def _at(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def show_calls(url: str, run_ids: list[str], start: float) -> None:
    """Print every call of these runs: when it started, its first token, when it ended
    (seconds since `start`, a `time.time()`) and the tokens it generated."""
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        rows = []
        for run_id in run_ids:
            for _ in range(50):  # a call's record is written just after its value
                calls = http.get(f"/v1/runs/{run_id}").json()["calls"]
                if all(c["finished_at"] for c in calls):
                    break
                time.sleep(0.1)
            rows.extend((_at(call["started_at"]) or start, call) for call in calls)
    print(f"  {'call':<28} {'started':>8} {'1st tok':>8} {'done':>8} {'tokens':>6}")
    for began, call in sorted(rows, key=lambda r: r[0]):
        first, done = _at(call["first_token_at"]), _at(call["finished_at"])
        print(
            f"  {(call['name'] or '#' + str(call['idx']))[:28]:<28} {began - start:8.2f} "
            f"{(first or start) - start:8.2f} {(done or start) - start:8.2f} "
            f"{call['completion_tokens'] or 0:>6}"
        )


def finish(backend: HttpBackend, sessions: list[Session]) -> None:
    """Close the sessions' runs and the backend."""
    for s in sessions:
        run_sync(backend, s.close())
    backend.close()
