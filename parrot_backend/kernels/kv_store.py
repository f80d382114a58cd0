"""KV store: write each new token's K/V row into the paged cache at its slot.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`; slot `s` is block
`s // block_size`, offset `s % block_size`. A negative slot means "padding, skip".
"""

from __future__ import annotations

import torch

from ._triton import jit, launch_guard, next_pow2, require_triton, tl


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference: k, v `[T, Hkv, D]`; row t goes to slot `slot_mapping[t]` (skipped if < 0)."""
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(nb * bs, h, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, h, d)[slots] = v[keep].to(v_cache.dtype)


@jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_vcb,
    stride_vco,
    stride_vch,
    block_size,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per token: its whole [Hkv, D] row moves as one tile
    t = tl.program_id(0)
    hs = tl.arange(0, BLOCK_H)[:, None]
    ds = tl.arange(0, BLOCK_D)[None, :]
    # the slot is read as a [BLOCK_H, 1] column so the skip test is a tensor mask
    slot = tl.load(slot_ptr + t + hs * 0).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    mask = (hs < NUM_HEADS) & (ds < HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + hs * stride_kh + ds, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + hs * stride_vh + ds, mask=mask)
    tl.store(
        kc_ptr + blk * stride_cb + off * stride_co + hs * stride_ch + ds,
        k.to(kc_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        vc_ptr + blk * stride_vcb + off * stride_vco + hs * stride_vch + ds,
        v.to(vc_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of `store_kv_ref` (same arguments, writes in place)."""
    require_triton()
    t, h, d = k.shape
    if t == 0:
        return
    # the kernel addresses the last dim with unit stride
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    with launch_guard():
        _store_kv_kernel[(t,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            k_cache.shape[1],
            NUM_HEADS=h,
            HEAD_DIM=d,
            BLOCK_H=next_pow2(h),
            BLOCK_D=next_pow2(d),
        )
