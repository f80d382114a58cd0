#!/usr/bin/env python3
"""One call on a fresh GPU machine: environment, kernel correctness, the kernel tests,
engine equivalence, kernel speed against HBM bandwidth, and engine throughput.

    bash benchmarks/gpu_check.sh OUT_DIR                  # on the GPU machine (one device run)
    python benchmarks/gpu_check.py OUT_DIR --cpu-dry-run  # every section, tiny, on the CPU

Sections (each in its own process, with its own time box; a failing, hanging or crashing
section records what it can and the others run; the correctness sections run side by side,
`--jobs` at a time, and on a GPU each timing section runs alone):

- env: nvidia-smi, package versions, HBM bandwidth (a large copy and a large read) and a
  bf16 matmul rate; the bandwidth is the ceiling for the speed sections.
- pytest_kernels: `tests/kernels` with compiled kernels (no interpreter).
- kernel_sweep: every kernel against its torch reference on >= 50 shapes each.
- engine_logits: engine logits vs transformers (random-weight SmolLM2- and Llama-3-8B-
  shaped models) in bf16 and fp16, both attention backends.
- engine_greedy: greedy tokens of the Triton backend vs the torch backend through the
  engine, the shared-prefix path vs plain decode, a fork vs unshared prompts.
- kernel_speed: paged and shared-prefix decode as a fraction of the measured bandwidth,
  shared vs per-sequence at 8k x 64, the gate's crossover.
- bench_attention: `benchmarks/kernels/bench_attention.py`.
- engine_throughput: engine decode tokens/s at batch 1/8/64, Triton vs torch backend, on
  SmolLM2- and Llama-3-8B-shaped random models (built in GPU memory, no checkpoint).

No model file travels to the GPU machine (the SmolLM2 GGUF is larger than what a device
call carries), so every model is random-weight, built from a config, with a synthetic
word-level tokenizer. The report is rewritten after every section: OUT_DIR/results.json,
OUT_DIR/results.md, plus bench_attention.csv/png and pytest_kernels.xml; at most 8 files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import datetime as dt
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()

# Output tolerances. bf16/fp16: those of vLLM's Triton unified-attention and FlashAttention
# kernel tests (atol 1.5e-2, rtol 1e-2, random normal inputs). fp32: this repo's kernel
# tests. `STRICT` is vLLM's per-dtype default (tests/kernels/allclose_default.py), reported
# as a second, informational count.
TOL = {"float32": (1e-5, 1e-5), "bfloat16": (1.5e-2, 1e-2), "float16": (1.5e-2, 1e-2)}
STRICT = {"float32": (1e-5, 1.3e-6), "bfloat16": (1e-3, 1.6e-2), "float16": (1e-3, 1e-3)}
LSE_TOL = {"float32": (1e-4, 1e-4), "bfloat16": (1e-3, 1e-3), "float16": (1e-3, 1e-3)}
# engine logits: relative L2 error vs the fp32 reference may be at most twice what
# transformers itself makes in the same dtype, and never needs to beat vLLM's default rtol
LOGIT_FLOOR = {"float32": 1e-4, "bfloat16": 1.6e-2, "float16": 1e-3}
TOPK_TIE = 5  # a greedy divergence is a near-tie when each token is in the other's top 5
DATASHEET_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864}
# SmolLM2-135M and Llama-3-8B attention shapes: (q heads, kv heads, head dim)
HEAD_SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}


@dataclass(frozen=True)
class Spec:
    """A section: its time boxes (GPU, CPU dry run), the least time worth starting it with,
    and whether it must run alone on the GPU (it measures speed)."""

    name: str
    title: str
    box_gpu: float
    box_cpu: float
    reserve: float
    timing: bool = False


# Correctness sections run side by side (`--jobs`; they only need the GPU to be right, and
# the kernel tests take longest, so they start first); timing sections run alone.
SPECS = [
    Spec("env", "Environment and HBM bandwidth", 60, 90, 10, timing=True),
    Spec("pytest_kernels", "Kernel tests (pytest, compiled kernels)", 300, 150, 20),
    Spec("kernel_sweep", "Kernel correctness sweep vs torch references", 200, 120, 25),
    Spec("engine_logits", "Engine logits vs transformers", 180, 120, 25),
    Spec("engine_greedy", "Greedy tokens: Triton vs torch backend, fork vs unshared", 180, 120, 25),
    Spec(
        "kernel_speed",
        "Kernel speed vs HBM bandwidth, shared-prefix gate",
        100,
        90,
        25,
        timing=True,
    ),
    Spec("bench_attention", "benchmarks/kernels/bench_attention.py", 130, 90, 30, timing=True),
    Spec("engine_throughput", "Engine decode throughput", 150, 120, 30, timing=True),
]
BY_NAME = {s.name: s for s in SPECS}


# =============================================================== the orchestrator
def main(argv: list[str] | None = None) -> int:
    """Parse arguments; run the sections (parent) or one section (child)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="where results.json / results.md go ($OUT)")
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="every section on the CPU, tiny sizes, Triton interpreter",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="overall time budget (default 470 on a GPU, 300 in a dry run)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="correctness sections run at once (default 3 on a GPU, 2 dry)",
    )
    ap.add_argument(
        "--max-box-s", type=float, default=None, help="cap every section's time box (seconds)"
    )
    ap.add_argument("--only", default="", help="comma-separated sections to run")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    ap.add_argument(
        "--dtypes",
        default=None,
        help="engine dtypes (default bfloat16,float16; float32 in a dry run)",
    )
    ap.add_argument(
        "--sweep-cases",
        type=int,
        default=None,
        help="cases per kernel in kernel_sweep (default 56; 2 in a dry run)",
    )
    ap.add_argument(
        "--pytest-workers",
        type=int,
        default=6,
        help="pytest-xdist workers for the kernel tests when xdist is there",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--box-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    if args.dtypes is None:
        args.dtypes = "float32" if dry else "bfloat16,float16"
    if args.sweep_cases is None:
        args.sweep_cases = 2 if dry else 56
    if args.budget_s is None:
        args.budget_s = 300.0 if dry else 470.0
    if args.jobs is None:
        args.jobs = 2 if dry else 3
    if args.child:
        return child_main(args)
    return orchestrate(args)


def _child_cmd(args: argparse.Namespace, spec: Spec, work: Path, box: float) -> list[str]:
    cmd = [
        sys.executable,
        str(SCRIPT),
        str(args.out_dir),
        "--child",
        spec.name,
        "--work-dir",
        str(work),
        "--box-s",
        f"{box:.1f}",
        "--dtypes",
        args.dtypes,
        "--sweep-cases",
        str(args.sweep_cases),
        "--pytest-workers",
        str(args.pytest_workers),
        "--budget-s",
        str(args.budget_s),
    ]
    return cmd + (["--cpu-dry-run"] if args.cpu_dry_run else [])


def _child_env(dry: bool) -> dict[str, str]:
    env = dict(os.environ)
    # the package need not be installed on the GPU machine: the working tree is enough
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, on either machine
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if dry:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels, never the interpreter
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """End a section's process group (it may have started pytest workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class Child:
    """A running section process."""

    spec: Spec
    proc: subprocess.Popen
    started: float
    box: float
    log: Any  # its output file (side-by-side sections), or None (streams to our stdout)


class Run:
    """The parent's state: the report so far and the section processes running now."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.cpu_dry_run
        self.out = args.out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.t0 = time.time()
        self.deadline = self.t0 + args.budget_s
        self.running: dict[str, Child] = {}
        self.last_write = 0.0
        self.report: dict[str, Any] = {
            "tool": "benchmarks/gpu_check.py",
            "mode": "cpu-dry-run" if self.dry else "gpu",
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "finished": None,
            "wall_s": None,
            "budget_s": args.budget_s,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "git": git_info(),
            "sections": {},
        }

    def left(self) -> float:
        return self.deadline - time.time()

    def launch(self, spec: Spec, box: float, alone: bool) -> None:
        # side-by-side sections write to their own file, copied into the log at their end
        log = None if alone else (self.work / f"{spec.name}.log").open("w")
        print(
            f"[gpu_check] {spec.name}: start (box {box:.0f} s, {self.left():.0f} s left"
            f"{', alone' if alone else ''})",
            flush=True,
        )
        proc = subprocess.Popen(
            _child_cmd(self.args, spec, self.work, box),
            cwd=ROOT,
            env=_child_env(self.dry),
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
        )
        self.running[spec.name] = Child(spec, proc, time.time(), box, log)
        self.report["sections"][spec.name] = {"status": "running", "summary": "", "result": {}}

    def poll(self) -> None:
        """Record sections that ended; kill those past their box (plus grace for their own
        cleanup); refresh the report with what running sections saved so far."""
        for name, c in list(self.running.items()):
            # grace past the box: the child stops itself shortly before it, then saves
            over = time.time() > c.started + c.box + min(15.0, 2.0 + 0.25 * c.box)
            if c.proc.poll() is None and not over:
                continue
            if c.proc.poll() is None:
                _kill_group(c.proc)
            self._record(c, timed_out=over and c.proc.returncode not in (0,))
            del self.running[name]
        if time.time() - self.last_write > 20:  # a killed call still leaves a recent report
            for name in self.running:
                rec = read_child(self.work / f"{name}.json")
                rec["status"] = "running"
                self.report["sections"][name] = rec
            self.write()

    def _record(self, c: Child, timed_out: bool) -> None:
        rec = read_child(self.work / f"{c.spec.name}.json")
        rec["rc"] = c.proc.returncode
        rec["wall_s"] = round(time.time() - c.started, 1)
        rec["box_s"] = round(c.box, 1)
        if timed_out:
            rec["status"] = "timeout"
            rec["error"] = (rec.get("error") or "") + f"killed after its {c.box:.0f} s box"
        elif rec.get("status") in (None, "running") or c.proc.returncode != 0:
            # no final save: the process died (a segfault, an abort, out of memory)
            rec["status"] = "error"
            rec["error"] = (rec.get("error") or "") + (
                f"section process died (exit status {c.proc.returncode}); its output is in log.txt"
            )
        if not rec.get("summary") and rec.get("error"):
            rec["summary"] = str(rec["error"])[:160]
        self.report["sections"][c.spec.name] = rec
        if c.log is not None:
            c.log.close()
            text = (self.work / f"{c.spec.name}.log").read_text(errors="replace").rstrip()
            print(
                f"----- output of {c.spec.name} -----\n{text}\n----- end of {c.spec.name} -----",
                flush=True,
            )
        print(
            f"[gpu_check] {c.spec.name}: {rec['status']} in {rec['wall_s']} s"
            f" - {rec.get('summary', '')}",
            flush=True,
        )
        self.write()

    def wait(self, at_most: int) -> None:
        """Until no more than `at_most` sections are running."""
        while len(self.running) > at_most:
            time.sleep(0.2)
            self.poll()

    def skip(self, spec: Spec, why: str) -> None:
        self.report["sections"][spec.name] = {
            "status": "skipped",
            "summary": why,
            "wall_s": 0.0,
            "result": {},
        }
        print(f"[gpu_check] {spec.name}: skipped - {why}", flush=True)
        self.write()

    def write(self) -> None:
        self.last_write = time.time()
        self.report["wall_s"] = round(time.time() - self.t0, 1)
        self.report["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        atomic_write(self.out / "results.json", json.dumps(self.report, indent=1, default=str))
        atomic_write(self.out / "results.md", render_markdown(self.report))


def orchestrate(args: argparse.Namespace) -> int:
    """Run the chosen sections in order within the overall budget; write the report."""
    run = Run(args)
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    unknown = (only | skip) - set(BY_NAME)
    if unknown:
        print(f"unknown sections: {sorted(unknown)}; known: {list(BY_NAME)}", file=sys.stderr)
        return 2
    chosen = [s for s in SPECS if (not only or s.name in only) and s.name not in skip]
    for i, spec in enumerate(chosen):
        # on a GPU a timing section runs alone; CPU timings mean nothing, so a dry run
        # runs every section side by side
        alone = spec.timing and not run.dry
        run.wait(0 if alone else max(0, args.jobs - 1))
        env_rec = run.report["sections"].get("env")
        if not run.dry and env_rec and env_rec.get("result", {}).get("cuda_available") is False:
            run.skip(spec, "no CUDA device")
            continue
        # keep the least time each later section needs
        later = sum(s.reserve for s in chosen[i + 1 :])
        box = min(
            spec.box_cpu if run.dry else spec.box_gpu,
            run.left() - later,
            args.max_box_s or math.inf,
        )
        if box < min(max(spec.reserve, 5.0), args.max_box_s or math.inf):
            run.skip(spec, f"budget: {run.left():.0f} s left")
            continue
        run.launch(spec, box, alone)
        if alone:
            run.wait(0)
    run.wait(0)
    run.write()
    shutil.rmtree(run.work, ignore_errors=True)
    statuses = {n: r["status"] for n, r in run.report["sections"].items()}
    print("\n" + render_markdown(run.report, summary_only=True), flush=True)
    print(
        f"[gpu_check] wrote {args.out_dir / 'results.json'} and "
        f"{args.out_dir / 'results.md'} in {run.report['wall_s']} s",
        flush=True,
    )
    return 0 if all(s == "ok" for s in statuses.values()) else 1


def read_child(path: Path) -> dict[str, Any]:
    """A section's saved JSON, or an empty record if it never wrote one."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"result": {}}


def atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file and a rename: a reader never sees half a report."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def git_info() -> dict[str, Any]:
    """Commit and dirtiness of the working tree, if it is a git checkout."""

    def git(*a: str) -> str | None:
        try:
            r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


# =============================================================== the child side
class Deadline(Exception):
    """A section ran out of its time box (cooperatively)."""


class Ctx:
    """What a section gets: its mode, device, deadline, and a result that it saves as it
    goes (a section killed at its box still leaves what it measured)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.name = args.child
        self.args = args
        self.dry = args.cpu_dry_run
        self.work = args.work_dir
        self.out = args.out_dir
        self.t0 = time.time()
        # stop 8% (at least 4 s) before the box, so the result is saved before the kill
        self.deadline = self.t0 + args.box_s - max(4.0, 0.08 * args.box_s)
        self.dtypes = [d for d in args.dtypes.split(",") if d]
        self.result: dict[str, Any] = {}
        self.failures: list[str] = []
        self.partial = False
        self.error: str | None = None
        self.summary = ""
        self._device = None

    @property
    def device(self):
        if self._device is None:
            import torch

            self._device = torch.device("cpu" if self.dry else "cuda")
        return self._device

    def left(self) -> float:
        return self.deadline - time.time()

    def enough(self, need: float) -> bool:
        """Whether `need` seconds remain; if not the section is marked partial."""
        if self.left() < need:
            self.partial = True
            return False
        return True

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        self.log(f"FAIL {msg}")

    def log(self, msg: str) -> None:
        print(f"[{self.name}] {msg}", flush=True)

    def env_result(self) -> dict[str, Any]:
        return read_child(self.work / "env.json").get("result", {})

    def status(self) -> str:
        if self.error:
            return "error"
        if self.failures:
            return "fail"
        return "partial" if self.partial else "ok"

    def save(self, final: bool = False) -> None:
        """Write the result so far; only the final save says how the section ended (a
        process that dies before it stays "running", which the parent reports as such)."""
        rec = {
            "status": self.status() if final else "running",
            "summary": self.summary,
            "result": self.result,
            "failures": self.failures[:50],
            "error": self.error,
            "section_s": round(time.time() - self.t0, 1),
        }
        atomic_write(self.work / f"{self.name}.json", json.dumps(rec, indent=1, default=str))


def child_main(args: argparse.Namespace) -> int:
    """Run one section in this process (TRITON_INTERPRET is set before triton loads)."""
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    ctx = Ctx(args)
    try:
        _inject_fault(ctx)
        if args.child not in ("pytest_kernels", "bench_attention"):  # these run a script
            import torch

            if ctx.dry:  # tiny tensors: a second OpenMP thread only adds contention
                torch.set_num_threads(1)
        if args.child.startswith("engine"):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # no progress bars in the log
        SECTIONS[args.child](ctx)
    except Deadline:
        ctx.partial = True
    except BaseException as exc:  # the section's failure is data for the report
        ctx.error = f"{type(exc).__name__}: {exc}"
        ctx.result["traceback"] = traceback.format_exc()[-4000:]
        ctx.log(ctx.result["traceback"])
    if not ctx.summary and ctx.error:
        ctx.summary = ctx.error[:160]
    ctx.save(final=True)
    return 0


def _inject_fault(ctx: Ctx) -> None:
    """GPU_CHECK_FAULT=section:crash|hang|raise[,...] makes a section fail on purpose, so the
    test can show that a crash, a hang or an exception costs only that section."""
    spec = dict(
        x.split(":", 1) for x in os.environ.get("GPU_CHECK_FAULT", "").split(",") if ":" in x
    )
    kind = spec.get(ctx.name)
    if kind is None:
        return
    ctx.result["fault"] = kind
    ctx.save()
    if kind == "crash":
        os.abort()
    if kind == "hang":
        time.sleep(3600)
    raise RuntimeError(f"injected fault in {ctx.name}")


# =============================================================== shared helpers
def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _dname(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bench_ms(fn: Callable[[], object], device, rep_ms: int = 40) -> float:
    """Median ms per call: triton's do_bench (CUDA events, L2 flushed between calls) on a
    GPU; one timed call after a warm-up on the CPU (meaningless there, but exercised)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _gen(device, seed: int):
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, device, gen):
    import torch

    return torch.randn(shape, generator=gen, device=device).to(dtype)


def paged_cache(lens: list[int], bs: int, hkv: int, d: int, dtype, device, gen, spare: int = 2):
    """Random K/V caches holding sequences of `lens` tokens in shuffled distinct blocks
    (block 0 and `spare` blocks are never referenced, so their random data must not leak
    into any output). Returns (k_cache, v_cache, block_tables int32)."""
    import torch

    need = [max(1, math.ceil(n / bs)) for n in lens]
    nb = 1 + sum(need) + spare
    kc = _randn((nb, bs, hkv, d), dtype, device, gen)
    vc = _randn((nb, bs, hkv, d), dtype, device, gen)
    perm = (torch.randperm(nb - 1) + 1).tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    return kc, vc, table.to(device)


def forked_group(
    prefix_len: int, suffix_lens: list[int], bs: int, hkv: int, d: int, dtype, device, gen
):
    """A group forked from one ancestor, laid out as the engine's context tree does: the
    prefix's full blocks are shared; a partly filled last prefix block is copied into each
    member's first own block (copy-on-write) before its own tokens follow.

    Returns (k_cache, v_cache, prefix_blocks, member block tables, member lengths)."""
    import torch

    n_full, tail = divmod(prefix_len, bs)
    n_pre = n_full + (1 if tail else 0)
    own = [math.ceil((tail + s) / bs) for s in suffix_lens]
    nb = 1 + n_pre + sum(own)
    kc = _randn((nb, bs, hkv, d), dtype, device, gen)
    vc = _randn((nb, bs, hkv, d), dtype, device, gen)
    prefix_blocks = list(range(1, 1 + n_pre))
    nxt = 1 + n_pre
    rows = []
    for o in own:
        mine = list(range(nxt, nxt + o))
        nxt += o
        if tail:
            kc[mine[0], :tail] = kc[prefix_blocks[-1], :tail]
            vc[mine[0], :tail] = vc[prefix_blocks[-1], :tail]
        rows.append(prefix_blocks[:n_full] + mine)
    table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    lens = [prefix_len + s for s in suffix_lens]
    return kc, vc, prefix_blocks, table.to(device), lens


def poisoned(shape, dtype, device):
    """NaN-filled output: any element no kernel writes fails the comparison."""
    import torch

    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def compare(got, want, atol: float, rtol: float) -> dict[str, Any]:
    """assert_close-style check (equal infinities match, NaN never does) plus the error
    figures: max abs error and ||got - want|| / ||want|| over finite elements."""
    import torch

    g, w = got.double(), want.double()
    eq = g == w
    err = torch.where(eq, torch.zeros_like(g), (g - w).abs())
    bad = ~(eq | (err <= atol + rtol * w.abs()))
    fin = torch.isfinite(g) & torch.isfinite(w)
    diff = (g - w)[fin]
    ref = w[fin]
    return {
        "ok": not bool(bad.any()),
        "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
        "rel_l2": float(diff.norm() / ref.norm()) if ref.numel() and ref.norm() > 0 else 0.0,
        "nan": bool(g.isnan().any()),
    }


def must_read_bytes(tokens: int, hkv: int, d: int, elem: int, n_q: int, hq: int) -> int:
    """The fewest bytes a decode step must move: each K/V row once, q in, output out."""
    return tokens * hkv * d * 2 * elem + 2 * n_q * hq * d * elem


def _free_cuda() -> None:
    """Give cached GPU memory back between cases (a no-op on the CPU, where a full garbage
    collection per case would cost more than the dry run's work)."""
    import gc

    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


# =============================================================== env
PACKAGES = [
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "accelerate",
    "filelock",
    "psutil",
    "pytest",
    "pytest-xdist",
    "pytest-timeout",
    "pytest-asyncio",
    "matplotlib",
    "jinja2",
]


def sec_env(ctx: Ctx) -> None:
    """Versions, the device, nvidia-smi, HBM bandwidth and a bf16 matmul rate."""
    import importlib.metadata as md
    import platform

    import torch

    r = ctx.result
    r["python"] = sys.version.split()[0]
    r["executable"] = sys.executable
    r["platform"] = platform.platform()
    pk = {}
    for name in PACKAGES:
        try:
            pk[name] = md.version(name)
        except md.PackageNotFoundError:
            pk[name] = None
    r["packages"] = pk
    r["torch_cuda"] = torch.version.cuda
    r["cuda_available"] = torch.cuda.is_available()
    r["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    r["git"] = git_info()
    r["nvidia_smi"] = _nvidia_smi(ctx)
    dev = ctx.device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            ctx.fail("no CUDA device visible to torch")
            ctx.summary = "no CUDA device"
            return
        p = torch.cuda.get_device_properties(dev)
        r["device"] = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
        }
    else:
        r["device"] = {"name": "cpu", "threads": torch.get_num_threads()}
    ctx.save()
    nbytes = (8 << 20) if ctx.dry else (2 << 30)
    r["hbm"] = measure_bandwidth(dev, nbytes)
    name = r["device"]["name"]
    sheet = next((v for k, v in DATASHEET_GBPS.items() if k in name), None)
    r["hbm"]["datasheet_gbps"] = sheet
    ctx.save()
    n = 256 if ctx.dry else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, dev, rep_ms=100)
    r["bf16_matmul"] = {"n": n, "ms": ms, "tflops": 2 * n**3 / ms / 1e9}
    h = r["hbm"]
    ctx.summary = (
        f"{name}; torch {pk['torch']}, triton {pk['triton']}; copy "
        f"{h['copy_gbps']:.0f} GB/s, read {h['read_gbps']:.0f} GB/s; bf16 matmul "
        f"{r['bf16_matmul']['tflops']:.0f} TFLOP/s"
    )


def _nvidia_smi(ctx: Ctx) -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"found": False}
    q = (
        "name,driver_version,memory.total,memory.used,pstate,clocks.sm,clocks.max.sm,"
        "clocks.mem,power.draw,power.limit,temperature.gpu"
    )
    out: dict[str, Any] = {"found": True}
    try:
        out["query"] = subprocess.run(
            [exe, f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        full = subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
        ctx.log("nvidia-smi:\n" + full)
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["error"] = repr(exc)
    return out


def measure_bandwidth(device, nbytes: int) -> dict[str, Any]:
    """Device memory bandwidth: a copy (bytes read + written) and a sum (bytes read), on
    random data; the ceiling is the better of the two."""
    import torch

    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t_copy = bench_ms(lambda: dst.copy_(src), device, rep_ms=100)
    t_read = bench_ms(lambda: torch.sum(src), device, rep_ms=100)
    copy = 2 * nbytes / t_copy / 1e6
    read = nbytes / t_read / 1e6
    return {
        "bytes": nbytes,
        "copy_ms": t_copy,
        "copy_gbps": copy,
        "read_ms": t_read,
        "read_gbps": read,
        "ceiling_gbps": max(copy, read),
    }


def ceiling_gbps(ctx: Ctx) -> float:
    """The measured bandwidth from env, or a fresh, smaller measurement."""
    h = ctx.env_result().get("hbm") or {}
    if h.get("ceiling_gbps"):
        return float(h["ceiling_gbps"])
    return measure_bandwidth(ctx.device, (8 << 20) if ctx.dry else (1 << 30))["ceiling_gbps"]


# =============================================================== pytest_kernels
def sec_pytest_kernels(ctx: Ctx) -> None:
    """tests/kernels with compiled kernels (dry run: one file under the interpreter)."""
    import importlib.util

    junit = ctx.work / "pytest_kernels.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    env = dict(os.environ)
    if ctx.dry:
        cmd += ["tests/kernels/test_kernel_merge.py"]
        env["TRITON_INTERPRET"] = "1"
    else:
        # test_kernel_engine needs the SmolLM2 GGUF (it cannot travel; engine_greedy covers
        # the same check); the bench smoke test runs the interpreter (bench_attention runs
        # the real benchmark)
        cmd += [
            "tests/kernels",
            "--ignore=tests/kernels/test_kernel_engine.py",
            "--ignore=tests/kernels/test_kernel_bench_smoke.py",
            "--ignore=tests/kernels/test_gpu_check_dry_run.py",
        ]
        env.pop("TRITON_INTERPRET", None)
        if importlib.util.find_spec("xdist") is not None and ctx.args.pytest_workers > 1:
            cmd += ["-n", str(ctx.args.pytest_workers)]
    ctx.result["command"] = " ".join(cmd[1:])
    ctx.log(ctx.result["command"])
    ctx.save()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=max(5.0, ctx.left()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        text, _ = proc.communicate()
        ctx.partial = True
        ctx.fail(f"pytest did not finish within {ctx.args.box_s:.0f} s")
    print(text[-6000:], flush=True)
    ctx.result["rc"] = proc.returncode
    ctx.result["tail"] = text[-2500:]
    counts = parse_junit(junit)
    ctx.result.update(counts)
    if junit.exists():
        shutil.copy(junit, ctx.out / "pytest_kernels.xml")
    if counts["tests"] == 0:
        ctx.fail("pytest collected no tests")
    elif counts["failures"] or counts["errors"]:
        ctx.fail(f"{counts['failures']} failed, {counts['errors']} errors")
    elif proc.returncode not in (0, None):
        ctx.fail(f"pytest exited with {proc.returncode}")
    ctx.summary = (
        f"{counts['passed']} passed, {counts['failures']} failed, "
        f"{counts['errors']} errors, {counts['skipped']} skipped "
        f"({counts['time_s']:.0f} s)"
    )


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and failing test ids from a JUnit XML report."""
    out: dict[str, Any] = {
        "tests": 0,
        "passed": 0,
        "failures": 0,
        "errors": 0,
        "skipped": 0,
        "time_s": 0.0,
        "failed": [],
    }
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return out
    for case in root.iter("testcase"):
        out["tests"] += 1
        out["time_s"] += float(case.get("time") or 0)
        kinds = {child.tag for child in case}
        name = f"{case.get('classname')}::{case.get('name')}"
        if "failure" in kinds or "error" in kinds:
            key = "failures" if "failure" in kinds else "errors"
            out[key] += 1
            node = case.find("failure") if "failure" in kinds else case.find("error")
            msg = (node.get("message") or "").splitlines()[0][:200] if node is not None else ""
            out["failed"].append(f"{name}: {msg}")
        elif "skipped" in kinds:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    out["failed"] = out["failed"][:30]
    return out


# =============================================================== kernel_sweep
def _sweep_pools(ctx: Ctx):
    import torch

    if ctx.dry:  # the interpreter: fp32/fp16 only (its bf16 tl.dot is wrong), tiny heads
        return [(4, 2, 64), (2, 2, 128)], [16, 32], [torch.float32, torch.float16], None
    heads = [
        HEAD_SHAPES["smollm2"],
        HEAD_SHAPES["llama3-8b"],
        (8, 8, 64),
        (28, 4, 128),
        (64, 8, 128),
    ]  # GQA 3, 4, 1 (MHA), 7 (Qwen2-7B), 8 (Llama-3-70B)
    return heads, [16, 32], [torch.bfloat16, torch.float16], torch.float32


def _case_shape(ctx: Ctx, i: int):
    """Case i's head shape, block size and dtype: cycles through every combination (dtype
    fastest, so even two cases cover both), with every eighth case in fp32 (IEEE dots)."""
    heads, blocks, d16, d32 = _sweep_pools(ctx)
    dtype = d16[i % len(d16)]
    h = heads[(i // len(d16)) % len(heads)]
    bs = blocks[(i // (len(d16) * len(heads))) % len(blocks)]
    if d32 is not None and i % 8 == 7:
        dtype = d32
    return h, bs, dtype


def _edge(rng: random.Random, bs: int, hi: int) -> int:
    """A length at or next to a block boundary (or 1), at most hi."""
    return max(1, min(hi, rng.choice([1, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs + 1])))


def sweep_decode(ctx: Ctx, i: int) -> dict[str, Any]:
    """Paged decode case i: ragged lengths (edges at block boundaries), some with
    kv_start, some with forced split counts."""
    from parrot_backend.kernels.decode import paged_decode_ref, paged_decode_triton

    rng = random.Random(1000 + i)
    (hq, hkv, d), bs, dtype = _case_shape(ctx, i)
    dev = ctx.device
    if ctx.dry:
        n, max_len = rng.choice([1, 3]), 40
    else:
        n = rng.choice([1, 2, 3, 5, 8, 16, 31, 64, 100, 128, 200, 256])
        max_len = min(16384, max(64, 262144 // n))
    lens = [_edge(rng, bs, max_len) if j % 5 == 0 else rng.randint(1, max_len) for j in range(n)]
    kv_start = [rng.randint(0, x) for x in lens] if i % 4 == 3 else None
    splits = {5: 1, 4: 4}.get(i % 6)  # mostly the launcher's own choice
    gen = _gen(dev, i)
    kc, vc, tables = paged_cache(lens, bs, hkv, d, dtype, dev, gen)
    q = _randn((n, hq, d), dtype, dev, gen)
    scale = d**-0.5
    out = poisoned((n, hq, d), dtype, dev)
    got, got_lse = paged_decode_triton(
        q, kc, vc, tables, lens, scale, kv_start=kv_start, num_splits=splits, out=out
    )
    want, want_lse = paged_decode_ref(q, kc, vc, tables, lens, scale, kv_start=kv_start)
    desc = (
        f"hq={hq} hkv={hkv} d={d} bs={bs} {_dname(dtype)} seqs={n} max_len={max(lens)}"
        f"{' kv_start' if kv_start else ''}{f' splits={splits}' if splits else ''}"
    )
    return _verdict(
        desc,
        dtype,
        [("out", got, want, TOL), ("lse", got_lse, want_lse, LSE_TOL)],
        strict=(got, want),
    )


def sweep_extend(ctx: Ctx, i: int) -> dict[str, Any]:
    """Extend case i: fresh prefills, single tokens and long chunks after cached
    contexts."""
    from parrot_backend.kernels.extend import extend_attention_ref, extend_attention_triton

    rng = random.Random(2000 + i)
    (hq, hkv, d), bs, dtype = _case_shape(ctx, i)
    dev = ctx.device
    n = rng.choice([1, 2]) if ctx.dry else rng.choice([1, 2, 3, 5, 8, 16])
    cached, new = [], []
    for _ in range(n):
        if ctx.dry:
            cached.append(rng.choice([0, rng.randint(1, 20)]))
            new.append(rng.choice([1, rng.randint(2, 20)]))
        else:
            cached.append(rng.choice([0, 0, _edge(rng, bs, 4096), rng.randint(1, 4096)]))
            new.append(rng.choice([1, rng.randint(2, 64), rng.randint(65, 512)]))
    lens = [c + m for c, m in zip(cached, new, strict=True)]
    starts = [0]
    for m in new:
        starts.append(starts[-1] + m)
    gen = _gen(dev, 50 + i)
    kc, vc, tables = paged_cache(lens, bs, hkv, d, dtype, dev, gen)
    q = _randn((starts[-1], hq, d), dtype, dev, gen)
    scale = d**-0.5
    out = poisoned(tuple(q.shape), dtype, dev)
    got = extend_attention_triton(q, kc, vc, tables, starts, lens, scale, out=out)
    want = extend_attention_ref(q, kc, vc, tables, starts, lens, scale)
    desc = (
        f"hq={hq} hkv={hkv} d={d} bs={bs} {_dname(dtype)} seqs={n} new={sum(new)} "
        f"max_cached={max(cached)}"
    )
    return _verdict(desc, dtype, [("out", got, want, TOL)], strict=(got, want))


def sweep_shared_prefix(ctx: Ctx, i: int) -> dict[str, Any]:
    """Shared-prefix case i: one forked group (COW tail block when the prefix is not
    block-aligned), checked against its reference and against plain decode."""
    from parrot_backend.kernels.decode import paged_decode_ref
    from parrot_backend.kernels.shared_prefix import (
        shared_prefix_decode_ref,
        shared_prefix_decode_triton,
    )

    rng = random.Random(3000 + i)
    (hq, hkv, d), bs, dtype = _case_shape(ctx, i)
    dev = ctx.device
    if ctx.dry:
        prefix = rng.choice([0, 1, bs + 1, 2 * bs + 3])
        group, smax = rng.choice([1, 3]), 17
    else:  # prefix lengths mostly not block-aligned
        prefix = rng.choice(
            [0, 1, bs - 1, bs, bs + 1, 100, 255, 257, 1000, 1023, 2049, 4097, 8191, 8200]
        )
        group, smax = rng.choice([1, 2, 3, 8, 17, 64, 128, 256]), 64
    suffixes = [rng.randint(1, smax) for _ in range(group)]
    gen = _gen(dev, 100 + i)
    kc, vc, blocks, tables, lens = forked_group(prefix, suffixes, bs, hkv, d, dtype, dev, gen)
    q = _randn((group, hq, d), dtype, dev, gen)
    scale = d**-0.5
    out = poisoned((group, hq, d), dtype, dev)
    got, got_lse = shared_prefix_decode_triton(
        q, kc, vc, tables, lens, prefix, blocks, scale, out=out
    )
    want, want_lse = shared_prefix_decode_ref(q, kc, vc, tables, lens, prefix, blocks, scale)
    # the shared path must also equal plain decode over each member's own (COW) blocks
    plain, _ = paged_decode_ref(q, kc, vc, tables, lens, scale)
    desc = (
        f"hq={hq} hkv={hkv} d={d} bs={bs} {_dname(dtype)} prefix={prefix} "
        f"group={group} max_suffix={max(suffixes)}"
    )
    return _verdict(
        desc,
        dtype,
        [
            ("out", got, want, TOL),
            ("lse", got_lse, want_lse, LSE_TOL),
            ("vs_plain", got, plain, TOL),
        ],
        strict=(got, want),
    )


def sweep_kv_store(ctx: Ctx, i: int) -> dict[str, Any]:
    """KV store case i: exact equality with the reference, padding slots skipped, some
    rows strided (fused qkv) or cast from fp32."""
    import torch

    from parrot_backend.kernels.kv_store import store_kv_ref, store_kv_triton

    rng = random.Random(4000 + i)
    (_, hkv, d), bs, dtype = _case_shape(ctx, i)
    dev = ctx.device
    t = rng.choice([1, 5, 20]) if ctx.dry else rng.choice([1, 7, 16, 100, 512, 2048])
    nb = math.ceil(t * 1.5 / bs) + 2
    slots = torch.randperm(nb * bs)[:t]
    slots[torch.rand(t) < 0.1] = -1  # padding rows are skipped
    slots = slots.to(dev)
    gen = _gen(dev, 150 + i)
    src_dtype = torch.float32 if i % 5 == 4 else dtype  # casting into the cache dtype
    if i % 3 == 2:  # k and v sliced out of one fused projection: row stride > row
        fused = _randn((t, 3 * hkv, d), src_dtype, dev, gen)
        k, v = fused[:, hkv : 2 * hkv], fused[:, 2 * hkv :]
    else:
        k, v = _randn((t, hkv, d), src_dtype, dev, gen), _randn((t, hkv, d), src_dtype, dev, gen)
    caches = [poisoned((nb, bs, hkv, d), dtype, dev) for _ in range(4)]
    store_kv_ref(k, v, caches[0], caches[1], slots)
    store_kv_triton(k, v, caches[2], caches[3], slots)
    exact = all(
        torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())
        for a, b in ((caches[2], caches[0]), (caches[3], caches[1]))
    )
    desc = (
        f"hkv={hkv} d={d} bs={bs} {_dname(dtype)} tokens={t}"
        f"{' strided' if i % 3 == 2 else ''}{' from-fp32' if i % 5 == 4 else ''}"
    )
    return {
        "desc": desc,
        "dtype": _dname(dtype),
        "ok": exact,
        "strict": exact,
        "max_abs": 0.0 if exact else float("nan"),
        "rel_l2": 0.0 if exact else float("nan"),
        "checks": {"exact": exact},
    }


def sweep_merge(ctx: Ctx, i: int) -> dict[str, Any]:
    """Merge case i: random partial states, some empty, one row with no keys at all."""
    import torch

    from parrot_backend.kernels.merge import merge_states_ref, merge_states_triton

    rng = random.Random(5000 + i)
    (hq, _, d), _, dtype = _case_shape(ctx, i)
    dev = ctx.device
    parts = rng.randint(1, 3 if ctx.dry else 8)
    rows = rng.choice([1, 3]) if ctx.dry else rng.choice([1, 5, 64, 256])
    gen = _gen(dev, 200 + i)
    o = _randn((parts, rows, hq, d), torch.float32, dev, gen)
    lse = _randn((parts, rows, hq), torch.float32, dev, gen) * 4
    empty = torch.rand(parts, rows, hq, generator=gen, device=dev) < 0.15
    lse = lse.masked_fill(empty, float("-inf"))  # parts with no keys
    lse[:, 0, 0] = float("-inf")  # a row with no keys at all: o = 0, lse = -inf
    o[:, 0, 0] = 0.0
    out = poisoned((rows, hq, d), dtype, dev)
    got, got_lse = merge_states_triton(o, lse, dtype, out=out)
    want, want_lse = merge_states_ref(o, lse, dtype)
    desc = f"hq={hq} d={d} {_dname(dtype)} parts={parts} rows={rows}"
    return _verdict(
        desc,
        dtype,
        [("out", got, want, TOL), ("lse", got_lse, want_lse, LSE_TOL)],
        strict=(got, want),
    )


def _verdict(desc: str, dtype, checks, strict) -> dict[str, Any]:
    name = _dname(dtype)
    res = {k: compare(g, w, *tol[name]) for k, g, w, tol in checks}
    s = compare(*strict, *STRICT[name])
    return {
        "desc": desc,
        "dtype": name,
        "ok": all(r["ok"] for r in res.values()),
        "strict": s["ok"],
        "max_abs": res["out"]["max_abs"],
        "rel_l2": res["out"]["rel_l2"],
        "checks": {k: r["ok"] for k, r in res.items()},
    }


SWEEPS = {
    "kv_store": sweep_kv_store,
    "paged_decode": sweep_decode,
    "extend": sweep_extend,
    "shared_prefix": sweep_shared_prefix,
    "merge": sweep_merge,
}


def sec_kernel_sweep(ctx: Ctx) -> None:
    """Each kernel vs its torch reference on `--sweep-cases` shapes (NaN-poisoned outputs)."""
    n = ctx.args.sweep_cases
    per: dict[str, Any] = {}
    ctx.result["tolerances"] = {"out": TOL, "lse": LSE_TOL, "strict": STRICT}
    ctx.result["kernels"] = per
    total = failed = 0
    stop = False
    # interleave the kernels so a short box still covers each of them
    for i in range(n):
        for kname, fn in SWEEPS.items():
            if not ctx.enough(2.0):
                stop = True
                break
            k = per.setdefault(
                kname,
                {
                    "cases": 0,
                    "passed": 0,
                    "strict_passed": 0,
                    "max_abs_err": 0.0,
                    "max_rel_l2": 0.0,
                    "worst": "",
                    "rows": [],
                },
            )
            try:
                row = fn(ctx, i)
            except Exception as exc:  # a launch error is a failed case, not the section
                row = {
                    "desc": f"case {i}",
                    "ok": False,
                    "strict": False,
                    "max_abs": float("nan"),
                    "rel_l2": float("nan"),
                    "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                }
            k["cases"] += 1
            k["passed"] += row["ok"]
            k["strict_passed"] += row["strict"]
            total += 1
            if row["rel_l2"] == row["rel_l2"] and row["rel_l2"] >= k["max_rel_l2"]:
                k["max_rel_l2"], k["worst"] = row["rel_l2"], row["desc"]
            if row["max_abs"] == row["max_abs"]:
                k["max_abs_err"] = max(k["max_abs_err"], row["max_abs"])
            if not row["ok"]:
                failed += 1
                ctx.fail(f"{kname} {row['desc']}: {row.get('error') or row.get('checks')}")
            k["rows"].append(row)
        ctx.save()
        _free_cuda()
        if stop:
            break
    ctx.result["cases"] = total
    ctx.summary = f"{len(per)} kernels, {total} cases ({n} per kernel asked), {failed} failed"


# =============================================================== models
def model_config(kind: str, dry: bool, layers: int | None = None):
    """A LlamaConfig: `smollm2` (SmolLM2-135M's shape) or `llama3-8b` (Llama-3-8B's);
    tiny stand-ins in a dry run; `peaked` (2 layers, a small vocab) for greedy checks.

    Weights get std 5/sqrt(hidden): activations stay O(1) in fp16 while the logits spread
    over ~5 units, so greedy picks rarely hinge on near-ties."""
    from transformers import LlamaConfig

    if dry:
        shapes = {
            "smollm2": dict(
                vocab_size=512,
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                rope_theta=100000.0,
            ),
            "llama3-8b": dict(
                vocab_size=768,
                hidden_size=128,
                intermediate_size=384,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                tie_word_embeddings=False,
                rope_theta=500000.0,
            ),
            "peaked": dict(
                vocab_size=512,
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                rope_theta=10000.0,
            ),
        }
    else:
        shapes = {
            "smollm2": dict(
                vocab_size=49152,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                tie_word_embeddings=True,
                rope_theta=100000.0,
            ),
            "llama3-8b": dict(
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                tie_word_embeddings=False,
                rope_theta=500000.0,
            ),
            "peaked": dict(
                vocab_size=4096,
                hidden_size=512,
                intermediate_size=1024,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                rope_theta=10000.0,
            ),
        }
    kw = dict(shapes[kind])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    return LlamaConfig(
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=5.0 / math.sqrt(kw["hidden_size"]),
        architectures=["LlamaForCausalLM"],
        **kw,
    )


def model_label(kind: str, dry: bool, layers: int | None = None) -> str:
    """How a model is named in the report."""
    base = {
        "smollm2": "SmolLM2-135M-shape",
        "llama3-8b": "Llama-3-8B-shape",
        "peaked": "peaked-2L",
    }[kind]
    if dry:
        base = f"tiny {base}"
    return base + (f" ({layers} layers)" if layers is not None else "")


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer ("t<id>") for any vocabulary size, built offline: random-
    weight models need no real one, and none can travel to the GPU machine."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(1, vocab_size)}
    vocab["<unk>"] = 0
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="t1", eos_token="t2"
    )


def save_random_checkpoint(cfg, path: Path, device, seed: int) -> Path:
    """A random Llama saved with transformers (bf16 safetensors + tokenizer), so engine and
    reference load the very same weights through their own loaders."""
    import torch
    from transformers import LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(path))
    synthetic_tokenizer(cfg.vocab_size).save_pretrained(str(path))
    del model
    _free_cuda()
    return path


def engine_in_memory(cfg, dtype, device, *, num_blocks: int, seed: int, max_num_seqs: int = 64):
    """An Engine over a random model built directly in device memory (a Llama-3-8B would
    take minutes to initialise on the CPU and 16 GB to save and load)."""
    import torch

    from parrot_backend.engine.engine import Engine, EngineConfig, compute_executor
    from parrot_backend.engine.models.llama import LlamaForCausalLM, Rotary

    def build():
        max_pos = cfg.max_position_embeddings
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, max_pos).to(dtype)
        model = model.to_empty(device=device)
        gen = _gen(device, seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # RMSNorm weights (Llama has no biases)
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, cfg.initializer_range, generator=gen)
        model.model.rotary = Rotary(cfg, max_pos).to(device)
        model.fuse()
        config = EngineConfig(
            model="random",
            dtype=_dname(dtype),
            device=str(device),
            num_blocks=num_blocks,
            prefix_cache=False,
            attention_backend="torch",
            max_num_seqs=max_num_seqs,
        )
        return Engine(
            model.eval(),
            cfg,
            synthetic_tokenizer(cfg.vocab_size),
            config,
            device=device,
            dtype=dtype,
            model_name="random",
        )

    return compute_executor().submit(build).result()


def load_engine(path: Path, dtype_name: str, backend: str, device, num_blocks: int):
    """An Engine over a saved checkpoint, through the engine's own loader."""
    from parrot_backend.engine.engine import Engine

    return Engine.from_pretrained(
        path,
        dtype=dtype_name,
        device=str(device),
        attention_backend=backend,
        num_blocks=num_blocks,
        prefix_cache=False,
        progress=False,
    )


def step_logits(engine, cid, tokens: list[int]):
    """Append tokens to a context by hand and return the logits of every new position
    (prefill when many, decode when one), bypassing sampling."""
    from parrot_backend.engine.context import Context, Request
    from parrot_backend.engine.engine import compute_executor
    from parrot_backend.engine.scheduler import Work

    def run():
        ctx = engine.contexts.get(cid)
        if ctx is None:
            ctx = Context(cid, None, None, engine.pool.block_size)
            engine.contexts[cid] = ctx
        start = ctx.num_computed
        ctx.tokens.extend(tokens)
        req = Request("fill", ctx)
        if not engine.scheduler._reserve(req, start, len(tokens), set()):
            raise RuntimeError("KV pool too small for the logits probe")
        logits = engine.runner.logits_for([Work(req, start, len(tokens))])
        ctx.num_computed += len(tokens)
        return logits

    return compute_executor().submit(run).result()


def drop_context(engine, cid) -> None:
    """Free a context made by `step_logits` (the engine loop is not running)."""
    ctx = engine.contexts.pop(cid, None)
    if ctx is not None:
        for b in ctx.blocks:
            engine.pool.decref(b)
        ctx.blocks = []


def logit_metrics(got, ref) -> dict[str, float]:
    """Relative L2 and max abs error of logits, and how often the argmax agrees."""
    g, r = got.float(), ref.float()
    return {
        "rel_l2": float((g - r).norm() / r.norm()),
        "max_abs": float((g - r).abs().max()),
        "top1": float((g.argmax(-1) == r.argmax(-1)).float().mean()),
        "nan": bool(g.isnan().any()),
    }


# =============================================================== engine_logits
def sec_engine_logits(ctx: Ctx) -> None:
    """Engine logits (prefill through the paged cache, then single-token decode steps) vs
    transformers in fp32 on the same random weights, per dtype and attention backend."""
    import torch
    from transformers import AutoModelForCausalLM

    from parrot_backend.engine.attention import make_backend

    dev = ctx.device
    p_len, d_len = (20, 4) if ctx.dry else (100, 12)  # 100: not block-aligned
    models = [("smollm2", None), ("llama3-8b", 2)]  # the 8B shape with 2 of its 32 layers
    if ctx.dry:
        models = models[1:]  # the same code path; the dry run must stay short
    rows = ctx.result.setdefault("rows", [])
    ctx.result["positions"] = {"prefill": p_len, "decode": d_len}
    ctx.result["criterion"] = (
        "rel L2 vs fp32 transformers <= max(2 x transformers' own "
        f"rel L2 in that dtype, floor {LOGIT_FLOOR})"
    )
    for mi, (kind, layers) in enumerate(models):
        if not ctx.enough(10):
            break
        cfg = model_config(kind, ctx.dry, layers)
        label = model_label(kind, ctx.dry, layers)
        ckpt = save_random_checkpoint(cfg, ctx.work / f"ckpt-{kind}-{layers}", dev, seed=mi)
        g = torch.Generator().manual_seed(7 + mi)
        ids = torch.randint(3, cfg.vocab_size, (p_len + d_len,), generator=g)

        def hf_logits(dtype, ckpt=ckpt, ids=ids):
            model = AutoModelForCausalLM.from_pretrained(
                str(ckpt), dtype=dtype, device_map=str(dev) if dev.type == "cuda" else None
            )
            with torch.no_grad():
                out = model(ids[None].to(dev)).logits[0].float()
            del model
            _free_cuda()
            return out

        ref = hf_logits(torch.float32)
        for dname in ctx.dtypes:
            if not ctx.enough(5):
                break
            dtype = _torch_dtype(dname)
            hf = (
                logit_metrics(hf_logits(dtype), ref)
                if dtype != torch.float32
                else {"rel_l2": 0.0, "max_abs": 0.0, "top1": 1.0, "nan": False}
            )
            eng = load_engine(ckpt, dname, "triton", dev, num_blocks=64)
            for backend in ("triton", "torch"):
                # one engine, two backends: the same weights and KV pool, a context each
                eng.runner.backend = make_backend(backend)
                pre = step_logits(eng, backend, ids[:p_len].tolist())
                dec = [step_logits(eng, backend, [t])[0] for t in ids[p_len:].tolist()]
                ours = torch.cat([pre, torch.stack(dec)])
                m = logit_metrics(ours, ref)
                bound = max(2 * hf["rel_l2"], LOGIT_FLOOR[dname])
                ok = m["rel_l2"] <= bound and not m["nan"]
                rows.append(
                    {
                        "model": label,
                        "dtype": dname,
                        "backend": backend,
                        **m,
                        "hf_rel_l2": hf["rel_l2"],
                        "hf_top1": hf["top1"],
                        "bound": bound,
                        "ok": ok,
                        "decode_rel_l2": logit_metrics(ours[p_len:], ref[p_len:])["rel_l2"],
                    }
                )
                if not ok:
                    ctx.fail(f"{label} {dname} {backend}: rel L2 {m['rel_l2']:.3g} > {bound:.3g}")
                ctx.log(
                    f"{label} {dname} {backend}: rel {m['rel_l2']:.3g} (hf "
                    f"{hf['rel_l2']:.3g}) top1 {m['top1']:.3f}"
                )
                ctx.save()
            del eng
            _free_cuda()
        del ref
        _free_cuda()
    worst = max((r["rel_l2"] / r["bound"] for r in rows), default=float("nan"))
    ctx.summary = (
        f"{len(rows)} engine runs, {sum(r['ok'] for r in rows)} within bound; "
        f"worst error {worst:.2f} of its bound"
    )


# =============================================================== engine_greedy
def counting_backend(gate: str):
    """A TritonAttention whose sharing gate is real, always or never, counting the decode
    rows the engine puts into prefix groups (so a run proves the shared path ran)."""
    from parrot_backend.engine.triton_attention import TritonAttention

    class Counting(TritonAttention):
        def __init__(self) -> None:
            super().__init__()
            self.gate = gate
            self.grouped_rows = 0

        def share_prefix(self, prefix_len, group_size):
            if self.gate == "always":
                return True
            if self.gate == "never":
                return False
            return super().share_prefix(prefix_len, group_size)

        def forward(self, q, k_cache, v_cache, meta, scale):
            if "gpu-check-counted" not in meta.cache:  # once per step, not per layer
                meta.cache["gpu-check-counted"] = True
                self.grouped_rows += sum(len(g.seq_indices) for g in meta.prefix_groups)
            return super().forward(q, k_cache, v_cache, meta, scale)

    return Counting()


async def _forked_tokens(
    engine, prefix: list[int], suffixes: list[list[int]], n_new: int, fork: bool
) -> list[list[int]]:
    """Children of one filled parent (fork) or whole prompts (unshared) generate greedily
    together; returns each one's tokens. Frees everything it made."""
    from parrot_backend.contract.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=n_new, ignore_eos=True)
    async with engine:
        if fork:
            await engine.fill("parent", None, prefix)

        async def child(i, s):
            if fork:
                await engine.fill(f"c{i}", "parent", s)
            else:
                await engine.fill(f"c{i}", None, prefix + s)
            return [d.token_id async for d in engine.generate(f"c{i}", None, sampling)]

        outs = await asyncio.gather(*(child(i, s) for i, s in enumerate(suffixes)))
        for i in range(len(suffixes)):
            await engine.free(f"c{i}")
        if fork:
            await engine.free("parent")
    return outs


def _near_tie(engine, backends, a: str, b: str, prompt: list[int], ta: int, tb: int) -> bool:
    """vLLM's check for diverging greedy outputs: each side's token must be among the other
    side's top-k at the first differing position."""
    import torch

    tops = {}
    for name in (a, b):
        engine.runner.backend = backends[name]
        logits = step_logits(engine, "probe", prompt)[-1]
        drop_context(engine, "probe")
        tops[name] = set(torch.topk(logits, TOPK_TIE).indices.tolist())
    return tb in tops[a] and ta in tops[b]


def sec_engine_greedy(ctx: Ctx) -> None:
    """Greedy tokens through the engine: Triton vs torch backend, the shared-prefix path vs
    plain paged decode, forked children vs the same prompts unshared."""
    import torch

    from parrot_backend.engine.attention import TorchAttention

    dev = ctx.device
    if ctx.dry:  # the real gate wants >= 256 prefix tokens and 8 sequences: force it here
        prefix_len, suffix_lens, n_new, gate = 36, [5, 1], 4, "always"
    else:
        prefix_len, n_new, gate = 300, 24, "real"
        suffix_lens = [1, 2, 3, 5, 8, 13, 16, 17, 20, 7, 11, 4]
    plan = [
        ("peaked", ["float32", *[d for d in ctx.dtypes if d != "float32"]]),
        ("smollm2", ctx.dtypes),
    ][: 1 if ctx.dry else 2]
    ctx.result.update(
        {
            "prefix_len": prefix_len,
            "children": len(suffix_lens),
            "new_tokens": n_new,
            "gate": gate,
            "runs": [],
            "comparisons": [],
        }
    )
    pairs = [
        ("triton/fork", "torch/fork", "Triton vs torch backend"),
        ("triton_plain/fork", "torch/fork", "Triton plain decode vs torch"),
        ("triton/fork", "triton_plain/fork", "shared-prefix path vs plain decode"),
        ("triton/fork", "triton/unshared", "fork vs unshared (Triton)"),
        ("torch/fork", "torch/unshared", "fork vs unshared (torch)"),
    ]
    for mi, (kind, dtypes) in enumerate(plan):
        cfg = model_config(kind, ctx.dry)
        label = model_label(kind, ctx.dry)
        if not ctx.enough(10):
            break
        ckpt = save_random_checkpoint(cfg, ctx.work / f"ckpt-greedy-{kind}", dev, seed=10 + mi)
        g = torch.Generator().manual_seed(3 + mi)
        prefix = torch.randint(3, cfg.vocab_size, (prefix_len,), generator=g).tolist()
        suffixes = [
            torch.randint(3, cfg.vocab_size, (k,), generator=g).tolist() for k in suffix_lens
        ]
        for dname in dtypes:
            if not ctx.enough(8):
                break
            eng = load_engine(ckpt, dname, "torch", dev, num_blocks=512)
            backends = {
                "torch": TorchAttention(),
                "triton": counting_backend(gate),
                "triton_plain": counting_backend("never"),
            }
            outs: dict[str, list[list[int]]] = {}
            for run in (
                "torch/fork",
                "torch/unshared",
                "triton/fork",
                "triton/unshared",
                "triton_plain/fork",
            ):
                bname, mode = run.split("/")
                eng.runner.backend = backends[bname]
                t0 = time.perf_counter()
                outs[run] = asyncio.run(
                    _forked_tokens(eng, prefix, suffixes, n_new, mode == "fork")
                )
                ctx.result["runs"].append(
                    {
                        "model": label,
                        "dtype": dname,
                        "run": run,
                        "s": round(time.perf_counter() - t0, 3),
                    }
                )
            grouped = backends["triton"].grouped_rows
            if grouped == 0:
                ctx.fail(f"{label} {dname}: no decode step took the shared-prefix path")
            for a, b, what in pairs:
                diff = [i for i, (x, y) in enumerate(zip(outs[a], outs[b], strict=True)) if x != y]
                ties_ok = True
                for i in diff:  # the first divergence of each sequence (later ones follow)
                    j = next(
                        k
                        for k, (x, y) in enumerate(zip(outs[a][i], outs[b][i], strict=True))
                        if x != y
                    )
                    prompt = prefix + suffixes[i] + outs[a][i][:j]
                    ties_ok &= _near_tie(
                        eng,
                        backends,
                        a.split("/")[0],
                        b.split("/")[0],
                        prompt,
                        outs[a][i][j],
                        outs[b][i][j],
                    )
                ok = not diff or ties_ok
                n_tok = sum(len(x) for x in outs[a])
                same_tok = sum(
                    p == q
                    for x, y in zip(outs[a], outs[b], strict=True)
                    for p, q in zip(x, y, strict=True)
                )
                ctx.result["comparisons"].append(
                    {
                        "model": label,
                        "dtype": dname,
                        "what": what,
                        "a": a,
                        "b": b,
                        "identical": not diff,
                        "seqs_differ": len(diff),
                        "token_match": same_tok / max(1, n_tok),
                        "near_ties_ok": ties_ok,
                        "ok": ok,
                        "grouped_rows": grouped,
                    }
                )
                if not ok:
                    ctx.fail(
                        f"{label} {dname} {what}: {len(diff)} sequences differ, "
                        f"not explained by near-ties"
                    )
            ctx.log(
                f"{label} {dname}: grouped rows {grouped}; "
                + ", ".join(
                    f"{c['what']}={'same' if c['identical'] else 'DIFF'}"
                    for c in ctx.result["comparisons"][-len(pairs) :]
                )
            )
            del eng, backends
            _free_cuda()
            ctx.save()
    comps = ctx.result["comparisons"]
    ctx.summary = (
        f"{len(comps)} comparisons, {sum(c['identical'] for c in comps)} "
        f"identical, {sum(not c['ok'] for c in comps)} failed"
    )


# =============================================================== kernel_speed
def sec_kernel_speed(ctx: Ctx) -> None:
    """Paged / shared-prefix decode against the measured HBM ceiling; shared vs
    per-sequence at 8k x 64; where sharing starts to pay vs what the gate picks."""
    import torch

    from parrot_backend.engine.triton_attention import (
        MIN_SHARED_GROUP_SIZE,
        MIN_SHARED_PREFIX_LEN,
        should_share_prefix,
    )
    from parrot_backend.kernels.decode import plan_decode, run_decode
    from parrot_backend.kernels.shared_prefix import (
        GroupSpec,
        plan_shared_prefix,
        run_shared_prefix,
    )

    dev = ctx.device
    dtype = torch.float16 if ctx.dry else torch.bfloat16
    elem = torch.tensor([], dtype=dtype).element_size()
    ceil = ceiling_gbps(ctx)
    bs, suffix = 16, (5 if ctx.dry else 32)
    r = ctx.result
    r.update(
        {
            "dtype": _dname(dtype),
            "ceiling_gbps": ceil,
            "suffix": suffix,
            "gate": {"min_prefix": MIN_SHARED_PREFIX_LEN, "min_group": MIN_SHARED_GROUP_SIZE},
            "paged": [],
            "shared": [],
            "crossover": [],
            "goals": [],
        }
    )
    shapes = {"smollm2": (4, 2, 64), "llama3-8b": (8, 2, 128)} if ctx.dry else HEAD_SHAPES

    def decode_fn(q, kc, vc, tables, lens, group, hkv):
        plan = plan_decode(range(len(lens)), lens, None, group, hkv, dev, dtype=dtype)
        return lambda: run_decode(plan, q, kc, vc, tables, q.shape[-1] ** -0.5)

    def group_case(shape, prefix, n, seed):
        hq, hkv, d = shape
        kc, vc, blocks, tables, lens = forked_group(
            prefix, [suffix] * n, bs, hkv, d, dtype, dev, _gen(dev, seed)
        )
        q = _randn((n, hq, d), dtype, dev, _gen(dev, seed + 1))
        plan = plan_shared_prefix(
            [GroupSpec(list(range(n)), lens, prefix, blocks)], hq // hkv, hkv, bs, dev, dtype=dtype
        )

        def shared():
            return run_shared_prefix(plan, q, kc, vc, tables, d**-0.5)

        plain = decode_fn(q, kc, vc, tables, lens, hq // hkv, hkv)
        t_sh, t_pl = bench_ms(shared, dev), bench_ms(plain, dev)
        return t_sh, t_pl, must_read_bytes(prefix + n * suffix, hkv, d, elem, n, hq)

    paged_cfg = (
        [(2, 40)] if ctx.dry else [(1, 32768), (8, 8192), (64, 4096), (64, 8192), (256, 2048)]
    )
    for sname, (hq, hkv, d) in shapes.items():
        for n, ctx_len in paged_cfg:
            if not ctx.enough(3):
                raise Deadline
            lens = [ctx_len] * n
            kc, vc, tables = paged_cache(lens, bs, hkv, d, dtype, dev, _gen(dev, n))
            q = _randn((n, hq, d), dtype, dev, _gen(dev, n + 1))
            ms = bench_ms(decode_fn(q, kc, vc, tables, lens, hq // hkv, hkv), dev)
            nbytes = must_read_bytes(n * ctx_len, hkv, d, elem, n, hq)
            r["paged"].append(
                {
                    "shape": sname,
                    "seqs": n,
                    "context": ctx_len,
                    "ms": ms,
                    "MB": nbytes / 1e6,
                    "gbps": nbytes / ms / 1e6,
                    "frac": nbytes / ms / 1e6 / ceil,
                }
            )
            del kc, vc, q
            _free_cuda()
        ctx.save()
    shared_cfg = (
        [(40, 3)] if ctx.dry else [(8192, 64), (8192, 256), (32768, 64), (2048, 64), (8192, 8)]
    )
    for sname, shape in shapes.items():
        for prefix, n in shared_cfg:
            if not ctx.enough(3):
                raise Deadline
            t_sh, t_pl, nbytes = group_case(shape, prefix, n, prefix + n)
            r["shared"].append(
                {
                    "shape": sname,
                    "prefix": prefix,
                    "group": n,
                    "shared_ms": t_sh,
                    "paged_ms": t_pl,
                    "speedup": t_pl / t_sh,
                    "MB": nbytes / 1e6,
                    "gbps": nbytes / t_sh / 1e6,
                    "frac": nbytes / t_sh / 1e6 / ceil,
                }
            )
            _free_cuda()
        ctx.save()
    prefixes = [16, 40] if ctx.dry else [32, 64, 128, 256, 512, 1024, 2048]
    groups = [3] if ctx.dry else [2, 4, 8, 16, 32, 64]
    for sname, shape in shapes.items():
        for n in groups:
            pts = []
            for prefix in prefixes:
                if not ctx.enough(3):
                    raise Deadline
                t_sh, t_pl, _ = group_case(shape, prefix, n, 7 * prefix + n)
                pts.append(
                    {
                        "prefix": prefix,
                        "shared_ms": t_sh,
                        "paged_ms": t_pl,
                        "gate_shares": should_share_prefix(prefix, n),
                    }
                )
            # sharing pays from the smallest prefix after which it always wins
            wins = [p["shared_ms"] <= p["paged_ms"] for p in pts]
            cross = next((pts[k]["prefix"] for k in range(len(pts)) if all(wins[k:])), None)
            slower = [
                p["prefix"]
                for p in pts
                if p["gate_shares"] and p["shared_ms"] > 1.05 * p["paged_ms"]
            ]
            missed = [
                p["prefix"]
                for p in pts
                if not p["gate_shares"] and 1.2 * p["shared_ms"] < p["paged_ms"]
            ]
            r["crossover"].append(
                {
                    "shape": sname,
                    "group": n,
                    "crossover_prefix": cross,
                    "gate_slower_at": slower,
                    "gate_missed_at": missed,
                    "points": pts,
                }
            )
        ctx.save()
    if ctx.dry:
        r["goals"].append({"goal": "not evaluated: CPU timings are meaningless", "met": None})
    else:
        r["goals"] = speed_goals(r)
    best = max((row["frac"] for row in r["paged"] + r["shared"]), default=0.0)
    x8k = [row["speedup"] for row in r["shared"] if row["prefix"] == 8192 and row["group"] == 64]
    ctx.summary = (
        f"ceiling {ceil:.0f} GB/s; best {100 * best:.0f}% of it; "
        + (f"8k x 64 speedup {min(x8k):.1f}x; " if x8k else "")
        + f"{sum(bool(c['gate_slower_at']) for c in r['crossover'])} gate misses"
    )


def speed_goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's speed goals, judged from kernel_speed's rows: >= 10x over per-sequence
    decode at an 8k prefix x 64 sequences, >= 80% of the bandwidth for long prefixes, and a
    gate that never picks the shared path where it is more than 5% slower than plain."""
    goals = []
    for row in r["shared"]:
        if row["prefix"] == 8192 and row["group"] == 64:
            goals.append(
                {
                    "goal": f"{row['shape']}: shared >= 10x per-sequence at 8k x 64",
                    "value": round(row["speedup"], 2),
                    "met": row["speedup"] >= 10,
                }
            )
        if row["prefix"] >= 8192:
            goals.append(
                {
                    "goal": f"{row['shape']}: shared-prefix at >= 80% of bandwidth "
                    f"({row['prefix']} x {row['group']})",
                    "value": round(row["frac"], 3),
                    "met": row["frac"] >= 0.8,
                }
            )
    bad = [f"{c['shape']} group {c['group']}" for c in r["crossover"] if c["gate_slower_at"]]
    goals.append(
        {
            "goal": "the gate never picks shared where it is >5% slower than plain"
            + (f" (misses: {', '.join(bad)})" if bad else ""),
            "value": len(bad),
            "met": not bad,
        }
    )
    return goals


# =============================================================== bench_attention
def sec_bench_attention(ctx: Ctx) -> None:
    """Run benchmarks/kernels/bench_attention.py and keep its CSV, plot and table."""
    script = ROOT / "benchmarks" / "kernels" / "bench_attention.py"
    tmp = ctx.work / "bench_attention"
    cmd = [sys.executable, str(script), "--out-dir", str(tmp)]
    env = dict(os.environ)
    if ctx.dry:
        cmd += ["--smoke", "--shapes", "smollm2"]
        env["TRITON_INTERPRET"] = "1"
    else:
        # a coarser grid than its default (kernel_speed has the fine one): it writes its CSV
        # only at the end, so it must finish inside its box
        cmd += [
            "--dtype",
            "bf16",
            "--reps",
            "40",
            "--peak-gbps",
            f"{ceiling_gbps(ctx):.0f}",
            "--prefix-lens",
            "64",
            "256",
            "1024",
            "4096",
            "8192",
            "32768",
            "--group-sizes",
            "1",
            "8",
            "16",
            "64",
            "256",
        ]
    ctx.result["command"] = " ".join(["benchmarks/kernels/bench_attention.py", *cmd[2:]])
    ctx.save()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=max(5.0, ctx.left()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        text, _ = proc.communicate()
        ctx.partial = True
    print(text[-8000:], flush=True)
    ctx.result["rc"] = proc.returncode
    ctx.result["tail"] = text[-6000:]
    rows = []
    for path in sorted(tmp.glob("bench_attention_*.csv")):
        with path.open() as f:
            rows = list(csv.DictReader(f))
        shutil.copy(path, ctx.out / "bench_attention.csv")
    for path in sorted(tmp.glob("bench_attention_*.png")):
        shutil.copy(path, ctx.out / "bench_attention.png")
    ctx.result["rows"] = rows
    if proc.returncode != 0:
        ctx.fail(f"bench_attention.py exited with {proc.returncode}")
    elif not rows:
        ctx.fail("bench_attention.py wrote no CSV rows")
    ctx.summary = f"{len(rows)} rows (rc {proc.returncode})"


# =============================================================== engine_throughput
async def _decode_rate(engine, prompts: list[list[int]], n_new: int) -> dict[str, float]:
    """Fill every prompt, then time their greedy generations running together."""
    from parrot_backend.contract.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=n_new, ignore_eos=True)
    async with engine:
        await asyncio.gather(*(engine.fill(f"p{i}", None, p) for i, p in enumerate(prompts)))
        steps0 = engine.steps
        t0 = time.perf_counter()

        async def gen(i):
            return len([d async for d in engine.generate(f"p{i}", None, sampling)])

        n = sum(await asyncio.gather(*(gen(i) for i in range(len(prompts)))))
        elapsed = time.perf_counter() - t0
        steps = engine.steps - steps0
        for i in range(len(prompts)):
            await engine.free(f"p{i}")
    return {
        "tokens": n,
        "s": elapsed,
        "tok_s": n / elapsed,
        "ms_per_step": 1e3 * elapsed / max(1, steps),
        "steps": steps,
    }


async def _fork_rate(
    engine, prefix: list[int], suffixes: list[list[int]], n_new: int
) -> dict[str, float]:
    """Children of one filled parent decode together (timed after all fills)."""
    from parrot_backend.contract.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=n_new, ignore_eos=True)
    async with engine:
        await engine.fill("parent", None, prefix)
        await asyncio.gather(*(engine.fill(f"c{i}", "parent", s) for i, s in enumerate(suffixes)))
        steps0 = engine.steps
        t0 = time.perf_counter()

        async def gen(i):
            return len([d async for d in engine.generate(f"c{i}", None, sampling)])

        n = sum(await asyncio.gather(*(gen(i) for i in range(len(suffixes)))))
        elapsed = time.perf_counter() - t0
        steps = engine.steps - steps0
        for i in range(len(suffixes)):
            await engine.free(f"c{i}")
        await engine.free("parent")
    return {
        "tokens": n,
        "s": elapsed,
        "tok_s": n / elapsed,
        "ms_per_step": 1e3 * elapsed / max(1, steps),
        "steps": steps,
    }


def sec_engine_throughput(ctx: Ctx) -> None:
    """Decode tokens/s at batch 1/8/64 with the torch (SDPA) and Triton backends on the same
    model, and forked children of a long prefix with and without the shared-prefix path."""
    import torch

    from parrot_backend.engine.attention import TorchAttention

    dev = ctx.device
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    batches = [1, 2] if ctx.dry else [1, 8, 64]
    p_len, n_new = (12, 3) if ctx.dry else (128, 64)
    f_prefix, f_children, f_suffix, f_new = (36, 2, 5, 2) if ctx.dry else (2048, 64, 16, 32)
    gate = "always" if ctx.dry else "real"
    r = ctx.result
    r.update(
        {
            "dtype": _dname(dtype),
            "prompt_tokens": p_len,
            "new_tokens": n_new,
            "rows": [],
            "fork": {
                "prefix": f_prefix,
                "children": f_children,
                "suffix": f_suffix,
                "new_tokens": f_new,
                "gate": gate,
                "rows": [],
            },
        }
    )
    for mi, kind in enumerate(("smollm2", "llama3-8b")[: 1 if ctx.dry else 2]):
        if not ctx.enough(15):
            break
        cfg = model_config(kind, ctx.dry)
        label = model_label(kind, ctx.dry)
        t0 = time.perf_counter()
        eng = engine_in_memory(cfg, dtype, dev, num_blocks=256 if ctx.dry else 2048, seed=20 + mi)
        r.setdefault("build_s", {})[label] = round(time.perf_counter() - t0, 2)
        g = torch.Generator().manual_seed(mi)

        def rand(n, g=g, vocab=cfg.vocab_size):
            return torch.randint(3, vocab, (n,), generator=g).tolist()

        for bname in ("torch", "triton"):
            for b in batches:
                if not ctx.enough(5):
                    raise Deadline
                eng.runner.backend = (
                    TorchAttention() if bname == "torch" else counting_backend("real")
                )
                prompts = [rand(p_len) for _ in range(b)]
                if not ctx.dry:
                    asyncio.run(_decode_rate(eng, prompts, 2))  # compile, warm caches
                m = asyncio.run(_decode_rate(eng, prompts, n_new))
                r["rows"].append({"model": label, "backend": bname, "batch": b, **m})
                ctx.log(
                    f"{label} {bname} batch {b}: {m['tok_s']:.1f} tok/s, "
                    f"{m['ms_per_step']:.2f} ms/step"
                )
                ctx.save()
        prefix = rand(f_prefix)
        suffixes = [rand(f_suffix) for _ in range(f_children)]
        for bname, backend in (
            ("torch", lambda: TorchAttention()),
            ("triton shared", lambda: counting_backend(gate)),
            ("triton plain", lambda: counting_backend("never")),
        ):
            if not ctx.enough(5):
                raise Deadline
            eng.runner.backend = backend()
            if not ctx.dry:
                asyncio.run(_fork_rate(eng, prefix, suffixes, 2))
            m = asyncio.run(_fork_rate(eng, prefix, suffixes, f_new))
            m["grouped_rows"] = getattr(eng.runner.backend, "grouped_rows", 0)
            r["fork"]["rows"].append({"model": label, "backend": bname, **m})
            ctx.log(f"{label} fork {bname}: {m['tok_s']:.1f} tok/s")
            ctx.save()
        del eng
        _free_cuda()
    by = {(x["model"], x["backend"], x["batch"]): x["tok_s"] for x in r["rows"]}
    r["ratios"] = [
        {"model": m, "batch": b, "triton_over_torch": by[(m, "triton", b)] / t}
        for (m, k, b), t in by.items()
        if k == "torch" and (m, "triton", b) in by
    ]
    ratios = [x["triton_over_torch"] for x in r["ratios"]]
    ctx.summary = f"{len(r['rows'])} decode runs, {len(r['fork']['rows'])} fork runs; " + (
        f"Triton/torch {min(ratios):.2f}-{max(ratios):.2f}x" if ratios else ""
    )


SECTIONS: dict[str, Callable[[Ctx], None]] = {
    "env": sec_env,
    "pytest_kernels": sec_pytest_kernels,
    "kernel_sweep": sec_kernel_sweep,
    "engine_logits": sec_engine_logits,
    "engine_greedy": sec_engine_greedy,
    "kernel_speed": sec_kernel_speed,
    "bench_attention": sec_bench_attention,
    "engine_throughput": sec_engine_throughput,
}


# =============================================================== Markdown
def _f(x: Any, nd: int = 3) -> str:
    """A table cell: `nd` significant digits (0: an integer), one decimal from 100 up."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if nd == 0:
            return f"{x:.0f}"
        return f"{x:.1f}" if abs(x) >= 100 else f"{x:.{nd}g}"
    return str(x)


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_f(c) for c in row) + " |" for row in rows]
    return out + [""]


def md_env(r: dict) -> list[str]:
    """Markdown for the env section."""
    dev, pk, h = r.get("device", {}), r.get("packages", {}), r.get("hbm", {})
    mm = r.get("bf16_matmul", {})
    lines = [
        f"- device: {dev.get('name')} (capability {dev.get('capability', '-')}, "
        f"{dev.get('sms', '-')} SMs, {dev.get('memory_gib', '-')} GiB, L2 "
        f"{dev.get('l2_mib', '-')} MiB)",
        f"- python {r.get('python')} ({r.get('executable')}); torch {pk.get('torch')} "
        f"(CUDA {r.get('torch_cuda')}); triton {pk.get('triton')}; transformers "
        f"{pk.get('transformers')}; pytest-xdist {pk.get('pytest-xdist')}",
        f"- git: {r.get('git', {}).get('commit')} (dirty: {r.get('git', {}).get('dirty')})",
    ]
    if h:
        lines.append(
            f"- HBM: copy {_f(h.get('copy_gbps'), 0)} GB/s (read + write), read "
            f"{_f(h.get('read_gbps'), 0)} GB/s, ceiling used "
            f"{_f(h.get('ceiling_gbps'), 0)} GB/s; datasheet "
            f"{h.get('datasheet_gbps') or '-'} GB/s"
        )
    if mm:
        lines.append(f"- bf16 matmul {mm.get('n')}^3: {_f(mm.get('tflops'), 1)} TFLOP/s")
    smi = r.get("nvidia_smi", {})
    if smi.get("query"):
        lines += ["", "```", smi["query"], "```"]
    return lines + [""]


def md_pytest_kernels(r: dict) -> list[str]:
    """Markdown for the kernel tests."""
    lines = [
        f"`{r.get('command', '')}`",
        "",
        f"- {r.get('passed', 0)} passed, {r.get('failures', 0)} failed, "
        f"{r.get('errors', 0)} errors, {r.get('skipped', 0)} skipped",
    ]
    lines += [f"  - {f}" for f in r.get("failed", [])]
    return lines + [""]


def md_kernel_sweep(r: dict) -> list[str]:
    """Markdown for the kernel sweep: one row per kernel, then any failed case."""
    rows = [
        [
            k,
            v["cases"],
            v["passed"],
            v["strict_passed"],
            v["max_abs_err"],
            v["max_rel_l2"],
            v["worst"],
        ]
        for k, v in r.get("kernels", {}).items()
    ]
    lines = _table(
        [
            "kernel",
            "cases",
            "passed",
            "strict (vLLM default tol)",
            "max abs err",
            "max rel L2",
            "worst case",
        ],
        rows,
    )
    bad = [
        f"- {k}: {row['desc']} {row.get('error') or row.get('checks')}"
        for k, v in r.get("kernels", {}).items()
        for row in v["rows"]
        if not row["ok"]
    ]
    return lines + bad[:20] + ([""] if bad else [])


def md_engine_logits(r: dict) -> list[str]:
    """Markdown for the logits comparison."""
    rows = [
        [
            x["model"],
            x["dtype"],
            x["backend"],
            x["rel_l2"],
            x["decode_rel_l2"],
            x["hf_rel_l2"],
            x["bound"],
            x["max_abs"],
            x["top1"],
            x["hf_top1"],
            x["ok"],
        ]
        for x in r.get("rows", [])
    ]
    return [f"Criterion: {r.get('criterion', '')}; positions {r.get('positions')}.", ""] + _table(
        [
            "model",
            "dtype",
            "backend",
            "rel L2",
            "decode rel L2",
            "transformers rel L2",
            "bound",
            "max abs",
            "top-1",
            "transformers top-1",
            "pass",
        ],
        rows,
    )


def md_engine_greedy(r: dict) -> list[str]:
    """Markdown for the greedy comparisons."""
    rows = [
        [
            c["model"],
            c["dtype"],
            c["what"],
            c["identical"],
            c["seqs_differ"],
            c["token_match"],
            c["near_ties_ok"],
            c["grouped_rows"],
            c["ok"],
        ]
        for c in r.get("comparisons", [])
    ]
    return [
        f"Prefix {r.get('prefix_len')} tokens, {r.get('children')} children, "
        f"{r.get('new_tokens')} greedy tokens each, gate {r.get('gate')}.",
        "",
    ] + _table(
        [
            "model",
            "dtype",
            "comparison",
            "identical",
            "seqs differ",
            "token match",
            f"near-ties (top-{TOPK_TIE})",
            "grouped rows",
            "pass",
        ],
        rows,
    )


def md_kernel_speed(r: dict) -> list[str]:
    """Markdown for kernel speed: paged, shared, the crossover, the goals."""
    lines = [
        f"{r.get('dtype')}, block 16, ceiling {_f(r.get('ceiling_gbps'), 0)} GB/s "
        f"(measured); bytes = each K/V row once + q + out (shared: prefix once + "
        f"suffixes of {r.get('suffix')} tokens).",
        "",
        "Paged decode:",
        "",
    ]
    lines += _table(
        ["shape", "seqs", "context", "ms", "MB", "GB/s", "of ceiling"],
        [
            [x["shape"], x["seqs"], x["context"], x["ms"], x["MB"], x["gbps"], x["frac"]]
            for x in r.get("paged", [])
        ],
    )
    lines += ["Shared-prefix decode vs per-sequence paged decode:", ""]
    lines += _table(
        ["shape", "prefix", "group", "shared ms", "paged ms", "speedup", "GB/s", "of ceiling"],
        [
            [
                x["shape"],
                x["prefix"],
                x["group"],
                x["shared_ms"],
                x["paged_ms"],
                x["speedup"],
                x["gbps"],
                x["frac"],
            ]
            for x in r.get("shared", [])
        ],
    )
    gate = r.get("gate", {})
    lines += [
        f"Gate crossover (gate shares from prefix >= {gate.get('min_prefix')} and "
        f"group >= {gate.get('min_group')}):",
        "",
    ]
    lines += _table(
        [
            "shape",
            "group",
            "shared wins from prefix",
            "gate shares but slower at",
            "gate plain but shared >1.2x faster at",
        ],
        [
            [
                c["shape"],
                c["group"],
                c["crossover_prefix"],
                ", ".join(map(str, c["gate_slower_at"])) or "-",
                ", ".join(map(str, c["gate_missed_at"])) or "-",
            ]
            for c in r.get("crossover", [])
        ],
    )
    for g in r.get("goals", []):
        verdict = {True: "**met**", False: "**not met**"}.get(g["met"])
        lines.append(
            f"- goal: {g['goal']}" + (f": {_f(g.get('value'))} -> {verdict}" if verdict else "")
        )
    return lines + [""]


def md_bench_attention(r: dict) -> list[str]:
    """Markdown for bench_attention.py's rows."""
    cols = [
        "shape",
        "prefix",
        "group",
        "shared_ms",
        "paged_ms",
        "sdpa_ms",
        "shared_pct_peak",
        "speedup_vs_paged",
        "gate_shares",
        "gate_regret",
    ]
    rows = [[_num(x.get(c)) for c in cols] for x in r.get("rows", [])]
    return [f"`{r.get('command', '')}`", ""] + _table(cols, rows)


def _num(v: Any) -> Any:
    """A CSV cell back as a number or bool where it is one."""
    if v in ("True", "False"):
        return v == "True"
    for kind in (int, float):
        try:
            return kind(v)
        except (TypeError, ValueError):
            continue
    return v


def md_engine_throughput(r: dict) -> list[str]:
    """Markdown for engine throughput: per batch both backends, then the fork runs."""
    by = {(x["model"], x["backend"], x["batch"]): x for x in r.get("rows", [])}
    rows = []
    for (m, k, b), x in by.items():
        if k != "torch":
            continue
        t = by.get((m, "triton", b), {})
        rows.append(
            [
                m,
                b,
                x["tok_s"],
                t.get("tok_s"),
                (t.get("tok_s") or 0) / x["tok_s"],
                x["ms_per_step"],
                t.get("ms_per_step"),
            ]
        )
    lines = [
        f"{r.get('dtype')}, prompts of {r.get('prompt_tokens')} tokens, "
        f"{r.get('new_tokens')} greedy tokens each (decode timed after prefill); "
        f"random weights built in device memory ({r.get('build_s')} s).",
        "",
    ]
    lines += _table(
        [
            "model",
            "batch",
            "torch tok/s",
            "triton tok/s",
            "triton / torch",
            "torch ms/step",
            "triton ms/step",
        ],
        rows,
    )
    f = r.get("fork", {})
    lines += [
        f"Forked children: prefix {f.get('prefix')}, {f.get('children')} children of "
        f"{f.get('suffix')} own tokens, {f.get('new_tokens')} tokens each:",
        "",
    ]
    lines += _table(
        ["model", "backend", "tok/s", "ms/step", "grouped rows"],
        [
            [x["model"], x["backend"], x["tok_s"], x["ms_per_step"], x.get("grouped_rows")]
            for x in f.get("rows", [])
        ],
    )
    return lines


RENDER = {
    "env": md_env,
    "pytest_kernels": md_pytest_kernels,
    "kernel_sweep": md_kernel_sweep,
    "engine_logits": md_engine_logits,
    "engine_greedy": md_engine_greedy,
    "kernel_speed": md_kernel_speed,
    "bench_attention": md_bench_attention,
    "engine_throughput": md_engine_throughput,
}


def render_markdown(report: dict, summary_only: bool = False) -> str:
    """The report as Markdown: a summary table, then one part per section."""
    secs = report["sections"]
    lines = [
        f"# GPU check ({report['mode']})",
        "",
        f"{report['started']}, {report['wall_s']} s of a {report['budget_s']:.0f} s "
        f"budget; commit {report['git'].get('commit')}; `{report['command']}`",
        "",
    ]
    lines += _table(
        ["section", "status", "s", "summary"],
        [[n, s["status"], s.get("wall_s"), s.get("summary", "")] for n, s in secs.items()],
    )
    if summary_only:
        return "\n".join(lines)
    for name, s in secs.items():
        lines += [f"## {name}: {BY_NAME[name].title}", "", f"Status: **{s['status']}**", ""]
        if s.get("error"):
            lines += ["```", str(s["error"])[-1500:], "```", ""]
        fails = s.get("failures") or []
        lines += [f"- FAIL {f}" for f in fails[:10]] + ([""] if fails else [])
        try:
            lines += RENDER[name](s.get("result") or {})
        except Exception as exc:  # a renderer bug must not lose the JSON report
            lines += [f"(could not render: {type(exc).__name__}: {exc})", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
