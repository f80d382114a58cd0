#!/bin/bash
# Multi-agent before/after the shared-prefix gate: before = 38c395b checked out at
# /tmp/before (git worktree add --detach /tmp/before 38c395b) on PYTHONPATH, after = this tree.
cd "$(dirname "$0")/../../../.."
for round in 1 2; do
  for side in before after; do
    if [ $round = 2 ]; then side=$([ $side = before ] && echo after || echo before); fi
    pp=""; [ $side = before ] && pp=/tmp/before
    echo "== round $round $side $(date +%T)"
    PYTHONPATH=$pp .venv/bin/python benchmarks/apps.py --workloads multi_agent --cache on off --hf-reps 0 --reps 2 --seed $((round*100+7)) --out /tmp/prof/ma-$side-$round 2>&1 | grep "^| multi_agent | o[nf]* | [0-9]"
  done
done
