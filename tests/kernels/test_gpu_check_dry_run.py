"""benchmarks/gpu_check.py --cpu-dry-run runs every section on the CPU and writes its report.

The GPU check is meant for one call on a lent GPU machine; this runs each of its sections
at tiny sizes (Triton interpreter where kernels run) so that the call does not die on a
typo. It checks the plumbing and the report, never a time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = [
    "env",
    "pytest_kernels",
    "kernel_sweep",
    "engine_logits",
    "engine_greedy",
    "kernel_speed",
    "bench_attention",
    "engine_throughput",
]
KERNELS = ["kv_store", "paged_decode", "extend", "shared_prefix", "merge"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks" / "gpu_check.sh"),
            str(out),
            "--cpu-dry-run",
            "--budget-s",
            "400",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**env, "PYTHON": sys.executable},
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    return out, json.loads((out / "results.json").read_text()), res.stdout


def test_every_section_runs_ok_on_the_cpu(dry_run):
    _, report, _ = dry_run
    assert report["mode"] == "cpu-dry-run"
    assert list(report["sections"]) == SECTIONS
    for name, sec in report["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"), sec.get("failures"))
        assert sec["summary"], name


def test_sections_measure_what_they_claim(dry_run):
    _, report, _ = dry_run
    s = {name: sec["result"] for name, sec in report["sections"].items()}
    assert s["env"]["hbm"]["ceiling_gbps"] > 0
    assert s["pytest_kernels"]["passed"] > 0 and s["pytest_kernels"]["failures"] == 0
    sweep = s["kernel_sweep"]["kernels"]
    assert sorted(sweep) == sorted(KERNELS)
    for name in KERNELS:
        assert sweep[name]["cases"] >= 2 and sweep[name]["passed"] == sweep[name]["cases"]
        # fp32 and fp16 both ran (the dry run's two dtypes)
        assert {r["dtype"] for r in sweep[name]["rows"]} == {"float32", "float16"}, name
    logits = s["engine_logits"]["rows"]
    assert {r["backend"] for r in logits} == {"triton", "torch"} and all(r["ok"] for r in logits)
    greedy = s["engine_greedy"]["comparisons"]
    assert len(greedy) == 5 and all(c["identical"] for c in greedy)
    assert all(c["grouped_rows"] > 0 for c in greedy), "the shared-prefix path never ran"
    speed = s["kernel_speed"]
    assert speed["paged"] and speed["shared"] and speed["crossover"]
    assert s["bench_attention"]["rows"]
    tput = s["engine_throughput"]
    assert {(r["backend"], r["batch"]) for r in tput["rows"]} == {
        (b, n) for b in ("torch", "triton") for n in (1, 2)
    }
    assert all(r["tok_s"] > 0 for r in tput["rows"])
    assert [r["backend"] for r in tput["fork"]["rows"]] == [
        "torch",
        "triton shared",
        "triton plain",
    ]


def test_the_report_fits_what_a_device_call_brings_back(dry_run):
    out, report, stdout = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert {"results.json", "results.md", "log.txt"} <= set(files)
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    assert all(p.stat().st_size < 16 << 20 for p in out.iterdir())
    md = (out / "results.md").read_text()
    for name in SECTIONS:
        assert f"## {name}:" in md
        assert re.search(rf"^\| {name} \| ok \|", md, re.M), name
    # the summary table is printed last, so the device call's output tail shows it
    assert any(
        line.startswith("| engine_throughput | ok |") for line in stdout.strip().splitlines()[-4:]
    )
    assert (out / "log.txt").read_text().strip().endswith(stdout.strip().splitlines()[-1])


def test_a_crash_a_hang_and_an_exception_cost_only_their_own_sections(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "GPU_CHECK_FAULT": "kernel_sweep:hang,engine_logits:crash,engine_greedy:raise",
    }
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            str(out),
            "--cpu-dry-run",
            "--only",
            "kernel_sweep,engine_logits,engine_greedy",
            "--max-box-s",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]  # not all ok
    secs = json.loads((out / "results.json").read_text())["sections"]
    assert secs["kernel_sweep"]["status"] == "timeout"
    assert secs["engine_logits"]["status"] == "error"
    assert "died" in secs["engine_logits"]["error"]
    assert secs["engine_greedy"]["status"] == "error"
    assert "injected fault" in secs["engine_greedy"]["error"]
    md = (out / "results.md").read_text()
    assert "| kernel_sweep | timeout |" in md and "| engine_logits | error |" in md


def test_speed_goals_are_judged_from_the_measured_rows(monkeypatch):
    """The GPU-only part of kernel_speed (the dry run reports no goals)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # dataclasses look it up
    spec.loader.exec_module(gpu_check)
    rows = {
        "shared": [
            {"shape": "llama3-8b", "prefix": 8192, "group": 64, "speedup": 12.5, "frac": 0.71},
            {"shape": "smollm2", "prefix": 8192, "group": 64, "speedup": 8.0, "frac": 0.85},
            {"shape": "smollm2", "prefix": 2048, "group": 64, "speedup": 5.0, "frac": 0.9},
        ],
        "crossover": [
            {"shape": "smollm2", "group": 8, "gate_slower_at": [256]},
            {"shape": "smollm2", "group": 64, "gate_slower_at": []},
        ],
    }
    goals = gpu_check.speed_goals(rows)
    met = {g["goal"].split(" (")[0]: g["met"] for g in goals}
    assert met == {
        "llama3-8b: shared >= 10x per-sequence at 8k x 64": True,
        "llama3-8b: shared-prefix at >= 80% of bandwidth": False,
        "smollm2: shared >= 10x per-sequence at 8k x 64": False,
        "smollm2: shared-prefix at >= 80% of bandwidth": True,
        "the gate never picks shared where it is >5% slower than plain": False,
    }
    assert "smollm2 group 8" in goals[-1]["goal"]
