"""`benchmarks/apps.py --quick` end to end on the tiny random model: both engine cache
settings, every workload, both server modes, and the in-process `transformers` baseline
once per workload (cache-on phase only); the table, plots and JSON exist and add up. No
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
        assert r["ratio_ceiling"] == pytest.approx(r["request-level.jct"] / r["lower_bound"])
        # a prefix trie never counts more than what was sent
        assert r["parrot.unique_prompt_tokens"] <= r["parrot.prompt_tokens"]
        # transformers generate(): once per workload, in the cache-on phase only
        if r["phase"] == "on":
            assert r["transformers.reps"] == 1
            assert r["transformers.jct"] > 0
            assert r["transformers.tokens"] > 0
            assert r["transformers.prompt_tokens"] > 0
            assert r["transformers.prefill_padded"] >= r["transformers.prompt_tokens"]
            assert r["hf_ratio"] == pytest.approx(r["transformers.jct"] / r["parrot.jct"])
        else:
            assert r["transformers.reps"] == 0 and r["hf_ratio"] is None
    by = {(r["workload"], r["phase"]): r for r in rows}
    # with the engine's cache off, request-level fills the shared system prompt per user,
    # parrot once: the accounting must show it (token counts, not timings)
    shared = by[("shared_prompt", "off")]
    assert shared["parrot.prefill_computed"] < shared["request-level.prefill_computed"]
    table = (out / "table.md").read_text()
    assert table.startswith("Command: `python benchmarks/apps.py --quick")
    assert table.count("\n| shared_prompt | on |") >= 1 and "| goal | measured | met |" in table
    assert "| goal | measured | met | ceiling (request-level JCT / parrot's bound) |" in table
    assert "transformers generate()" in table and "| transformers / parrot |" in table
    saved = json.loads((out / "results.json").read_text())
    # both server modes in both phases, transformers once per workload, mixed tenants
    assert len(saved["runs"]) == 2 * 2 * len(names) + len(names) + 2
    assert all(run["run"]["calls"] for run in saved["runs"] if "run" in run)
    assert saved["meta"]["hf_reps"] == 1 and saved["meta"]["hf_phase"] == "on"
    hf_runs = [run for run in saved["runs"] if run["mode"] == "transformers"]
    assert {(run["workload"], run["phase"]) for run in hf_runs} == {(n, "on") for n in names}
    for run in hf_runs:
        assert run["run"]["rtt"] == 0 and run["run"]["engine"] == {}
        assert run["summary"]["jct"] > 0 and run["summary"]["tokens"] > 0
        for call in run["run"]["calls"]:
            # each call produced something, or stopped at once on EOS
            assert call["tokens"] > 0 or call["finish"] == "eos"
            assert call["output"] or call["finish"] == "eos"
            assert call["ttft"] == call["latency"] >= 0  # not streamed: the wave's time
    # mixed tenants ran once (cache on) in both modes
    assert set(result["mixed"]) >= {"chain_slowdown", "chain_vs_fifo", "batch_tput_vs_fifo"}
    assert all(v > 0 for v in result["mixed"].values())
    mixed_runs = [run for run in saved["runs"] if run["workload"] == "mixed_tenant"]
    assert {run["mode"] for run in mixed_runs} == {"parrot", "request-level"}
    # the idle chain is the loaded chain's texts, run again with nothing cached
    assert all(run["mixed"]["idle_same_texts"] is True for run in mixed_runs)
    assert "Mixed tenants" in table
    for plot in result["plots"]:
        assert (out / plot).stat().st_size > 1000
