"""SmolLM2's matmuls by batch rows on this CPU: time and GFLOP/s, oneDNN packed (what the
engine runs) and F.linear, to tell whether an N-row decode step's linears are bound by
reading the weights (flat in N) or by arithmetic (growing with N).

    .venv/bin/python benchmarks/results/apps/overhead-probe/linear_rows.py [--rows 1 2 4 8 16]

Per matmul and row count: median of 5 rounds of 200 calls after 50 warm-up calls,
torch threads 2. The last lines sum a layer's four matmuls (x 30 layers).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from parrot_backend.engine.models.linear import onednn_linear, pack_weight

# [out, in] of the fused qkv, o, fused gate/up and down projections of one SmolLM2 layer
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def timed(f) -> float:
    for _ in range(50):
        f()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(200):
            f()
        runs.append((time.perf_counter() - t) / 200)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, threads 2")
    layer = {(k, m): 0.0 for k in ("onednn", "torch") for m in args.rows}
    with torch.inference_mode():
        for name, (o, i) in SHAPES.items():
            w = torch.randn(o, i)
            pw = pack_weight(w)
            for m in args.rows:
                x = torch.randn(m, i)
                t1 = timed(lambda x=x, pw=pw: onednn_linear(x, pw))
                t2 = timed(lambda x=x, w=w: F.linear(x, w))
                layer["onednn", m] += t1
                layer["torch", m] += t2
                gf = 2 * m * o * i / 1e9
                print(
                    f"{name:8s} rows {m:2d}: onednn packed {t1 * 1e6:6.1f} us "
                    f"({gf / t1:5.1f} GFLOP/s), F.linear {t2 * 1e6:6.1f} us ({gf / t2:5.1f})"
                )
    for m in args.rows:
        print(
            f"a layer's 4 matmuls, rows {m:2d}: onednn {layer['onednn', m] * 1e6:6.0f} us "
            f"(x30 = {layer['onednn', m] * 30e3:5.1f} ms), F.linear "
            f"{layer['torch', m] * 1e6:6.0f} us"
        )


if __name__ == "__main__":
    main()
