"""The kernels compile for a GPU (sm_90) without one, with no register spills in bf16/fp16.

The interpreter accepts shapes and type mixes that a GPU compile rejects, so this compiles
the variants the benchmark launches with triton's bundled ptxas (`aot_check --quick`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="triton's CUDA backend (ptxas) not installed")
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "parrot_backend.kernels.aot_check",
            "--quick",
            "--arch",
            "90",
            "--no-spills",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 failed, 0 bf16/fp16 variants spill" in res.stdout
