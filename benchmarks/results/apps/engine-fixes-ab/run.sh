#!/bin/bash
# Alternating before (7dadf14, the tree before a1620ff and 71f195e) / after (71f195e or
# later) apps runs; the harness of the checkout in both, the server code from PYTHONPATH.
# First: git worktree add --detach /tmp/before 7dadf14
cd "$(dirname "$0")/../../../.."
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then PP=/tmp/before; else PP=$PWD; fi
    echo "== round $round $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$PP .venv/bin/python benchmarks/apps.py --workloads shared_prompt chain_summary --cache off --reps 1 --hf-reps 0 --seed $((round*1000)) --out benchmarks/results/apps/engine-fixes-ab/$side-$round 2>&1 | grep -v "it/s\]" | tail -15
  done
done
