"""Shared-prefix decode vs per-sequence paged decode vs torch SDPA over gathered KV.

    python benchmarks/kernels/bench_attention.py            # on a CUDA machine
    python benchmarks/kernels/bench_attention.py --smoke    # tiny, CPU, Triton interpreter

A group of `group` decode sequences shares a `prefix`-token prefix; each also has
`--suffix` tokens of its own. First checks all three paths against the torch reference on
the same device, then times them, and reports achieved bandwidth against the bytes that
must be read (the prefix K/V once, every suffix's K/V, q and the output), speedups, and
what the engine's gate (`should_share_prefix`) would pick. Writes CSV (and a PNG plot when
matplotlib is importable) to --out-dir and prints the table last.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter is chosen when kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from parrot_backend.engine.triton_attention import should_share_prefix  # noqa: E402
from parrot_backend.kernels.decode import plan_decode, run_decode  # noqa: E402
from parrot_backend.kernels.shared_prefix import (  # noqa: E402
    GroupSpec,
    plan_shared_prefix,
    run_shared_prefix,
    shared_prefix_decode_ref,
)

BLOCK = 16
SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # q heads, kv heads, head dim
# peak HBM bandwidth (GB/s) by device-name substring, for the roofline column
PEAK_GBPS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100": 3350,
    "A100": 2039,
    "L40S": 864,
    "A10": 600,
    "4090": 1008,
}


class Case:
    """A paged cache holding one group: shared prefix blocks, then each member's own."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        prefix: int,
        group: int,
        suffix: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        hq, hkv, d = shape
        gen = torch.Generator(device="cpu").manual_seed(seed)
        n_prefix = math.ceil(prefix / BLOCK)
        # a prefix that ends mid-block forces each member to own a copy of that block
        own = (
            math.ceil((prefix % BLOCK + suffix) / BLOCK)
            if prefix % BLOCK
            else math.ceil(suffix / BLOCK)
        )
        n_full = prefix // BLOCK
        blocks = 1 + n_prefix + group * own
        self.k = torch.randn(blocks, BLOCK, hkv, d, generator=gen).to(device, dtype)
        self.v = torch.randn(blocks, BLOCK, hkv, d, generator=gen).to(device, dtype)
        self.prefix_blocks = list(range(1, 1 + n_prefix))
        width = n_full + own
        table = torch.zeros(group, width, dtype=torch.int32)
        for i in range(group):
            mine = list(range(1 + n_prefix + i * own, 1 + n_prefix + (i + 1) * own))
            if prefix % BLOCK:  # copy-on-write of the partly shared block
                self.k[mine[0]] = self.k[self.prefix_blocks[-1]]
                self.v[mine[0]] = self.v[self.prefix_blocks[-1]]
            table[i] = torch.tensor(self.prefix_blocks[:n_full] + mine, dtype=torch.int32)
        self.tables = table.to(device)
        self.lens = [prefix + suffix] * group
        self.q = torch.randn(group, hq, d, generator=gen).to(device, dtype)
        self.prefix, self.group, self.suffix, self.shape = prefix, group, suffix, shape
        self.scale = d**-0.5

    def must_read_bytes(self) -> int:
        hq, hkv, d = self.shape
        elem = self.k.element_size()
        kv = (self.prefix + self.group * self.suffix) * hkv * d * 2 * elem
        return kv + 2 * self.group * hq * d * elem  # + q and out

    def shared_fn(self) -> Callable[[], torch.Tensor]:
        hq, hkv, _ = self.shape
        spec = GroupSpec(list(range(self.group)), self.lens, self.prefix, self.prefix_blocks)
        plan = plan_shared_prefix([spec], hq // hkv, hkv, BLOCK, self.q.device, dtype=self.q.dtype)
        return lambda: run_shared_prefix(plan, self.q, self.k, self.v, self.tables, self.scale)[0]

    def paged_fn(self) -> Callable[[], torch.Tensor]:
        hq, hkv, _ = self.shape
        plan = plan_decode(
            range(self.group), self.lens, None, hq // hkv, hkv, self.q.device, dtype=self.q.dtype
        )
        return lambda: run_decode(plan, self.q, self.k, self.v, self.tables, self.scale)[0]

    def sdpa_bytes(self) -> int:
        _, hkv, d = self.shape
        return 2 * self.group * self.lens[0] * hkv * d * self.k.element_size()

    def sdpa_fn(self) -> Callable[[], torch.Tensor]:
        """SDPA over K/V gathered into contiguous [group, Hkv, L, D] (gather not timed)."""
        n = self.lens[0]
        pos = torch.arange(n, device=self.q.device)
        blk = self.tables.long()[:, pos // BLOCK]
        k = self.k[blk, pos % BLOCK].transpose(1, 2).contiguous()
        v = self.v[blk, pos % BLOCK].transpose(1, 2).contiguous()
        q = self.q.unsqueeze(2)
        return lambda: F.scaled_dot_product_attention(
            q, k, v, scale=self.scale, enable_gqa=True
        ).squeeze(2)

    def reference(self) -> torch.Tensor:
        return shared_prefix_decode_ref(
            self.q,
            self.k,
            self.v,
            self.tables,
            self.lens,
            self.prefix,
            self.prefix_blocks,
            self.scale,
        )[0]


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds per call (CUDA events via triton's do_bench on a GPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=reps, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def check_correctness(device: torch.device, dtype: torch.dtype, smoke: bool) -> None:
    """All three paths vs the torch reference, on this device, before any timing."""
    prefix, group = (20, 3) if smoke else (1000, 37)  # prefix ends mid-block on purpose
    atol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for name, shape in SHAPES.items():
        case = Case(shape, prefix, group, 17, dtype, device, seed=1)
        want = case.reference().float()
        for path, fn in (
            ("shared", case.shared_fn()),
            ("paged", case.paged_fn()),
            ("sdpa", case.sdpa_fn()),
        ):
            err = (fn().float() - want).abs().max().item()
            if not err <= atol:
                sys.exit(f"correctness check FAILED: {name} {path} max error {err:.3g}")
    print(f"correctness: shared, paged and sdpa match the reference ({device}, {dtype})")


def peak_gbps(device: torch.device, given: float | None) -> float | None:
    if given or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU interpreter")
    ap.add_argument(
        "--prefix-lens", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192, 16384, 32768]
    )
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    ap.add_argument("--suffix", type=int, default=32, help="own tokens per sequence")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--reps", type=int, default=100, help="do_bench time budget (ms)")
    ap.add_argument(
        "--sdpa-max-gb",
        type=float,
        default=16.0,
        help="skip SDPA when its gathered K/V would exceed this",
    )
    ap.add_argument("--peak-gbps", type=float, default=None)
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/kernels/results"))
    args = ap.parse_args()

    if torch.cuda.is_available() and not args.smoke:
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
    else:
        sys.exit("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter")
    dtype = torch.float16 if args.dtype == "fp16" or args.smoke else torch.bfloat16
    if args.smoke:
        args.prefix_lens, args.group_sizes, args.suffix = [16, 40], [1, 3], 5
    check_correctness(device, dtype, args.smoke)
    peak = peak_gbps(device, args.peak_gbps)

    rows = []
    for shape_name in args.shapes:
        for prefix in args.prefix_lens:
            for group in args.group_sizes:
                case = Case(SHAPES[shape_name], prefix, group, args.suffix, dtype, device)
                t_shared = time_ms(case.shared_fn(), device, args.reps)
                t_paged = time_ms(case.paged_fn(), device, args.reps)
                t_sdpa = float("nan")
                if case.sdpa_bytes() <= args.sdpa_max_gb * 2**30:
                    t_sdpa = time_ms(case.sdpa_fn(), device, args.reps)
                must = case.must_read_bytes()
                gate = should_share_prefix(prefix, group)
                rows.append(
                    {
                        "shape": shape_name,
                        "prefix": prefix,
                        "group": group,
                        "suffix": args.suffix,
                        "shared_ms": t_shared,
                        "paged_ms": t_paged,
                        "sdpa_ms": t_sdpa,
                        "must_read_MB": must / 1e6,
                        "shared_GBps": must / t_shared / 1e6,
                        "paged_GBps": must / t_paged / 1e6,
                        "shared_pct_peak": 100 * must / t_shared / 1e6 / peak
                        if peak
                        else float("nan"),
                        "speedup_vs_paged": t_paged / t_shared,
                        "speedup_vs_sdpa": t_sdpa / t_shared,
                        "gate_shares": gate,
                        # time of the gate's pick over the faster path: 1.0 = the gate chose well
                        "gate_regret": (t_shared if gate else t_paged) / min(t_shared, t_paged),
                    }
                )
                del case
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    args.out_dir.mkdir(parents=True, exist_ok=True)
    tag = "smoke" if args.smoke else torch.cuda.get_device_name(device).replace(" ", "_")
    csv_path = args.out_dir / f"bench_attention_{tag}.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot_path = plot(rows, args.out_dir / f"bench_attention_{tag}.png")
    print(f"wrote {csv_path}" + (f" and {plot_path}" if plot_path else " (no matplotlib)"))
    print_table(rows, peak)


def plot(rows: list[dict], path: Path) -> Path | None:
    """Speedup of shared-prefix over paged decode vs prefix length, per group size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for group in sorted({r["group"] for r in rows}):
            pts = [
                (r["prefix"], r["speedup_vs_paged"])
                for r in rows
                if r["shape"] == shape and r["group"] == group
            ]
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"group {group}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(
            xscale="log",
            yscale="log",
            title=shape,
            xlabel="prefix tokens",
            ylabel="paged time / shared-prefix time",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def print_table(rows: list[dict], peak: float | None) -> None:
    head = (
        f"{'shape':<10}{'prefix':>7}{'group':>6}{'shared ms':>11}{'paged ms':>10}"
        f"{'sdpa ms':>9}{'GB/s':>8}{'%peak':>7}{'x paged':>9}{'x sdpa':>8}{'gate':>6}"
        f"{'regret':>8}"
    )
    if peak is None:
        print("(%peak needs --peak-gbps on an unlisted device)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['shape']:<10}{r['prefix']:>7}{r['group']:>6}{r['shared_ms']:>11.4f}"
            f"{r['paged_ms']:>10.4f}{r['sdpa_ms']:>9.4f}{r['shared_GBps']:>8.1f}"
            f"{r['shared_pct_peak']:>7.1f}{r['speedup_vs_paged']:>9.2f}"
            f"{r['speedup_vs_sdpa']:>8.2f}{'share' if r['gate_shares'] else 'plain':>6}"
            f"{r['gate_regret']:>8.2f}"
        )


if __name__ == "__main__":
    main()
