"""The map-reduce example (`examples/langchain_map_reduce.py`) plain vs compiled,
alternating, on fresh documents each run: JCT, engine steps, the compute thread's wall
and CPU time in steps (their difference: time it wanted a core and waited), and the CPU
time of the server's other threads (`/proc/PID/task/*/stat`): a CPU server's bookkeeping
(store writes, event streams) runs on the cores its engine computes on.

    PROBE_DIR=/tmp/x .venv/bin/python benchmarks/results/server-cpu/serve_hooks.py --port 8123 &
    PROBE_DIR=/tmp/x .venv/bin/python benchmarks/results/server-cpu/map_reduce_cpu.py \
        --rounds 6 [--only compiled] [--flush 0.05,0.1]

`--flush A,B` sets the server's token-flush interval to A in even rounds and B in odd ones.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))
import langchain_map_reduce as example  # noqa: E402
from langchain_parrot import ChatParrot, compile_chain  # noqa: E402

PROBE = Path(os.environ.get("PROBE_DIR", "/tmp"))


def thread_cpu(pid: int) -> dict[str, float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        f = stat.rsplit(")", 1)[1].split()
        out[tid] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8123")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--only", choices=["plain", "compiled"])
    ap.add_argument("--flush", help="A,B: token-flush interval in even / odd rounds")
    args = ap.parse_args()
    pid = int(subprocess.check_output(["pgrep", "-f", "serve_hooks.py"]).split()[0])
    chat = ChatParrot(base_url=args.url, temperature=0, max_tokens=48)
    chain = example.build(chat)
    compiled = compile_chain(chain)
    modes = [args.only] if args.only else ["plain", "compiled"]
    jct: dict[str, list[float]] = {}
    for r in range(args.rounds):
        label = ""
        if args.flush:
            value = args.flush.split(",")[r % 2]
            (PROBE / "flush").write_text(value)
            os.kill(pid, signal.SIGUSR2)
            label = f" flush {value}"
        for mode in modes if r % 2 == 0 else modes[::-1]:
            tag = f" (copy {r}{mode[0]})"
            inputs = {
                f"doc{i}": d.replace(".", tag + ".", 1) for i, d in enumerate(example.DOCUMENTS)
            }
            mark = httpx.get(args.url + "/bench/steps", params={"after": 2**62}).json()["next"]
            cpu0, t0 = thread_cpu(pid), time.perf_counter()
            (chain if mode == "plain" else compiled).invoke(inputs)
            dt = time.perf_counter() - t0
            cpu1 = thread_cpu(pid)
            steps = httpx.get(args.url + "/bench/steps", params={"after": mark}).json()["steps"]
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.3)
            rec = [
                x
                for x in json.loads((PROBE / "compute.json").read_text())
                if x[0] >= steps[0]["t"] - 0.01
            ]
            wall, cpu = sum(x[1] for x in rec), sum(x[2] for x in rec)
            compute_tids = sorted(cpu1, key=lambda t: cpu1[t] - cpu0.get(t, 0))[-2:]
            other = sum(cpu1[t] - cpu0.get(t, 0) for t in cpu1 if t not in compute_tids)
            key = mode + label
            jct.setdefault(key, []).append(dt)
            print(
                f"{r} {key:22s} {dt:.2f} s, {len(steps)} steps, compute wall {wall:.2f} "
                f"cpu {cpu:.2f} (waited {wall - cpu:.2f}), other threads {other:.2f} s CPU",
                flush=True,
            )
    print({k: round(statistics.median(v), 3) for k, v in jct.items()})


if __name__ == "__main__":
    main()
