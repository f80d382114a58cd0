"""Plain torch helpers shared by the references: gather paged KV, attend in fp32."""

from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor,
    table_row: torch.Tensor | list[int],
    lo: int,
    hi: int,
) -> torch.Tensor:
    """Rows for positions lo..hi-1 of one sequence: `[hi - lo, Hkv, D]`."""
    bs = cache.shape[1]
    table = torch.as_tensor(table_row, dtype=torch.long, device=cache.device)
    pos = torch.arange(lo, hi, device=cache.device)
    return cache[table[pos // bs], pos % bs]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[n, Hq, D]`, k/v `[L, Hkv, D]`, mask `[n, L]` (True = visible).

    Returns the fp32 output `[n, Hq, D]` and natural-log LSE `[n, Hq]`; a row with no
    visible key gets output 0 and LSE -inf.
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q.float(), kf) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.einsum("nhl,lhd->nhd", probs, vf), lse
