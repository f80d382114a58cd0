"""`benchmarks/apps.py --quick` end to end on the tiny random model: both engine cache
settings, every workload, both modes; the table, plots and JSON exist and add up. No
timing is asserted (shared CI machines): only that each figure is there and sane."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def apps():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import apps

        yield apps
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.timeout(240)
def test_quick_run_writes_a_sane_table(apps, tiny_model_dir, tmp_path):
    out = tmp_path / "apps"
    result = apps.main(
        [
            "--quick",
            "--model",
            str(tiny_model_dir),
            "--out",
            str(out),
            "--port",
            str(_free_port()),
            "--rtt",
            "0.05",
        ]
    )
    names = set(apps.workloads.BUILDERS)
    rows = result["rows"]
    assert {(r["workload"], r["phase"]) for r in rows} == {
        (n, p) for n in names for p in ("on", "off")
    }
    for r in rows:
        for mode in ("parrot", "request-level"):
            assert r[f"{mode}.reps"] == 1
            assert r[f"{mode}.jct"] > 0.05  # at least one simulated round trip
            assert r[f"{mode}.ttft_mean"] >= 0
            assert r[f"{mode}.prompt_tokens"] > 0
            assert 0 < r[f"{mode}.prefill_computed"] <= r[f"{mode}.prompt_tokens"] + 16
        assert r["ratio"] == pytest.approx(r["request-level.jct"] / r["parrot.jct"])
        assert r["lower_bound"] > 0
        # a prefix trie never counts more than what was sent
        assert r["parrot.unique_prompt_tokens"] <= r["parrot.prompt_tokens"]
    by = {(r["workload"], r["phase"]): r for r in rows}
    # with the engine's cache off, request-level fills the shared system prompt per user,
    # parrot once: the accounting must show it (token counts, not timings)
    shared = by[("shared_prompt", "off")]
    assert shared["parrot.prefill_computed"] < shared["request-level.prefill_computed"]
    table = (out / "table.md").read_text()
    assert table.startswith("Command: `python benchmarks/apps.py --quick")
    assert table.count("\n| shared_prompt | on |") >= 1 and "| goal | measured | met |" in table
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["runs"]) == 2 * 2 * len(names) + 2  # + mixed tenants, each mode
    assert all(run["run"]["calls"] for run in saved["runs"] if "run" in run)
    # mixed tenants ran once (cache on) in both modes
    assert set(result["mixed"]) >= {"chain_slowdown", "chain_vs_fifo", "batch_tput_vs_fifo"}
    assert all(v > 0 for v in result["mixed"].values())
    assert "Mixed tenants" in table
    for plot in result["plots"]:
        assert (out / plot).stat().st_size > 1000
