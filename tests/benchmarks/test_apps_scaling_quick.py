"""`benchmarks/apps_scaling.py` end to end on the tiny random model, two repetitions per
point with the mode order alternating: the medians, each repetition's JCTs and ratios, and
the prefill accounting (exact token counts, no timing asserted)."""

from __future__ import annotations

import json
import socket
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def scaling():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import apps_scaling

        yield apps_scaling
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.timeout(240)
def test_scaling_repeats_each_point_and_reports_medians(scaling, tiny_model_dir, tmp_path):
    out = tmp_path / "scaling"
    text = scaling.main(
        [
            "--model",
            str(tiny_model_dir),
            "--users",
            "1",
            "3",
            "--prompt",
            "48",
            "--gen",
            "2",
            "--reps",
            "2",
            "--out",
            str(out),
            "--port",
            str(_free_port()),
        ]
    )
    data = json.loads((out / "scaling.json").read_text())
    rows = data["rows"]
    assert [(r["prompt"], r["users"]) for r in rows] == [(48, 1), (48, 3)]
    for r in rows:
        assert r["reps"] == 2
        for mode in ("parrot", "request-level"):
            jcts = r[mode]["jcts"]
            assert len(jcts) == 2 and all(j > 0 for j in jcts)
            assert r[mode]["jct"] == pytest.approx(statistics.median(jcts))
            assert r[mode]["prefill_computed"] > 0
            # every call generates --gen tokens in both modes (ignore_eos): equal work
            assert r[mode]["tokens"] == [2 * r["users"]] * 2
        assert r["rep_ratios"] == pytest.approx(
            [b / a for a, b in zip(r["parrot"]["jcts"], r["request-level"]["jcts"], strict=True)]
        )
    # three users share the prompt: parrot fills it once, request-level once per user
    three = rows[1]
    assert three["request-level"]["prefill_computed"] > 2 * three["parrot"]["prefill_computed"]
    assert (out / "scaling.md").read_text() == text
    assert "ratio per repetition" in text and (out / "scaling.png").exists()
