"""The app benchmark's report on hand-made records: the ratio ceiling and its "out of
reach" verdict, and the mixed-tenant medians over repetitions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from appbench import report

        yield report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


CAL = {"prefill_tokens_per_s": 500.0, "decode_step_s": 0.05}


def _record(workload: str, mode: str, jct: float) -> dict:
    summary = {"jct": jct, "unique_prompt_tokens": 1000, "critical_tokens": 100}
    return {
        "phase": "on",
        "workload": workload,
        "mode": mode,
        "calibration": CAL,
        "summary": summary,
    }


def test_the_ceiling_is_request_level_over_parrots_bound_and_marks_unreachable_goals(report):
    # bound: 1000 / 500 + 100 * 0.05 = 7 s
    records = [
        _record("multi_agent", "parrot", 8.0),
        _record("multi_agent", "request-level", 9.1),  # ceiling 1.3x < the 2x goal
        _record("shared_prompt", "parrot", 8.0),
        _record("shared_prompt", "request-level", 21.7),  # ceiling 3.1x >= the 3x goal
    ]
    rows = {r["workload"]: r for r in report.aggregate(records)}
    assert rows["multi_agent"]["lower_bound"] == pytest.approx(7.0)
    assert rows["multi_agent"]["ratio_ceiling"] == pytest.approx(1.3)
    assert rows["shared_prompt"]["ratio_ceiling"] == pytest.approx(3.1)
    text = report.goals(list(rows.values()))
    assert "| multi_agent, cache on: >= 2.0x | 1.14x | no (out of reach) | 1.30x |" in text
    # not met, but a parrot at its bound would have met it: a plain "no"
    assert "| shared_prompt, cache on: >= 3.0x | 2.71x | no | 3.10x |" in text


def test_a_parrot_under_its_bound_gets_no_ceiling_and_no_out_of_reach(report):
    # drafts took several tokens a step: 6 s against a one-token-per-step bound of 7 s
    records = [
        _record("multi_agent", "parrot", 6.0),
        _record("multi_agent", "request-level", 8.4),
    ]
    rows = report.aggregate(records)
    assert rows[0]["parrot_over_bound"] == pytest.approx(6 / 7)
    text = report.goals(rows)
    assert "| multi_agent, cache on: >= 2.0x | 1.40x | no | - (parrot under its bound) |" in text


def test_mixed_tenants_take_medians_over_repetitions(report):
    def run(mode, idle, loaded, tput):
        return {
            "mode": mode,
            "mixed": {
                "chain_idle": idle,
                "chain_loaded": loaded,
                "batch_alone_jct": 10.0,
                "batch_loaded_jct": 11.0,
                "batch_alone_tput": tput,
                "batch_loaded_tput": tput,
            },
        }

    records = [
        # no median is a mode's first or last run
        run("parrot", 2.0, 3.0, 90.0),
        run("request-level", 2.5, 10.0, 70.0),
        run("request-level", 2.5, 9.0, 75.0),
        run("parrot", 2.0, 2.6, 60.0),
        run("parrot", 2.0, 2.4, 100.0),
        run("request-level", 2.5, 11.0, 80.0),
    ]
    goals, text = report.mixed(records)
    assert goals["chain_slowdown"] == pytest.approx(2.6 / 2.0)
    assert goals["chain_vs_fifo"] == pytest.approx(10.0 / 2.6)
    assert goals["batch_tput_vs_fifo"] == pytest.approx(90.0 / 75.0)
    # each repetition's row and the medians' row, per mode
    assert text.count("| parrot |") == 4 and text.count("| request-level |") == 4
    assert "| parrot | median | 2.00 | 2.60 | 1.30x | 90.0 | 90.0 |" in text
    # one run per mode: its own row only
    _, one = report.mixed(records[:2])
    assert one.count("| parrot |") == 1 and "median" not in one
