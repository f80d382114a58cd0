#!/bin/bash
# Alternating mixed-tenant runs with the background's turn every 6th step (the CPU default)
# and every 12th (`serve --background-every`; other values: VALUES="6 0"), the order swapped
# in round 2, each round on texts of its own; prints each run's mixed-tenant medians
# (summary.txt is 2026-12-06's).
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/background-every-ab}
mkdir -p "$OUT"
for round in 1 2; do
  values=${VALUES:-6 12}
  if [ $round = 1 ]; then order="$values"; else order=$(echo $values | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for every in $order; do
    echo "== round $round every $every $(date +%T)"
    timeout 900 .venv/bin/python benchmarks/apps.py --workloads mixed_tenant --cache on \
      --reps 2 --hf-reps 0 --seed $((round * 1000)) \
      --server-arg=--background-every --server-arg=$every \
      --out "$OUT/r$round-e$every" > "$OUT/r$round-e$every.log" 2>&1
    grep -A12 "^Mixed tenants" "$OUT/r$round-e$every/table.md" | grep -E "median"
  done
done
