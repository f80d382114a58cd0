"""One layer's grouped decode attention on the torch backend, fused vs unfused, in isolation.

    .venv/bin/python benchmarks/results/apps/overhead-probe/fused_layer.py [--rows 8]

SmolLM2's attention shapes (9 query heads, 3 KV heads, head size 64), a random paged
cache with block size 16: `--rows` decode rows forked from one `--prefix`-token prefix,
each with its own 20-34 token suffix. Times `TorchAttention.forward` on the step's
metadata (the group's slots built once, as in the engine's 30 layers) with the fused
kernel and without, alternating, and checks that both agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from parrot_backend.engine.attention import AttentionMetadata, PrefixGroup, TorchAttention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    bs, hkv, hq, d, g, lp = 16, 3, 9, 64, args.rows, args.prefix
    kc = torch.randn(4096, bs, hkv, d)
    vc = torch.randn(4096, bs, hkv, d)
    prefix_blocks = list(range(10, 10 + lp // bs))
    tables, seq_lens, nxt = [], [], 1000
    for i in range(g):
        ls = 20 + 2 * i
        extra = (ls + bs - 1) // bs
        tables.append(prefix_blocks + list(range(nxt, nxt + extra)))
        nxt += extra
        seq_lens.append(lp + ls)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(g, dtype=torch.long),
        query_start=list(range(g + 1)),
        seq_lens=seq_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=bs,
        prefix_groups=[PrefixGroup(list(range(g)), lp, prefix_blocks)],
    )
    q = torch.randn(g, hq, d)
    fused, unfused = TorchAttention(), TorchAttention()
    unfused.fused_shared_decode = False
    scale = d**-0.5
    torch.testing.assert_close(
        fused.forward(q, kc, vc, meta, scale), unfused.forward(q, kc, vc, meta, scale)
    )
    times: dict[str, list[float]] = {"fused": [], "unfused": []}
    for r in range(args.rounds):
        for name, be in (("fused", fused), ("unfused", unfused))[:: 1 if r % 2 else -1]:
            for _ in range(20):
                be.forward(q, kc, vc, meta, scale)
            t = time.perf_counter()
            for _ in range(200):
                be.forward(q, kc, vc, meta, scale)
            times[name].append((time.perf_counter() - t) / 200 * 1e6)
    f, u = statistics.median(times["fused"]), statistics.median(times["unfused"])
    print(
        f"{g} rows over {lp} prefix tokens, one layer, torch threads "
        f"{torch.get_num_threads()}: fused {f:.0f} us, unfused {u:.0f} us ({u / f:.2f}x); "
        f"rounds {[round(x) for x in times['fused']]} / {[round(x) for x in times['unfused']]}"
    )


if __name__ == "__main__":
    main()
