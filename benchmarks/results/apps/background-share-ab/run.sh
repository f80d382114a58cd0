#!/bin/bash
# Alternating before (5bddd5a, the tree before the background share) / after (the tree
# with it) mixed-tenant runs; the harness of the checkout in both, the server code from
# PYTHONPATH. First: git worktree add --detach /tmp/before 5bddd5a
# Extra arguments go to apps.py (e.g. --size mixed_tenant.batch.docs=36).
cd "$(dirname "$0")/../../../.."
TAG=${TAG:-cpu}
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then PP=/tmp/before; else PP=$PWD; fi
    echo "== round $round $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$PP .venv/bin/python benchmarks/apps.py --workloads mixed_tenant --cache on --hf-reps 0 --seed $((round*1000)) --out benchmarks/results/apps/background-share-ab/$TAG-$side-$round "$@" 2>&1 | grep -v "it/s\]" | tail -12
  done
done
