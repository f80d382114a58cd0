"""One layer's attention for forks' prefill chunks on the torch backend, grouped vs plain.

    .venv/bin/python benchmarks/results/apps/overhead-probe/prefill_group_layer.py \
        [--forks 8] [--prefix 1024] [--new 19]

SmolLM2's attention shapes (9 query heads, 3 KV heads, head size 64), a random paged
cache with block size 16: `--forks` forks of one `--prefix`-token prefix (ending 15 tokens
into a block, as the shared_prompt system prompt does: those tokens are each fork's copy),
each prefilling `--new` tokens (+-2). Times `TorchAttention.forward` on the step's
metadata with the forks' chunks grouped (`_shared_prefill`) and not, alternating, and
checks that both agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from parrot_backend.engine.attention import (
    AttentionMetadata,
    TorchAttention,
    find_prefix_groups,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--new", type=int, default=19)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    bs, hkv, hq, d = 16, 3, 9, 64
    full = args.prefix // bs
    tail = 15
    kc = torch.randn(8192, bs, hkv, d)
    vc = torch.randn(8192, bs, hkv, d)
    prefix_blocks = list(range(10, 10 + full))
    tables, seq_lens, starts, slots, nxt = [], [], [0], [], 10 + full + 1
    for i in range(args.forks):
        n = args.new + (i % 5) - 2
        ln = full * bs + tail + n
        extra = (ln + bs - 1) // bs - full
        table = prefix_blocks + list(range(nxt, nxt + extra))
        nxt += extra
        tables.append(table)
        seq_lens.append(ln)
        starts.append(starts[-1] + n)
        slots += [table[p // bs] * bs + p % bs for p in range(ln - n, ln)]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start=starts,
        seq_lens=seq_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=bs,
    )
    meta.prefill_groups = find_prefix_groups(meta, lambda p, n: True, prefill=True)
    assert len(meta.prefill_groups) == 1 and meta.prefill_groups[0].prefix_len == full * bs
    plain_meta = dataclasses.replace(meta, prefill_groups=[], cache={})
    q = torch.randn(starts[-1], hq, d)
    be = TorchAttention()
    scale = d**-0.5
    torch.testing.assert_close(
        be.forward(q, kc, vc, meta, scale),
        be.forward(q, kc, vc, plain_meta, scale),
        atol=2e-5,
        rtol=2e-5,
    )
    times: dict[str, list[float]] = {"grouped": [], "plain": []}
    for r in range(args.rounds):
        for name, m in (("grouped", meta), ("plain", plain_meta))[:: 1 if r % 2 else -1]:
            for _ in range(5):
                be.forward(q, kc, vc, m, scale)
            t = time.perf_counter()
            for _ in range(args.iters):
                be.forward(q, kc, vc, m, scale)
            times[name].append((time.perf_counter() - t) / args.iters * 1e6)
    gr, pl = statistics.median(times["grouped"]), statistics.median(times["plain"])
    print(
        f"{args.forks} forks x ~{args.new} new tokens over {full * bs}+{tail} prefix tokens, "
        f"one layer, torch threads {torch.get_num_threads()}: grouped {gr:.0f} us, plain "
        f"{pl:.0f} us ({pl / gr:.2f}x); rounds {[round(x) for x in times['grouped']]} / "
        f"{[round(x) for x in times['plain']]}"
    )


if __name__ == "__main__":
    main()
