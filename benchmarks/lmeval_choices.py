"""lm-evaluation-harness itself against `serve`: a 5-shot multiple-choice task (an MMLU-like
layout: a description, 5 fixed examples, the question, the options A-D; 40 questions, 4
choices each, written here, nothing downloaded) through lm-eval's `local-completions`,
against a fresh `serve` per run, alternating:

- `kept`: the default server (a scoring fill keeps its blocks' scores with the prefix
  cache: the 5 examples are computed once for the whole task, each question once for
  its 4 choices);
- `recompute`: `serve --no-prefix-cache` (every request computes its whole prompt: what
  every scoring request did before 59d464e).

lm-eval is not a dependency of this project; install it in a venv of its own and name its
`lm_eval` (the command below is how it was run here, offline):

    python -m venv /tmp/lmeval-venv
    /tmp/lmeval-venv/bin/pip install torch==2.13.0 "lm-eval[api]==0.4.13"
    .venv/bin/python benchmarks/lmeval_choices.py --lm-eval /tmp/lmeval-venv/bin/lm_eval \\
        [--batch-size 1] [--reps 2] [--questions 40]

Prints per run the wall time (lm-eval's start-up included), the time of lm-eval's
"Requesting API" bar, the accuracy, and at the end the largest difference between the
two servers' per-choice log-likelihoods (from `--log_samples`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scoring_http import serve

TOPICS = "rivers clocks lanterns harbors meadows engines violins gardens comets islands".split()
COLORS = ["red", "blue", "green", "yellow"]
TASK = """task: mc_fewshot
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {dir}/dev.jsonl
    test: {dir}/test.jsonl
fewshot_split: validation
test_split: test
output_type: multiple_choice
num_fewshot: 5
fewshot_config:
  sampler: first_n
description: "The following are questions about village stories.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. \
{{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path, questions: int) -> None:
    rng = random.Random(7)

    def row(i: int) -> dict:
        t = rng.choice(TOPICS)
        q = (
            f"In the story of the {t} number {i}, the keeper painted every {t[:-1]} the same "
            f"colour after a long winter, because the village council asked for something "
            f"cheerful. Which colour did the keeper most likely choose?"
        )
        return {"question": q, "choices": COLORS, "answer": rng.randrange(4)}

    with open(folder / "dev.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps(row(i)) + "\n")
    with open(folder / "test.jsonl", "w") as f:
        for i in range(5, 5 + questions):
            f.write(json.dumps(row(i)) + "\n")
    (folder / "mc_fewshot.yaml").write_text(TASK.format(dir=folder))


def lm_eval(args, tasks: Path, url: str, out: Path) -> tuple[float, str, str]:
    """(wall s, the request bar's time, the accuracy line)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    model_args = (
        f"model=SmolLM2-135M-Instruct,base_url={url}/v1/completions,num_concurrent=1,"
        "tokenized_requests=True,tokenizer_backend=auto"
    )
    cmd = [
        args.lm_eval,
        "--model",
        "local-completions",
        "--batch_size",
        str(args.batch_size),
        "--tasks",
        "mc_fewshot",
        "--include_path",
        str(tasks),
        "--model_args",
        model_args,
        "--output_path",
        str(out),
        "--log_samples",
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"lm_eval failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    bars = re.findall(r"Requesting API: 100%[^\r\n]*?\[(\d+:\d+)<", r.stderr)
    acc = next((line for line in r.stdout.splitlines() if "mc_fewshot" in line), "?")
    return wall, bars[-1] if bars else "?", acc


def loglikelihoods(out: Path) -> dict[int, list[float]]:
    path = glob.glob(str(out / "**" / "samples_*.jsonl"), recursive=True)[0]
    got = {}
    with open(path) as f:
        for line in f:
            doc = json.loads(line)
            got[doc["doc_id"]] = [float(r[0][0]) for r in doc["resps"]]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-eval", default="lm_eval", help="the lm_eval command")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--questions", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_task(tmp, args.questions)
        servers = [("recompute", ["--no-prefix-cache"]), ("kept", [])]
        outs: dict[str, Path] = {}
        for rep in range(args.reps):
            for name, serve_args in servers if rep % 2 == 0 else servers[::-1]:
                out = tmp / f"{name}-{rep}"
                with serve(*serve_args) as url:
                    wall, bar, acc = lm_eval(args, tmp, url, out)
                outs.setdefault(name, out)
                print(f"rep {rep} {name}: wall {wall:.1f} s, requests {bar}, {acc}", flush=True)
        kept, recompute = loglikelihoods(outs["kept"]), loglikelihoods(outs["recompute"])
        worst = max(abs(a - b) for d in kept for a, b in zip(kept[d], recompute[d], strict=True))
        print(f"{len(kept)} questions; largest |kept - recompute| log-likelihood {worst:.2e}")


if __name__ == "__main__":
    main()
