"""Scaling of a shared system prompt: prefill work and JCT for N users sharing a
P-token prompt, parrot vs request-level, on one server with the engine's prefix cache off.

    .venv/bin/python benchmarks/apps_scaling.py [--users 1 4 16] [--prompt 256 1024]

Parrot should compute about P + N * suffix prompt tokens (the prompt filled once, each
user's question on a fork), request-level about N * (P + suffix). The token counts come
from the engine's own counters (`/bench/engine`), so they are exact whatever the machine's
noise. Each point runs `--reps` times (default 2), the mode that goes first alternating,
each repetition on texts of its own; the table gives the median JCTs, their ratio and each
repetition's ratio (single runs of the one-user points read 0.72-1.62x on this shared
host). Every call generates `--gen` tokens in both modes (`ignore_eos`): texts that differ
between the modes would otherwise stop at EOS after different counts (a probe of one user
at 256 tokens, 16-token answers: 17 engine steps in each parrot run, 11-17 in the
request-level runs); `--eos` lets calls stop there. Writes `scaling.json`, `scaling.md`
and `scaling.png` into `--out` (default `benchmarks/results/apps`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from appbench import modes, report, workloads  # noqa: E402
from apps import free_port, start_server, stop_server  # noqa: E402

HERE = Path(__file__).resolve().parent


async def sweep(url: str, args, tok, bar, rows: list[dict]) -> list[dict]:
    """Append each point's row to `rows` as it completes (a failure keeps the points done)."""
    async with httpx.AsyncClient(
        base_url=url, timeout=modes.REQUEST_TIMEOUT_S, trust_env=False
    ) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for p in args.prompt:
            for n in args.users:
                reps: dict[str, list[dict]] = {"parrot": [], "request-level": []}
                for rep in range(args.reps):
                    order = ("parrot", "request-level")
                    for mode in order if rep % 2 == 0 else order[::-1]:
                        mi = order.index(mode)
                        # texts of its own per run: no run finds another's prompt cached
                        seed = 70_000 + 100 * p + 10 * n + mi + 100_000 * rep
                        wl = workloads.shared_prompt(
                            seed, users=n, prompt=p, gen=args.gen, ignore_eos=not args.eos
                        )
                        bar.set_description(f"P={p} N={n} {mode} rep {rep + 1}")
                        if mode == "parrot":
                            run = await modes.run_parrot(http, wl, 0.0)
                        else:
                            run = await modes.run_request_level(http, wl, 0.0, model)
                        s = report.summarise_run(wl, run, tok)
                        reps[mode].append(
                            {
                                "jct": s["jct"],
                                "tokens": s["tokens"],
                                "prefill_computed": s.get("prefill_computed"),
                                "prompt_tokens": s["prompt_tokens"],
                                "unique_prompt_tokens": s["unique_prompt_tokens"],
                            }
                        )
                        bar.update(1)
                row: dict = {"prompt": p, "users": n, "reps": args.reps}
                for mode, runs in reps.items():
                    row[mode] = {
                        "jct": statistics.median(r["jct"] for r in runs),
                        "jcts": [r["jct"] for r in runs],
                        "tokens": [r["tokens"] for r in runs],  # generated, per repetition
                        # token counts repeat exactly between runs; the median guards a stray one
                        "prefill_computed": _median(r["prefill_computed"] for r in runs),
                        "prompt_tokens": runs[0]["prompt_tokens"],
                        "unique_prompt_tokens": runs[0]["unique_prompt_tokens"],
                    }
                row["rep_ratios"] = [
                    b["jct"] / a["jct"]
                    for a, b in zip(reps["parrot"], reps["request-level"], strict=True)
                ]
                rows.append(row)
                pr, rl = row["parrot"], row["request-level"]
                bar.write(
                    f"P={p} N={n}: prefill {_tokens(pr['prefill_computed'])} vs "
                    f"{_tokens(rl['prefill_computed'])} tokens, JCT {pr['jct']:.2f} vs "
                    f"{rl['jct']:.2f} s, {rl['jct'] / pr['jct']:.2f}x"
                )
    return rows


