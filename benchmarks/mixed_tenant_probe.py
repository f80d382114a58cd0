"""Where a latency chain's time goes under a throughput batch: alternating pairs of the
mixed-tenant workload (fresh texts each), with the engine's step log.

    .venv/bin/python benchmarks/appbench/serve.py --port 8311 --data-dir "$(mktemp -d)" &
    .venv/bin/python benchmarks/mixed_tenant_probe.py http://127.0.0.1:8311 [--pairs 2]

For each mode (parrot: the batch `throughput`, the chain `latency`; request-level: every
call a streamed completion) prints the batch's and the chain's JCT, each chain call's
ready time, TTFT and latency, and every engine step from the chain's submission on:
(start s, duration s, sequences, decode rows, prefill tokens, latency-priority rows; a
step that paused for more urgent work is marked, and so is the rest of it, resumed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import apps  # noqa: E402
from appbench import modes, workloads  # noqa: E402


async def alone(http: httpx.AsyncClient, model: str, pairs: int, size: dict) -> None:
    """The throughput batch alone in both modes (fresh texts each), with a summary of its
    engine steps: where does a mode's batch time go?"""
    for i, mode in enumerate(["parrot", "request-level"] * pairs):
        batch = workloads.build("map_reduce", 555 + 10 * i, **size["batch"])
        batch.criterion = "throughput"
        mark = await modes.step_mark(http)
        if mode == "parrot":
            got = await modes.run_parrot(http, batch, 0.25, counters=False)
        else:
            got = await modes.run_request_level(http, batch, 0.25, model, counters=False)
        steps = (await http.get("/bench/steps", params={"after": mark})).json()["steps"]
        busy = sum(s["dt"] for s in steps)
        pre = [s for s in steps if s["prefill"]]
        dec = [s for s in steps if not s["prefill"]]
        rows = sum(s["decode"] for s in dec) / max(1, len(dec))
        print(
            f"{mode}: batch {got['jct']:.2f} s, {len(steps)} steps busy {busy:.2f} s; "
            f"{len(pre)} with prefill ({sum(s['dt'] for s in pre):.2f} s, "
            f"{sum(s['prefill'] for s in pre)} tokens), {len(dec)} decode-only "
            f"({sum(s['dt'] for s in dec):.2f} s, mean {rows:.1f} rows)"
        )
        for s in steps[:60]:
            print(
                f"    {s['t'] - steps[0]['t']:6.2f} {s['dt']:.3f} {s['seqs']:3d} "
                f"{s['decode']:3d} {s['prefill']:4d}"
            )


async def probe(url: str, pairs: int, steps_shown: int, batch_alone: bool = False) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        size = apps.MIXED["cpu"]
        await modes.calibrate(http, model, "warm up text " * 100, reps=1)
        if batch_alone:
            await alone(http, model, pairs, size)
            return
        for i, mode in enumerate(["parrot", "request-level"] * pairs):
            seed = 777 + 10 * i
            chain = workloads.build("chain_summary", seed, **size["chain"])
            batch = workloads.build("map_reduce", seed + 1, **size["batch"])
            batch.criterion = "throughput"

            async def one(wl: workloads.Workload, mode: str = mode) -> dict:
                if mode == "parrot":
                    return await modes.run_parrot(http, wl, 0.25, counters=False)
                return await modes.run_request_level(http, wl, 0.25, model, counters=False)

            async def later(wl: workloads.Workload) -> tuple[dict, float]:
                await asyncio.sleep(size["delay"])
                return time.perf_counter(), await one(wl)

            mark = await modes.step_mark(http)
            t0 = time.perf_counter()
            b, (tc, c) = await asyncio.gather(one(batch), later(chain))
            steps = (await http.get("/bench/steps", params={"after": mark})).json()["steps"]
            first = steps[0]["t"]
            print(
                f"\n== {mode}: batch {b['jct']:.2f} s, chain {c['jct']:.2f} s, {len(steps)} steps"
            )
            for call in c["calls"]:
                print(
                    f"  {call['name']}: ready {call['ready']:.2f} s, ttft {call['ttft']:.2f} s, "
                    f"latency {call['latency']:.2f} s"
                )
            shown = [s for s in steps if s["t"] - first >= tc - t0 - 0.1][:steps_shown]
            print(
                "  steps from the chain's submission (t, dt, seqs, decode, prefill, latency rows):"
            )
            for s in shown:
                mark = " resumed" if s.get("resumed") else ""
                mark += " paused" if s.get("paused") else ""
                print(
                    f"    {s['t'] - first:6.2f} {s['dt']:.3f} {s['seqs']:3d} {s['decode']:3d} "
                    f"{s['prefill']:4d} {s['latency_rows']:3d}{mark}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80, help="steps to print per run")
    ap.add_argument(
        "--batch-alone", action="store_true", help="only the batch, alone, in both modes"
    )
    args = ap.parse_args()
    asyncio.run(probe(args.url, args.pairs, args.steps, args.batch_alone))


if __name__ == "__main__":
    main()
