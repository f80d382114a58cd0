"""Merge partial attention states by their log-sum-exp (natural log, fp32).

A partial state over a subset of keys is `(o, lse)` with `o` the softmax-weighted mean
of those keys' values and `lse = log(sum(exp(scores)))`. Attention over the union of
disjoint key subsets is the mean of the partial outputs weighted by `exp(lse_s)`; a part
with no keys has lse = -inf and weight 0. Used for split-KV decode and for merging a
shared prefix with each sequence's suffix.
"""

from __future__ import annotations

import torch

from ._triton import jit, launch_guard, next_pow2, require_triton, tl


def merge_states_ref(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o_parts `[S, ..., D]`, lse_parts `[S, ...]` -> (out `[..., D]`, lse `[...]`)."""
    lse_parts = lse_parts.float()
    lse = torch.logsumexp(lse_parts, dim=0)  # -inf where every part is empty
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(lse_parts - safe)  # 0 for empty parts
    out = (weights.unsqueeze(-1) * o_parts.float()).sum(0)
    return out.to(out_dtype or o_parts.dtype), lse


@jit
def _merge_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    lse_out_ptr,
    num_parts,
    num_rows,
    stride_os,
    stride_or,
    stride_ls,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    # a tile of BLOCK_R (token, head) rows; two passes over the parts: max, then sum
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < num_rows
    ds = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (ds[None, :] < HEAD_DIM)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, num_parts):
        lse_s = tl.load(lse_ptr + s * stride_ls + rows, mask=r_ok, other=float("-inf"))
        m = tl.maximum(m, lse_s)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(0, num_parts):
        lse_s = tl.load(lse_ptr + s * stride_ls + rows, mask=r_ok, other=float("-inf"))
        w = tl.exp(lse_s - m_safe)
        o_s = tl.load(
            o_ptr + s * stride_os + rows[:, None] * stride_or + ds[None, :], mask=mask, other=0.0
        )
        acc += w[:, None] * o_s.to(tl.float32)
        total += w
    has = total > 0.0
    out = acc / tl.where(has, total, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * HEAD_DIM + ds[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )
    if STORE_LSE:
        lse = tl.where(has, m_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
        tl.store(lse_out_ptr + rows, lse, mask=r_ok)


def merge_states_triton(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    out: torch.Tensor | None = None,
    want_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of `merge_states_ref`; `out` (contiguous) may be given."""
    require_triton()
    s, d = o_parts.shape[0], o_parts.shape[-1]
    lead = o_parts.shape[1:-1]
    o2 = o_parts.reshape(s, -1, d)
    l2 = lse_parts.reshape(s, -1)
    if o2.stride(-1) != 1 or l2.stride(-1) != 1 or l2.dtype != torch.float32:
        raise ValueError("merge wants fp32 lse and unit stride in the last dims")
    rows = o2.shape[1]
    if out is None:
        out = torch.empty(*lead, d, dtype=out_dtype or o_parts.dtype, device=o_parts.device)
    if not out.is_contiguous():
        raise ValueError("merge output must be contiguous")
    lse = torch.empty(lead, dtype=torch.float32, device=o_parts.device) if want_lse else None
    if rows == 0:
        return out, lse
    block_r = 16
    with launch_guard():
        _merge_kernel[(triton_cdiv(rows, block_r),)](
            o2,
            l2,
            out,
            lse if lse is not None else l2,
            s,
            rows,
            o2.stride(0),
            o2.stride(1),
            l2.stride(0),
            HEAD_DIM=d,
            BLOCK_R=block_r,
            BLOCK_D=next_pow2(d),
            STORE_LSE=want_lse,
        )
    return out, lse


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)
