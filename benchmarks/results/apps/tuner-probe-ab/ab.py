"""The first request after a pause, on two bench servers (`benchmarks/appbench/serve.py`,
engine prefix cache off): `before` runs the tree before the thread tuner kept its probes to
small steps, `after` this tree. Each round both servers sit idle for PAUSE seconds (long
enough for a probe to fall due), then each gets one streamed completion of a fresh
~1,040-token prompt (16 tokens), alternating which goes first. Reports the first steps'
times and the thread counts they ran with (`step_threads`), TTFT and JCT.

    .venv/bin/python benchmarks/results/apps/tuner-probe-ab/ab.py BEFORE_URL AFTER_URL ROUNDS PAUSE
"""

import asyncio
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from appbench import modes, workloads  # noqa: E402


async def one(http: httpx.AsyncClient, model: str, seed: int) -> dict:
    wl = workloads.shared_prompt(seed, users=1, prompt=1024, gen=16)
    mark = await modes.step_mark(http)
    got = await modes.run_request_level(http, wl, 0.0, model, counters=False)
    steps = (await http.get("/bench/steps", params={"after": mark})).json()["steps"]
    return {"jct": got["jct"], "ttft": got["calls"][0]["ttft"], "steps": steps}


def _one_thread(run: dict) -> bool:
    return run["steps"][0].get("step_threads") == 1


async def main(urls: dict[str, str], rounds: int, pause: float) -> None:
    res: dict[str, list[dict]] = {k: [] for k in urls}
    clients = {
        k: httpx.AsyncClient(base_url=u, timeout=600, trust_env=False) for k, u in urls.items()
    }
    models = {k: (await c.get("/v1/models")).json()["data"][0]["id"] for k, c in clients.items()}
    for i in range(rounds):
        await asyncio.sleep(pause)
        order = list(urls) if i % 2 == 0 else list(urls)[::-1]
        for label in order:
            r = await one(clients[label], models[label], 40_000 + 10 * i + (label == "after"))
            res[label].append(r)
            first = r["steps"][:4]
            print(
                f"round {i} {label}: jct {r['jct']:.2f}s ttft {r['ttft']:.2f}s first steps "
                + ", ".join(
                    f"{s['tokens']}t {s['dt'] * 1e3:.0f}ms th{s.get('step_threads')}" for s in first
                ),
                flush=True,
            )
    for label, runs in res.items():
        chunk = [r["steps"][0]["dt"] for r in runs]
        print(
            f"{label}: median jct {statistics.median(r['jct'] for r in runs):.3f}s, "
            f"median ttft {statistics.median(r['ttft'] for r in runs):.3f}s, "
            f"median first chunk {statistics.median(chunk) * 1e3:.0f}ms, "
            f"first chunks on 1 thread {sum(_one_thread(r) for r in runs)}/{len(runs)}"
        )
    for c in clients.values():
        await c.aclose()


if __name__ == "__main__":
    asyncio.run(
        main({"before": sys.argv[1], "after": sys.argv[2]}, int(sys.argv[3]), float(sys.argv[4]))
    )
