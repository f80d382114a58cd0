"""From run records to figures: prefill accounting, lower bounds, ratios, table, plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

MODES = ("parrot", "request-level")
HF = "transformers"  # the in-process generate() baseline (hf_mode.py), one phase only
ALL_MODES = (*MODES, HF)


def load_tokenizer(model: str | None):
    """SmolLM2's (or `model`'s) tokenizer, to count prompt tokens; None if unavailable."""
    try:
        from tokenizers import Tokenizer

        if model and Path(model, "tokenizer.json").exists():
            return Tokenizer.from_file(str(Path(model, "tokenizer.json")))
        from parrot_backend.engine.model_files import resolve_model

        return Tokenizer.from_file(str(resolve_model(model, progress=False) / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - accounting is optional, timings are not
        return None


def prefill_accounting(tok, prompts: list[str]) -> dict:
    """Prompt tokens as sent (logical) and distinct prefix tokens (a trie over them: what a
    perfect prefix cache must still compute)."""
    if tok is None:
        return {}
    ids = [e.ids for e in tok.encode_batch(prompts, add_special_tokens=False)]
    root: dict = {}
    unique = 0
    for seq in ids:
        node = root
        for t in seq:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                unique += 1
            node = nxt
    return {"logical": sum(len(s) for s in ids), "unique": unique}


def critical_tokens(wl, calls: list[dict]) -> int:
    """Generated tokens along the DAG's longest dependency chain."""
    by_output = {c.output: (c, r) for c, r in zip(wl.calls, calls, strict=True)}
    memo: dict[str, int] = {}

    def depth(name: str) -> int:
        if name not in by_output:
            return 0
        if name not in memo:
            c, r = by_output[name]
            memo[name] = r["tokens"] + max([depth(i) for i in c.inputs] or [0])
        return memo[name]

    return max(depth(o) for o in wl.outputs)


