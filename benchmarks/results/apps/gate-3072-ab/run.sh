#!/bin/bash
# Alternating before (0403364: the decode gate at 512 / 6,144 prefix tokens) / after (the
# gate at 256 / 3,072) multi_agent runs, cache on, the same texts in every run; the
# harness of the checkout in both, the server code from PYTHONPATH.
# First: git worktree add --detach /tmp/before 0403364
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/gate-3072-ab}
mkdir -p "$OUT"
n=0
for side in after before before after after before; do
  n=$((n + 1))
  if [ $side = before ]; then PP=/tmp/before; else PP=$PWD; fi
  PYTHONPATH=$PP timeout 900 .venv/bin/python benchmarks/apps.py --workloads multi_agent \
    --cache on --reps 2 --hf-reps 0 --seed 3000 --out "$OUT/$side-$n" > "$OUT/$side-$n.log" 2>&1
  echo "$side $n $(grep -E '^\| multi_agent \| on \| (parrot|request-level) \|' \
    "$OUT/$side-$n/table.md" | cut -d'|' -f4-8 | tr '\n' ' ')"
done
