"""Engine steps of parrot and request-level runs of one workload against a bench server
(`benchmarks/appbench/serve.py`): per-step time, rows and tokens, alternating modes.

    .venv/bin/python benchmarks/results/apps/decode-step-probe/probe.py URL WORKLOAD PAIRS \
        [USERS PROMPT]    (SEED_BASE=N in the environment: texts of other seeds)

With USERS and PROMPT it runs `shared_prompt` at that size (16 tokens each).
"""

import asyncio
import os
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from appbench import modes, workloads  # noqa: E402


def summary(steps: list[dict]) -> str:
    by_rows: dict[int, list[float]] = {}
    for s in steps:
        if s["prefill"] == 0 and s["decode"]:
            by_rows.setdefault(s["decode"], []).append(s["dt"])
    pre = [s for s in steps if s["prefill"]]
    parts = [
        f"steps {len(steps)} busy {sum(s['dt'] for s in steps):.2f}s",
        "prefill steps "
        + ", ".join(
            f"{s['prefill']}t+{s['decode']}r {s['dt'] * 1e3:.0f}ms th{s['threads']} seqs{s['seqs']}"
            for s in pre
        ),
        "decode-only steps by rows: "
        + ", ".join(
            f"{r}r x{len(v)} median {statistics.median(v) * 1e3:.0f}ms"
            for r, v in sorted(by_rows.items())
        ),
    ]
    return "\n    ".join(parts)


async def main(url: str, name: str, pairs: int, extra: list[str]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for i in range(pairs):
            for mode in ("parrot", "request-level") if i % 2 == 0 else ("request-level", "parrot"):
                seed = int(os.environ.get("SEED_BASE", "900")) + 17 * i + (mode == "parrot")
                if extra:
                    wl = workloads.shared_prompt(
                        seed, users=int(extra[0]), prompt=int(extra[1]), gen=16
                    )
                else:
                    wl = workloads.build(name, seed)
                mark = await modes.step_mark(http)
                if mode == "parrot":
                    got = await modes.run_parrot(http, wl, 0.0, counters=False)
                else:
                    got = await modes.run_request_level(http, wl, 0.0, model, counters=False)
                steps = (await http.get("/bench/steps", params={"after": mark})).json()["steps"]
                print(
                    f"{name} {mode} pair {i}: jct {got['jct']:.2f}s\n    {summary(steps)}",
                    flush=True,
                )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
