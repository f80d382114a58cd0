"""The matmul under the model's projections and LM head: PyTorch's `F.linear` or oneDNN's.

On a CPU in float32, `F.linear` goes to MKL's GEMM, which on the 2-core AMD EPYC of
our CI slows down sharply as soon as a batch has more than one row: measured with
SmolLM2-135M (`benchmarks/cpu_linear.py`), a decode step of 1 row takes ~45 ms, of
2 rows ~75 ms and of 3 rows ~95 ms, and prefill runs at ~400 tokens/s. oneDNN's inner
product (`torch.ops.mkldnn._linear_pointwise`, the op PyTorch's own compiler emits for
CPU linears) does the same steps in ~36 / 41 / 43 ms and prefills at ~650-830 tokens/s.
In bfloat16 PyTorch already takes oneDNN's path, and float16 has no oneDNN kernel here.

`auto` picks oneDNN on a CPU in float32 when this PyTorch build has it and a small
check agrees with `F.linear`; everything else keeps `F.linear`.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

KINDS = ("auto", "onednn", "torch")


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN's inner product."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def torch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@functools.cache
def onednn_problem(dtype: torch.dtype) -> str | None:
    """Why oneDNN's linear cannot serve `dtype` on this machine, or None when it can:
    the op must exist and agree with `F.linear` on a small product with a bias."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN's linear has no {dtype} kernel on the CPU"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=gen).to(dtype)
    w = torch.randn(24, 40, generator=gen).to(dtype)
    b = torch.randn(24, generator=gen).to(dtype)
    try:
        with torch.inference_mode():
            got = onednn_linear(x, w, b).float()
    except (RuntimeError, AttributeError) as e:  # no such op, or no kernel for it
        return f"oneDNN's linear failed: {e}"
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    if got.shape != want.shape or not torch.allclose(got, want, atol=tol, rtol=tol):
        return "oneDNN's linear disagrees with F.linear on a check"
    return None


def pick_linear(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`torch` or `onednn` for `EngineConfig.linear`; raises ValueError when `name` is
    unknown, or is `onednn` where oneDNN cannot serve."""
    if name not in KINDS:
        raise ValueError(f"unknown linear {name!r}; choose one of {', '.join(KINDS)}")
    if name == "torch":
        return "torch"
    if device.type != "cpu":
        if name == "onednn":
            raise ValueError(f"linear 'onednn' runs on the CPU only, not on {device.type}")
        return "torch"
    if name == "auto" and dtype != torch.float32:
        return "torch"  # bfloat16's F.linear already runs on oneDNN
    problem = onednn_problem(dtype)
    if problem is None:
        return "onednn"
    if name == "onednn":
        raise ValueError(f"linear 'onednn' is not available: {problem}")
    return "torch"


def linear_function(kind: str):
    return onednn_linear if kind == "onednn" else torch_linear
