"""One user on a shared-prompt workload, parrot vs request-level, with where parrot's extra
time goes: starts `traced_serve.py` (engine prefix cache off), runs ROUNDS alternating
pairs per prompt size (every call generates 8 tokens, `ignore_eos`; fresh texts per run),
then prints per mode the medians of JCT, first engine step after the client began, the
client's end after the last step, engine busy time and steps, each round's
request-level / parrot ratio, and the medians of parrot's traced marks (ms; `*_end` after
the last engine step, the rest after the client began).

    .venv/bin/python benchmarks/results/apps/overhead-probe/one-user/one_user.py \
        [--prompt 256 1024] [--rounds 10] [--out DIR]
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[3]
sys.path.insert(0, str(BENCH))
from appbench import modes, workloads  # noqa: E402
from apps import free_port  # noqa: E402


async def sweep(url: str, prompts: list[int], rounds: int, trace: Path) -> list[dict]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        warm = workloads.shared_prompt(1, users=2, prompt=128, gen=4, ignore_eos=True)
        await modes.run_parrot(http, warm, 0.0)
        await modes.run_request_level(http, warm, 0.0, model)
        for p in prompts:
            for r in range(rounds):
                for mode in ("parrot", "rl") if r % 2 == 0 else ("rl", "parrot"):
                    seed = 7000 + 100 * p + 2 * r + (mode == "rl")
                    wl = workloads.shared_prompt(seed, users=1, prompt=p, gen=8, ignore_eos=True)
                    mark = await modes.step_mark(http)
                    t0 = time.perf_counter()
                    if mode == "parrot":
                        run = await modes.run_parrot(http, wl, 0.0, counters=False)
                    else:
                        run = await modes.run_request_level(http, wl, 0.0, model, counters=False)
                    t1 = time.perf_counter()
                    await asyncio.sleep(0.3)  # the run's last records are written
                    steps = (await http.get("/bench/steps", params={"after": mark})).json()
                    out.append(
                        {"P": p, "mode": mode, "round": r, "jct": run["jct"], "t0": t0, "t1": t1}
                        | {"steps": steps["steps"]}
                    )
    return out


def summary(runs: list[dict], trace: list[dict]) -> str:
    lines = []
    med = statistics.median
    for p in sorted({r["P"] for r in runs}):
        lines.append(f"P={p}")
        by = {m: [r for r in runs if r["P"] == p and r["mode"] == m] for m in ("parrot", "rl")}
        for mode, rs in by.items():
            cols = {"jct": [], "first_step": [], "end": [], "busy": [], "steps": []}
            for r in rs:
                s = r["steps"]
                cols["jct"].append(r["jct"] * 1000)
                cols["first_step"].append((s[0]["t"] - r["t0"]) * 1000)
                cols["end"].append((r["t0"] + r["jct"] - s[-1]["t"] - s[-1]["dt"]) * 1000)
                cols["busy"].append(sum(x["dt"] for x in s) * 1000)
                cols["steps"].append(len(s))
            lines.append(
                f"  {mode:6s} n={len(rs)} " + " ".join(f"{k}={med(v):.1f}" for k, v in cols.items())
            )
        ratios = [q["jct"] / r["jct"] for r, q in zip(by["parrot"], by["rl"], strict=True)]
        lines.append(
            "  request-level / parrot by round: "
            + " ".join(f"{x:.2f}" for x in ratios)
            + f" (median {med(ratios):.3f})"
        )
        marks: dict[str, list[float]] = {}
        for r in by["parrot"]:
            last = r["steps"][-1]["t"] + r["steps"][-1]["dt"]
            ev = [e for e in trace if r["t0"] <= e["t0"] <= r["t1"]]

            def add(key: str, value: float | None, marks=marks) -> None:
                if value is not None:
                    marks.setdefault(key, []).append(value * 1000)

            def first(name: str, ev=ev, **kw) -> dict | None:
                hits = [e for e in ev if e["n"] == name and kw.items() <= e.items()]
                return hits[0] if hits else None

            for key, e in {
                "create_run": first("rt.create_run"),
                "run_created_write": first("persist._write", type="run_created"),
                "objectives_write": first("persist._write", type="objectives"),
                "render": first("dispatch.render"),
                "engine_fill": first("engine.fill"),
            }.items():
                if e is not None:
                    add(f"{key}_at", e["t0"] - r["t0"])
                    add(f"{key}_ms", e["t1"] - e["t0"])
            for key, e in {
                "value_write": first("deliver_values"),
                "read_answer": first("rt.read_variable"),
                "run_finished_write": first("persist._write", type="run_finished"),
            }.items():
                if e is not None:
                    add(f"{key}_start", e["t0"] - last)
                    add(f"{key}_end", e["t1"] - last)
            polls = [e for e in ev if e["n"] == "http" and "/variables/" in e.get("path", "")]
            if polls:
                add("answer_sent_end", max(e["t1"] for e in polls) - last)
            add("client_end", r["t0"] + r["jct"] - last)
        for key, v in marks.items():
            lines.append(f"    parrot {key:24s} {med(v):6.2f} (min {min(v):.2f}, max {max(v):.2f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="one-user-")))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / "trace.jsonl"
    trace.unlink(missing_ok=True)
    port = free_port()
    env = {**os.environ, "TRACE_FILE": str(trace), "TOKENIZERS_PARALLELISM": "false"}
    data = tempfile.mkdtemp(prefix="one-user-data-")
    cmd = [sys.executable, str(HERE / "traced_serve.py"), "--port", str(port)]
    cmd += ["--data-dir", data, "--no-prefix-cache"]
    with (args.out / "server.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        runs = asyncio.run(sweep(url, args.prompt, args.rounds, trace))
    finally:
        proc.terminate()
        proc.wait()
    (args.out / "runs.json").write_text(json.dumps(runs))
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    text = summary(runs, events)
    (args.out / "summary.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
