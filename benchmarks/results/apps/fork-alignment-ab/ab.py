"""Parrot mode of one workload under the old and the new rule, alternating pairs (fresh
texts each run), against serve_ab.py: JCT, engine steps and busy time per run, medians.

    .venv/bin/python benchmarks/results/apps/fork-alignment-ab/ab.py URL WORKLOAD PAIRS
"""

import asyncio
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from appbench import modes, workloads  # noqa: E402

MODE_FILE = Path("/tmp/fork-alignment-mode")


async def main(url: str, name: str, pairs: int) -> None:
    res: dict[str, list[tuple[float, int, float]]] = {"old": [], "new": []}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for i in range(pairs):
            for rule in ("old", "new") if i % 2 == 0 else ("new", "old"):
                MODE_FILE.write_text(rule)
                wl = workloads.build(name, 500 + 13 * i + (rule == "new"))
                mark = await modes.step_mark(http)
                got = await modes.run_parrot(http, wl, 0.25, counters=False)
                steps = (await http.get("/bench/steps", params={"after": mark})).json()["steps"]
                busy = sum(s["dt"] for s in steps)
                res[rule].append((got["jct"], len(steps), busy))
                print(f"{name} {rule} jct {got['jct']:.2f} steps {len(steps)} busy {busy:.2f}")
    for rule, runs in res.items():
        print(
            f"{rule}: median jct {statistics.median(r[0] for r in runs):.3f} s, "
            f"steps {statistics.median(r[1] for r in runs)}, "
            f"busy {statistics.median(r[2] for r in runs):.3f} s"
        )
    ratio = sum(r[0] for r in res["new"]) / sum(r[0] for r in res["old"])
    print(f"new / old JCT (sums): {ratio:.3f}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
