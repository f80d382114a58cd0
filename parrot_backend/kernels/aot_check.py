"""Compile every kernel variant the backend launches for a GPU target, without a GPU.

    python -m parrot_backend.kernels.aot_check [--arch 90] [--quick] [--no-spills]

The interpreter accepts programs a GPU compile rejects (tl.dot shapes under 16, some type
mixes), so the CPU tests alone do not prove the kernels build for CUDA. This compiles them
with triton's bundled ptxas for `--arch` (sm_80, sm_90, ...) using the same tile choices
as the launchers and the integer specializations (divisible by 16) that a real launch
would see, then reports registers and stack (spill) bytes per variant from cuobjdump.
Exit status: 1 if a variant fails to compile, or with --no-spills if a bf16/fp16 variant
spills. Run it in a fresh process: kernels decorated under TRITON_INTERPRET cannot compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

os.environ.pop("TRITON_INTERPRET", None)  # before our kernel modules decorate anything
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's default warning

from . import attention_kernel as ak  # noqa: E402
from . import kv_store, merge  # noqa: E402
from ._triton import next_pow2, require_triton  # noqa: E402

BLOCK_SIZE = 16
# (name, GQA ratio, kv heads, head dim): SmolLM2, Llama-3-8B, Qwen2-7B, Llama-3-70B
MODELS = [
    ("smollm2", 3, 3, 64),
    ("llama3-8b", 4, 8, 128),
    ("qwen2-7b", 7, 4, 128),
    ("llama3-70b", 8, 8, 128),
]


@dataclass(slots=True)
class Variant:
    """One compile: kernel, pointer element types, int argument values, constexprs."""

    name: str
    dtype: str
    kernel: Any
    pointers: dict[str, str]
    ints: dict[str, int]
    floats: tuple[str, ...]
    constexprs: dict[str, Any]
    num_warps: int


def attention_variants(model: tuple[str, int, int, int], dtype: str) -> list[Variant]:
    """The attention kernel as decode (direct and split), extend and the prefix pass."""
    name, group, hkv, d = model
    hq = group * hkv
    rows = 37  # an output row count that makes row strides as unaligned as they get
    block_n = ak.default_block_n(torch.float32 if dtype == "fp32" else None)
    shapes = [  # schedule, BLOCK_M, causal, out dtype, store lse
        ("decode", ak.block_m_for(group, group), False, dtype, True),
        ("decode-split", ak.block_m_for(group, group), False, "fp32", True),
        ("extend", ak.block_m_for(64, group, cap=64), True, dtype, False),
        ("prefix-small", ak.block_m_for(4 * group, group), False, "fp32", True),
        ("prefix", ak.block_m_for(1 << 12, group), False, "fp32", True),
    ]
    out = []
    for sched, block_m, causal, odt, lse in shapes:
        ints = {
            "stride_qt": hq * d,
            "stride_qh": d,
            "stride_kb": BLOCK_SIZE * hkv * d,
            "stride_ko": hkv * d,
            "stride_kh": d,
            "stride_vb": BLOCK_SIZE * hkv * d,
            "stride_vo": hkv * d,
            "stride_vh": d,
            "stride_bt": 129,
            "stride_os": rows * hq * d,
            "stride_ot": hq * d,
            "stride_oh": d,
            "stride_ls": rows * hq,
            "stride_lt": hq,
            "split_len": 4 * block_n,
        }
        out.append(
            Variant(
                f"attn/{sched} {name} {dtype}",
                dtype,
                ak._paged_attn_kernel,
                {
                    "q_ptr": dtype,
                    "kc_ptr": dtype,
                    "vc_ptr": dtype,
                    "bt_ptr": "i32",
                    "tiles_ptr": "i32",
                    "o_ptr": odt,
                    "lse_ptr": "fp32",
                },
                ints,
                ("scale",),
                {
                    "GROUP": group,
                    "HEAD_DIM": d,
                    "BLOCK_SIZE": BLOCK_SIZE,
                    "BLOCK_M": block_m,
                    "BLOCK_N": block_n,
                    "BLOCK_D": max(16, next_pow2(d)),
                    "CAUSAL": causal,
                    "STORE_LSE": lse,
                    "IEEE": dtype == "fp32",
                },
                4 if block_m <= 64 else 8,
            )
        )
    return out


def small_variants(model: tuple[str, int, int, int], dtype: str) -> list[Variant]:
    """The KV store and the LSE merge for one head shape."""
    name, group, hkv, d = model
    hq = group * hkv
    store = Variant(
        f"kv_store {name} {dtype}",
        dtype,
        kv_store._store_kv_kernel,
        {"k_ptr": dtype, "v_ptr": dtype, "kc_ptr": dtype, "vc_ptr": dtype, "slot_ptr": "i64"},
        {
            "stride_kt": 3 * hkv * d,
            "stride_kh": d,
            "stride_vt": 3 * hkv * d,
            "stride_vh": d,
            "stride_cb": BLOCK_SIZE * hkv * d,
            "stride_co": hkv * d,
            "stride_ch": d,
            "stride_vcb": BLOCK_SIZE * hkv * d,
            "stride_vco": hkv * d,
            "stride_vch": d,
            "block_size": BLOCK_SIZE,
        },
        (),
        {"NUM_HEADS": hkv, "HEAD_DIM": d, "BLOCK_H": next_pow2(hkv), "BLOCK_D": next_pow2(d)},
        4,
    )
    mrg = Variant(
        f"merge {name} {dtype}",
        dtype,
        merge._merge_kernel,
        {"o_ptr": "fp32", "lse_ptr": "fp32", "out_ptr": dtype, "lse_out_ptr": "fp32"},
        {
            "num_parts": 3,
            "num_rows": 37 * hq,
            "stride_os": 37 * hq * d,
            "stride_or": d,
            "stride_ls": 37 * hq,
        },
        (),
        {"HEAD_DIM": d, "BLOCK_R": 16, "BLOCK_D": next_pow2(d), "STORE_LSE": True},
        4,
    )
    return [store, mrg]


def variants(quick: bool) -> list[Variant]:
    """All variants, or (quick) the two models the benchmark uses in their serving dtypes."""
    if quick:
        return (
            attention_variants(MODELS[1], "bf16")
            + attention_variants(MODELS[0], "fp16")[:2]
            + small_variants(MODELS[1], "bf16")
        )
    out = []
    for model in MODELS:
        for dtype in ("bf16", "fp16", "fp32"):
            out += attention_variants(model, dtype) + small_variants(model, dtype)
    return out


def compile_variant(v: Variant, arch: int) -> dict[str, Any]:
    """Compile one variant; returns its name, REG and STACK bytes (None when unknown)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = v.kernel
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, arg in enumerate(fn.arg_names):
        if arg in v.constexprs:
            sig[arg] = "constexpr"
        elif arg in v.pointers:
            sig[arg] = "*" + v.pointers[arg]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif arg in v.floats:
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
            if v.ints[arg] % 16 == 0:  # what the JIT specializes at launch
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=dict(v.constexprs), attrs=attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": v.num_warps}
    )
    return {"name": v.name, "dtype": v.dtype, **_usage(kernel.asm.get("cubin"))}


