#!/bin/bash
# Alternating before (b2c4bfe, the tree before 0403364's grouped fork prefill) / after
# (0403364 or later) apps runs, the order swapped in round 2, each round on texts of its
# own; the harness of the checkout in both, the server code from PYTHONPATH.
# First: git worktree add --detach /tmp/before b2c4bfe
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/prefill-group-ab}
mkdir -p "$OUT"
for round in 1 2; do
  if [ $round = 1 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    if [ $side = before ]; then PP=/tmp/before; else PP=$PWD; fi
    echo "== round $round $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$PP timeout 1200 .venv/bin/python benchmarks/apps.py \
      --workloads shared_prompt multi_agent --cache off --reps 2 --hf-reps 0 \
      --seed $((round * 1000)) --out "$OUT/$side-$round" > "$OUT/$side-$round.log" 2>&1
    grep -E "^\| (shared_prompt|multi_agent)" "$OUT/$side-$round/table.md" | head -4
  done
done
