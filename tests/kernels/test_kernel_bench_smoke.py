"""The GPU benchmark script's --smoke mode runs end to end on the CPU interpreter."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_bench_attention_smoke_checks_times_and_writes_csv(tmp_path):
    script = ROOT / "benchmarks" / "kernels" / "bench_attention.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, str(script), "--smoke", "--shapes", "smollm2", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "correctness: shared, paged and sdpa match the reference" in res.stdout
    assert res.stdout.strip().splitlines()[-1].startswith("smollm2")  # the table is last
    rows = list(csv.DictReader((tmp_path / "bench_attention_smoke.csv").open()))
    assert len(rows) == 4 and all(float(r["shared_ms"]) > 0 for r in rows)