def _usage(cubin: bytes | None) -> dict[str, int | None]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return {"regs": None, "stack": None}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=False
        ).stdout
    reg = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return {
        "regs": int(reg.group(1)) if reg else None,
        "stack": int(stack.group(1)) if stack else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    ap.add_argument("--quick", action="store_true", help="the benchmark's shapes only")
    ap.add_argument(
        "--no-spills", action="store_true", help="fail if a bf16/fp16 variant spills to the stack"
    )
    args = ap.parse_args(argv)
    require_triton()
    if (
        not hasattr(ak._paged_attn_kernel, "arg_names")
        or "Interpreted" in type(ak._paged_attn_kernel).__name__
    ):
        print("kernels were decorated under TRITON_INTERPRET; run in a fresh process")
        return 1
    failed = spilled = 0
    print(f"{'variant':<40}{'regs':>6}{'stack':>7}   (sm_{args.arch})")
    for v in variants(args.quick):
        try:
            r = compile_variant(v, args.arch)
        except Exception as exc:  # report every failure, not just the first
            failed += 1
            print(f"{v.name:<40} FAILED: {str(exc).splitlines()[0][:200]}")
            continue
        spills = bool(r["stack"]) and v.dtype != "fp32"
        spilled += spills
        stack = "?" if r["stack"] is None else r["stack"]
        print(f"{r['name']:<40}{r['regs'] or '?':>6}{stack:>7}" + ("   spills" if spills else ""))
    print(f"{failed} failed, {spilled} bf16/fp16 variants spill")
    return 1 if failed or (args.no_spills and spilled) else 0


if __name__ == "__main__":
    sys.exit(main())
