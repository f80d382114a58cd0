"""The matmul under the model's projections and LM head: PyTorch's `F.linear` or oneDNN's.

On a CPU in float32, `F.linear` goes to MKL's GEMM, which on the 2-core AMD EPYC of
our CI slows down sharply as soon as a batch has more than one row: measured with
SmolLM2-135M (`benchmarks/cpu_linear.py`), a decode step of 1 row takes ~45 ms, of
2 rows ~75 ms and of 3 rows ~95 ms, and prefill runs at ~400 tokens/s. oneDNN's inner
product (`torch.ops.mkldnn._linear_pointwise`, the op PyTorch's own compiler emits for
CPU linears) does the same steps in ~36 / 41 / 43 ms and prefills at ~650-830 tokens/s.

oneDNN is faster again on weights reordered once into its blocked layout (`pack_weight`;
PyTorch's compiler does the same) than on plain ones, which it reorders for every call
of more than one row: measured on SmolLM2's shapes, the LM head of an 8-row step took
4.5 ms on plain weights and 2.8 ms packed, the MLP's two matmuls 0.16 / 0.11 ms ->
0.09 / 0.06 ms; one row costs the same either way. So on oneDNN the model holds every
projection's weight packed (`use_linear`), and a model whose embeddings are tied keeps a
packed copy of them for its LM head (the lookup needs the plain table): `vocab x hidden`
more values in memory (113 MiB for SmolLM2 in float32). In bfloat16 `F.linear` is oneDNN
on plain weights; packed ones made decode steps 1.04-1.31x faster there.

`auto` picks oneDNN on a CPU in float32 or bfloat16 when this PyTorch build has it and a
small check agrees with `F.linear`; everything else (float16 has no oneDNN CPU kernel,
CUDA) keeps `F.linear`.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

KINDS = ("auto", "onednn", "torch")
# the batch rows oneDNN lays a packed weight out for; 8, 64 and 512 measured alike for
# 1-512 rows (1 is the plain layout: no faster than unpacked)
PACK_ROWS = 8


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN's inner product."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (`[out, in]`) reordered into oneDNN's blocked layout for `onednn_linear`
    (a new tensor; `unpack_weight` gives the plain one back)."""
    if weight.is_mkldnn:
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def unpack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A packed weight back in the plain layout `F.linear` takes (others as they are)."""
    return weight.to_dense() if weight.is_mkldnn else weight


def prepare_weight(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight in the layout `kind`'s matmul takes: packed for `onednn`, plain else."""
    return pack_weight(weight) if kind == "onednn" else unpack_weight(weight)


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
            got = [onednn_linear(x, w, b).float(), onednn_linear(x, pack_weight(w), b).float()]
    except (RuntimeError, AttributeError) as e:  # no such op, or no kernel for it
        return f"oneDNN's linear failed: {e}"
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for y in got:
        if y.shape != want.shape or not torch.allclose(y, want, atol=tol, rtol=tol):
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
    problem = onednn_problem(dtype)
    if problem is None:
        return "onednn"
    if name == "onednn":
        raise ValueError(f"linear 'onednn' is not available: {problem}")
    return "torch"


def linear_function(kind: str):
    return onednn_linear if kind == "onednn" else torch_linear
