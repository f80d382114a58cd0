"""`--gpu` sizes of the application benchmark: every workload builds at the paper's scale
(no engine needed), and `--gpu` and `--quick` exclude each other."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from appbench import workloads  # noqa: E402

CALLS = {"shared_prompt": 64, "chain_summary": 12, "map_reduce": 33, "multi_agent": 17}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_workload_builds_at_gpu_size(name):
    wl = workloads.build(name, 7, gpu=True)
    cpu = workloads.build(name, 7)
    assert len(wl.calls) == CALLS[name]
    assert wl.info != cpu.info

    def text(w: workloads.Workload) -> int:
        return sum(len(c.template) for c in w.calls) + sum(len(v) for v in w.inputs.values())

    assert text(wl) > text(cpu)
    # an override still wins over the preset
    first = next(iter(workloads.GPU_SIZES[name]))
    assert workloads.build(name, 7, gpu=True, **{first: 2}).info != wl.info


def test_gpu_and_quick_exclude_each_other(capsys):
    import apps

    with pytest.raises(SystemExit):
        apps.main(["--gpu", "--quick"])
    assert "not allowed with argument" in capsys.readouterr().err