def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _tokens(n: float | None) -> str:
    """A token count (a median of two runs can end in .5)."""
    return "-" if n is None else f"{n:,.1f}".removesuffix(".0")


def write(out: Path, rows: list[dict], command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "Medians of the repetitions (JCT ratio = request-level / parrot); the last column "
        "is each repetition's ratio, the first with parrot first.",
        "",
        "| P | N | parrot prefill | req-level prefill | prefill ratio | parrot JCT s | "
        "req-level JCT s | JCT ratio | ratio per repetition |",
        "|" + " --- |" * 9,
    ]
    for r in rows:
        a, b = r["parrot"], r["request-level"]
        pr = (
            b["prefill_computed"] / a["prefill_computed"]
            if a["prefill_computed"] and b["prefill_computed"]
            else None
        )
        lines.append(
            f"| {r['prompt']} | {r['users']} | {_tokens(a['prefill_computed'])} | "
            f"{_tokens(b['prefill_computed'])} | {report._f(pr)}x | {a['jct']:.2f} | "
            f"{b['jct']:.2f} | {b['jct'] / a['jct']:.2f}x | "
            + " / ".join(f"{x:.2f}x" for x in r.get("rep_ratios", []))
            + " |"
        )
    text = "\n".join(lines) + "\n"
    (out / "scaling.md").write_text(text)
    (out / "scaling.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return text
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for p in sorted({r["prompt"] for r in rows}):
        mine = [r for r in rows if r["prompt"] == p]
        ns = [r["users"] for r in mine]
        for mode, style in (("parrot", "-o"), ("request-level", "--s")):
            axes[0].plot(
                ns, [r[mode]["prefill_computed"] for r in mine], style, label=f"{mode}, P={p}"
            )
            axes[1].plot(ns, [r[mode]["jct"] for r in mine], style, label=f"{mode}, P={p}")
    for ax, what in zip(axes, ("prefill tokens computed", "JCT (s)"), strict=True):
        ax.set_xlabel("users N")
        ax.set_ylabel(what)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    plt.close(fig)
    return text


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, nargs="+", help="N values (default 1 4 16)")
    ap.add_argument("--prompt", type=int, nargs="+", help="P values (default 256 1024)")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument(
        "--eos", action="store_true", help="let calls stop at EOS (default: all --gen tokens)"
    )
    ap.add_argument(
        "--reps", type=int, default=2, help="runs per mode and point, order alternating"
    )
    ap.add_argument(
        "--gpu", action="store_true", help="N = 1 4 16 64 and P = 256 1024 4096 (a GPU engine)"
    )
    ap.add_argument("--model")
    ap.add_argument("--url", help="a running server (its cache setting) instead")
    ap.add_argument("--port", type=int, help="port for the server (default: a free one)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "apps")
    args = ap.parse_args(argv)
    args.users = args.users or ([1, 4, 16, 64] if args.gpu else [1, 4, 16])
    args.prompt = args.prompt or ([256, 1024, 4096] if args.gpu else [256, 1024])
    args.port = args.port or free_port()
    command = "python benchmarks/apps_scaling.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    tok = report.load_tokenizer(args.model)
    began = time.time()
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    with tqdm(
        total=2 * args.reps * len(args.users) * len(args.prompt), unit="run", file=sys.stderr
    ) as bar:
        rows: list[dict] = []
        try:
            if args.url:
                asyncio.run(sweep(args.url, args, tok, bar, rows))
            else:
                log = Path(tempfile.gettempdir()) / "appbench-server-scaling.log"
                proc = start_server(args.port, False, args.model, log, [])
                try:
                    asyncio.run(sweep(f"http://127.0.0.1:{args.port}", args, tok, bar, rows))
                finally:
                    stop_server(proc)
        except BaseException as exc:
            if rows:  # the points done are kept, the command says the run is incomplete
                write(args.out, rows, f"{command}  # INCOMPLETE: stopped by {exc!r}"[:500])
                print(f"wrote the {len(rows)} points done to {args.out}", file=sys.stderr)
            raise
    text = write(args.out, rows, command)
    print(text + f"\n({time.time() - began:.0f} s)")
    return text


if __name__ == "__main__":
    main()