def summarise_run(wl, run: dict, tok) -> dict:
    calls = run["calls"]
    gen = sum(c["tokens"] for c in calls)
    acct = prefill_accounting(tok, [c["prompt"] for c in calls])
    out = {
        "jct": run["jct"],
        "ttft_mean": statistics.mean(c["ttft"] for c in calls),
        "ttft_max": max(c["ttft"] for c in calls),
        "norm_latency": statistics.mean(c["latency"] / max(1, c["tokens"]) for c in calls),
        "tokens": gen,
        "throughput": gen / run["jct"],
        "critical_tokens": critical_tokens(wl, calls),
        "prompt_tokens": acct.get("logical"),
        "unique_prompt_tokens": acct.get("unique"),
        "last_start": max(c["start_offset"] for c in calls),
    }
    steps = run.get("steps") or {}
    if steps:
        out["engine_busy"] = steps["busy_s"] / run["jct"]
        out["prefill_s"] = steps["prefill_s"]
        out["decode_s"] = steps["decode_s"]
        out["decode_batch_mean"] = steps["decode_batch_mean"]
    hf = run.get("hf") or {}
    if hf:  # transformers generate(): every prompt token computed, padding included
        out["prefill_padded"] = hf["prefill_padded"]
        out["waves"] = len(hf["waves"])
    eng = run.get("engine") or {}
    if eng:
        out["prefill_computed"] = eng["prefill_computed"]
        out["cache_hit_tokens"] = eng["prefix_cache_hits"]
        if out["prompt_tokens"] is not None:
            out["prefill_saved"] = out["prompt_tokens"] - eng["prefill_computed"]
    return out


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (phase, workload): medians over repetitions, the ratio, the bound."""
    rows = []
    records = [r for r in records if "summary" in r]
    keys = sorted({(r["phase"], r["workload"]) for r in records}, key=lambda k: (k[1], k[0]))
    for phase, workload in keys:
        row = {"phase": phase, "workload": workload}
        for mode in ALL_MODES:
            mine = [
                r["summary"]
                for r in records
                if (r["phase"], r["workload"], r["mode"]) == (phase, workload, mode)
            ]
            for key in (
                "jct",
                "ttft_mean",
                "ttft_max",
                "norm_latency",
                "throughput",
                "prefill_computed",
                "prompt_tokens",
                "prefill_saved",
                "tokens",
                "last_start",
                "unique_prompt_tokens",
                "engine_busy",
                "prefill_s",
                "decode_s",
                "decode_batch_mean",
                "critical_tokens",
                "prefill_padded",
                "waves",
            ):
                row[f"{mode}.{key}"] = _median(mine, key)
            row[f"{mode}.reps"] = len(mine)
        p, q = row["parrot.jct"], row["request-level.jct"]
        row["ratio"] = q / p if p and q else None
        t = row[f"{HF}.jct"]
        row["hf_ratio"] = t / p if p and t else None  # transformers JCT / parrot JCT
        cal = next(
            (r["calibration"] for r in records if r["phase"] == phase and r.get("calibration")),
            None,
        )
        uniq, crit = row["parrot.unique_prompt_tokens"], row["parrot.critical_tokens"]
        if cal and uniq is not None and crit is not None:
            row["lower_bound"] = uniq / cal["prefill_tokens_per_s"] + crit * cal["decode_step_s"]
            row["parrot_over_bound"] = p / row["lower_bound"] if p else None
            # the best ratio this run allowed: a parrot at its lower bound against the
            # request-level JCT measured (a goal above it is out of reach at these sizes)
            row["ratio_ceiling"] = q / row["lower_bound"] if q else None
        rows.append(row)
    return rows


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[dict]) -> str:
    head = (
        "| workload | engine prefix cache | parrot JCT s | request-level JCT s | ratio | "
        "parrot TTFT s | req-level TTFT s | prefill computed parrot / req-level "
        "(logical) | lower bound s | parrot / bound |"
    )
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['phase']} | {_f(r['parrot.jct'])} | "
            f"{_f(r['request-level.jct'])} | **{_f(r['ratio'])}x** | "
            f"{_f(r['parrot.ttft_mean'])} | {_f(r['request-level.ttft_mean'])} | "
            f"{_f(r['parrot.prefill_computed'], '{:.0f}')} / "
            f"{_f(r['request-level.prefill_computed'], '{:.0f}')} "
            f"({_f(r['request-level.prompt_tokens'], '{:.0f}')}) | "
            f"{_f(r.get('lower_bound'))} | {_f(r.get('parrot_over_bound'))}x |"
        )
    return "\n".join(lines) + "\n"


def hf_table(rows: list[dict]) -> str:
    """transformers generate() against parrot in the same phase (the one the baseline ran
    in): JCTs, their ratio, tokens generated, prompt tokens sent and computed (padded)."""
    mine = [r for r in rows if r.get(f"{HF}.reps")]
    if not mine:
        return ""
    lines = [
        "| workload | parrot's engine prefix cache | transformers JCT s | parrot JCT s | "
        "transformers / parrot | transformers tokens | waves | prompt tokens sent / "
        "computed (padded) |",
        "|" + " --- |" * 8,
    ]
    for r in mine:
        lines.append(
            f"| {r['workload']} | {r['phase']} | {_f(r[f'{HF}.jct'])} | {_f(r['parrot.jct'])} | "
            f"**{_f(r['hf_ratio'])}x** | {_f(r[f'{HF}.tokens'], '{:.0f}')} | "
            f"{_f(r[f'{HF}.waves'], '{:.0f}')} | {_f(r[f'{HF}.prompt_tokens'], '{:.0f}')} / "
            f"{_f(r[f'{HF}.prefill_padded'], '{:.0f}')} |"
        )
    return "\n".join(lines) + "\n"


def time_table(rows: list[dict]) -> str:
    """Where the time goes: the engine's busy share of the JCT, its time in steps with
    prefill and in pure decode steps, the mean decode batch, when the last call started."""
    if not any(r.get("parrot.prefill_s") is not None for r in rows):
        return ""
    lines = [
        "| workload | cache | mode | JCT s | engine busy | prefill steps s | decode steps s"
        " | decode batch | last call sent at s |",
        "|" + " --- |" * 9,
    ]
    for r in rows:
        for mode in MODES:
            busy = r.get(f"{mode}.engine_busy")
            lines.append(
                f"| {r['workload']} | {r['phase']} | {mode} | {_f(r[f'{mode}.jct'])} | "
                f"{_f(busy * 100 if busy is not None else None, '{:.0f}')}% | "
                f"{_f(r.get(f'{mode}.prefill_s'))} | {_f(r.get(f'{mode}.decode_s'))} | "
                f"{_f(r.get(f'{mode}.decode_batch_mean'), '{:.1f}')} | "
                f"{_f(r.get(f'{mode}.last_start'))} |"
            )
    return "\n".join(lines) + "\n"


GOALS = [
    ("shared_prompt", "off", 4.0),
    ("shared_prompt", "on", 3.0),
    ("multi_agent", "on", 2.0),
    ("chain_summary", "on", 1.3),
]


def goals(rows: list[dict]) -> str:
    """Each goal, measured and met or not. For the ratio goals, the run's ceiling too:
    request-level's JCT over parrot's lower bound, the ratio a parrot that reached its
    bound would have measured; where the ceiling is under the goal, no change to parrot
    could meet it at these sizes on this engine and machine ("out of reach"). The bound
    takes one token per decode step; where parrot finished under it (greedy rows took
    several tokens a step from drafts, `engine/speculate.py`), it bounds nothing, and no
    ceiling is given."""
    lines = [
        "| goal | measured | met | ceiling (request-level JCT / parrot's bound) |",
        "| --- | --- | --- | --- |",
    ]
    find = {(r["workload"], r["phase"]): r for r in rows}
    for wl, phase, want in GOALS:
        r = find.get((wl, phase)) or {}
        got, top = r.get("ratio"), r.get("ratio_ceiling")
        met = "-" if got is None else ("yes" if got >= want else "no")
        under = r.get("parrot_over_bound") is not None and r["parrot_over_bound"] < 1
        if top is not None and top < want and met == "no" and not under:
            met = "no (out of reach)"
        ceiling = "- (parrot under its bound)" if under else f"{_f(top)}x"
        lines.append(f"| {wl}, cache {phase}: >= {want}x | {_f(got)}x | {met} | {ceiling} |")
    for r in rows:
        if r["ratio"] is not None:
            lines.append(
                f"| {r['workload']}, cache {r['phase']}: never slower | "
                f"{_f(r['ratio'])}x | {'yes' if r['ratio'] >= 1 else 'no'} | - |"
            )
        if r.get("parrot_over_bound") is not None:
            ob = r["parrot_over_bound"]
            lines.append(
                f"| {r['workload']}, cache {r['phase']}: within 1.5x of bound | "
                f"{_f(ob)}x | {'yes' if ob <= 1.5 else 'no'} | - |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path) -> list[str]:
    """jct.png (JCT per workload and mode, lower bound marked) and prefill.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    labels = [f"{r['workload']}\ncache {r['phase']}" for r in rows]
    x = range(len(rows))
    made = []
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["parrot.jct"] or 0 for r in rows], w, label="parrot")
    ax.bar(
        [i + w / 2 for i in x],
        [r["request-level.jct"] or 0 for r in rows],
        w,
        label="request-level",
    )
    hf = [(i, r[f"{HF}.jct"]) for i, r in zip(x, rows, strict=True) if r.get(f"{HF}.jct")]
    if hf:  # a dot over the parrot bar of the phase it ran in
        ax.scatter(
            [i - w / 2 for i, _ in hf],
            [v for _, v in hf],
            marker="D",
            s=30,
            color="tab:red",
            label="transformers generate()",
            zorder=4,
        )
    lb = [(i, r["lower_bound"]) for i, r in zip(x, rows, strict=True) if r.get("lower_bound")]
    if lb:
        ax.scatter(
            [i - w / 2 for i, _ in lb],
            [v for _, v in lb],
            marker="_",
            s=400,
            color="black",
            label="lower bound",
            zorder=3,
        )
    for i, r in zip(x, rows, strict=True):
        if r["ratio"]:
            top = max(r["parrot.jct"], r["request-level.jct"])
            ax.text(i, top * 1.02, f"{r['ratio']:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("job completion time (s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "jct.png", dpi=110)
    plt.close(fig)
    made.append("jct.png")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    ax.bar(
        [i - w / 2 for i in x],
        [r["parrot.prefill_computed"] or 0 for r in rows],
        w,
        label="parrot: computed",
    )
    ax.bar(
        [i + w / 2 for i in x],
        [r["request-level.prefill_computed"] or 0 for r in rows],
        w,
        label="request-level: computed",
    )
    ax.scatter(
        list(x),
        [r["request-level.prompt_tokens"] or 0 for r in rows],
        marker="_",
        s=600,
        color="black",
        label="prompt tokens sent",
        zorder=3,
    )
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("prefill tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "prefill.png", dpi=110)
    plt.close(fig)
    made.append("prefill.png")
    return made


def mixed(records: list[dict]) -> tuple[dict, str]:
    """Mixed tenants: the chain's JCT idle and under the batch, the batch's throughput
    alone and with the chain, per mode (each repetition and their medians), and the
    goals' ratios (of the medians)."""
    runs: dict[str, list[dict]] = {}
    for r in records:
        if "mixed" in r:
            runs.setdefault(r["mode"], []).append(r["mixed"])
    if not runs:
        return {}, ""
    # medians over the repetitions, each figure on its own
    by = {
        mode: {key: statistics.median(m[key] for m in ms) for key in ms[0]}
        for mode, ms in runs.items()
    }
    lines = [
        "| mode | run | chain idle s | chain under batch s | slowdown | batch alone tok/s | "
        "batch with chain tok/s |",
        "|" + " --- |" * 7,
    ]
    for mode, ms in runs.items():
        shown = [(str(i + 1), m) for i, m in enumerate(ms)] if len(ms) > 1 else []
        for label, m in [*shown, ("median" if shown else "1", by[mode])]:
            lines.append(
                f"| {mode} | {label} | {_f(m['chain_idle'])} | {_f(m['chain_loaded'])} | "
                f"{_f(m['chain_loaded'] / m['chain_idle'])}x | "
                f"{_f(m['batch_alone_tput'], '{:.1f}')} | "
                f"{_f(m['batch_loaded_tput'], '{:.1f}')} |"
            )
    p, q = by.get("parrot"), by.get("request-level")
    g = {}
    if p:
        g["chain_slowdown"] = p["chain_loaded"] / p["chain_idle"]
    if p and q:
        g["chain_vs_fifo"] = q["chain_loaded"] / p["chain_loaded"]
        g["batch_tput_vs_fifo"] = p["batch_loaded_tput"] / q["batch_loaded_tput"]
        g["batch_tput_vs_alone"] = p["batch_loaded_tput"] / p["batch_alone_tput"]
    goal_lines = ["| goal | measured | met |", "| --- | --- | --- |"]
    for key, what, ok in (
        ("chain_slowdown", "chain under load within 1.3x of idle", lambda v: v <= 1.3),
        ("chain_vs_fifo", "chain >= 2x better than request-level FIFO", lambda v: v >= 2),
        (
            "batch_tput_vs_fifo",
            "batch throughput >= 0.9x request-level's under the same load",
            lambda v: v >= 0.9,
        ),
    ):
        if key in g:
            goal_lines.append(f"| {what} | {_f(g[key])}x | {'yes' if ok(g[key]) else 'no'} |")
    text = "\n".join(lines) + "\n\n" + "\n".join(goal_lines) + "\n"
    return g, text


def write(out: Path, meta: dict, records: list[dict]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows = aggregate(records)
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "runs": records}, indent=1, default=str)
    )
    text = f"Command: `{meta['command']}`\n\n" + table(rows) + "\n" + goals(rows)
    if hf_table(rows):
        text += (
            "\ntransformers generate() in the harness process (one batched call per wave of"
            " ready calls, no prefix cache, no round trip; medians):\n\n" + hf_table(rows)
        )
    goals_mixed, text_mixed = mixed(records)
    if text_mixed:
        text += "\nMixed tenants (a latency chain submitted while a throughput batch runs):\n\n"
        text += text_mixed
    if time_table(rows):
        text += "\nWhere the time goes (medians):\n\n" + time_table(rows)
    (out / "table.md").write_text(text)
    plots = plot(rows, out)
    return {"rows": rows, "table": text, "plots": plots, "mixed": goals_mixed}
