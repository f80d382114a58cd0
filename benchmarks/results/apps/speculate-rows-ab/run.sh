#!/bin/bash
# Alternating runs of the same checkout: drafts in steps of <= 2 decode rows (the CPU
# default) vs <= 4 (`serve --speculate-rows 4`), multi_agent and map_reduce, cache on, the
# same texts in every run (--seed 6000).
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/speculate-rows-ab}
mkdir -p "$OUT"
n=0
for rows in 2 4 4 2; do
  n=$((n + 1))
  timeout 900 .venv/bin/python benchmarks/apps.py --workloads multi_agent map_reduce \
    --cache on --reps 2 --hf-reps 0 --seed 6000 --server-arg=--speculate-rows \
    --server-arg=$rows --out "$OUT/rows$rows-$n" > "$OUT/rows$rows-$n.log" 2>&1
  echo "== rows $rows run $n"
  grep -E '^\| [a-z_]+ \| on \|' "$OUT/rows$rows-$n/table.md" | cut -d'|' -f2,4-6,8-9
done
