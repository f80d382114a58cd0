"""Engine decode speed on a CPU shared with another busy process, per threading setting.

    .venv/bin/python benchmarks/cpu_contention.py [--rounds 3] [--json out.json]

A server rarely has its cores to itself. With torch's OpenMP team spanning every core, a
single busy process on one of them made each parallel region wait for the descheduled
worker thread: decode ran 5-10x slower, where losing one of two cores should cost about
2x. Each setting runs in its own process (OpenMP reads its environment once), quiet and
next to one busy process (a pure-Python loop: one core's worth of load), alternating,
`--rounds` times; the figure is decode tokens/s of SmolLM2 at batch 1 and batch 8
(medians), and the ratio loaded/quiet is what a co-located load costs.

Settings: `threads` (torch.set_num_threads), `wait` (OMP_WAIT_POLICY: active spins at
barriers, passive sleeps), and `auto`: what `parrot_backend.engine.threads` chooses.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "2 threads, spin (torch default)": {"threads": "2", "wait": ""},
    "2 threads, passive": {"threads": "2", "wait": "PASSIVE"},
    "1 thread": {"threads": "1", "wait": ""},
    "auto (engine default)": {"threads": "auto", "wait": ""},
}

WORKER = r"""
import asyncio, json, os, sys, time
threads = os.environ["BENCH_THREADS"]
from parrot_backend.engine.engine import Engine
from parrot_backend.contract.sampling import SamplingParams
kw = {} if threads == "auto" else {"threads": int(threads)}
engine = Engine.from_pretrained(progress=False, **kw)
prompt = engine.tokenize("Parrots are intelligent birds found in tropical regions. " * 4)

async def run(batch, n):
    sampling = SamplingParams(max_tokens=n, ignore_eos=True)
    async def one(i):
        await engine.fill(f"c{batch}-{i}", None, prompt)
        async for _ in engine.generate(f"c{batch}-{i}", None, sampling):
            pass
        await engine.free(f"c{batch}-{i}")
    await asyncio.gather(*(one(i) for i in range(batch)))   # warm-up and prefill
    t0 = time.perf_counter()
    async def dec(i):
        await engine.fill(f"d{batch}-{i}", None, prompt)
        async for _ in engine.generate(f"d{batch}-{i}", None, sampling):
            pass
        await engine.free(f"d{batch}-{i}")
    await asyncio.gather(*(dec(i) for i in range(batch)))
    return batch * n / (time.perf_counter() - t0)

async def main():
    async with engine:
        out = {"b1": await run(1, 48), "b8": await run(8, 32),
               "threads": engine.threads.describe()}
    print("RESULT " + json.dumps(out))

asyncio.run(main())
"""


def _busy(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def measure(setting: dict, loaded: bool) -> dict:
    env = {**os.environ, "BENCH_THREADS": setting["threads"]}
    if setting["wait"]:
        env["OMP_WAIT_POLICY"] = setting["wait"]
    else:
        env.pop("OMP_WAIT_POLICY", None)
    stop = multiprocessing.Event()
    hog = multiprocessing.Process(target=_busy, args=(stop,)) if loaded else None
    if hog is not None:
        hog.start()
        time.sleep(0.5)
    try:
        out = subprocess.run(
            [sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        if hog is not None:
            stop.set()
            hog.join()
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"worker failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated setting names to run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chosen = {
        k: v
        for k, v in SETTINGS.items()
        if not args.only or any(s.strip() in k for s in args.only.split(","))
    }
    results: dict[str, dict[str, list[float]]] = {
        name: {f"{load}_{b}": [] for load in ("quiet", "loaded") for b in ("b1", "b8")}
        for name in chosen
    }
    described = {}
    for r in range(args.rounds):
        for name, setting in chosen.items():  # alternate settings and loads in each round
            for loaded in (False, True) if r % 2 == 0 else (True, False):
                got = measure(setting, loaded)
                load = "loaded" if loaded else "quiet"
                for b in ("b1", "b8"):
                    results[name][f"{load}_{b}"].append(got[b])
                described[name] = got["threads"]
                print(
                    f"round {r + 1}: {name:34s} {load:6s} b1 {got['b1']:6.1f} "
                    f"b8 {got['b8']:6.1f} tok/s  ({got['threads']})",
                    flush=True,
                )
    print()
    print("| setting | quiet b1 | loaded b1 | loaded/quiet | quiet b8 | loaded b8 | loaded/quiet |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    table = {}
    for name, series in results.items():
        med = {k: statistics.median(v) for k, v in series.items()}
        table[name] = med
        print(
            f"| {name} | {med['quiet_b1']:.1f} | {med['loaded_b1']:.1f} | "
            f"{med['loaded_b1'] / med['quiet_b1']:.2f} | {med['quiet_b8']:.1f} | "
            f"{med['loaded_b8']:.1f} | {med['loaded_b8'] / med['quiet_b8']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"medians": table, "raw": results, "threads": described}, fh, indent=2)


if __name__ == "__main__":
    main()
