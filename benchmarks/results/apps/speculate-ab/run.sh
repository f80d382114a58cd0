#!/bin/bash
# Alternating runs of the same checkout with prompt-lookup drafts off (`serve --speculate 0`)
# and on (the CPU default: 4 drafts per greedy decode row, in steps of at most 2 decode
# rows), cache on, the same texts in every run (--seed 5000).
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/speculate-ab}
WL=${WL:-chain_summary map_reduce multi_agent mixed_tenant}
mkdir -p "$OUT"
n=0
for side in off on on off; do
  n=$((n + 1))
  if [ $side = off ]; then ARGS="--server-arg=--speculate --server-arg=0"; else ARGS=""; fi
  timeout 1200 .venv/bin/python benchmarks/apps.py --workloads $WL --cache on --reps 2 \
    --hf-reps 0 --seed 5000 $ARGS --out "$OUT/$side-$n" > "$OUT/$side-$n.log" 2>&1
  echo "== $side $n"
  grep -E '^\| [a-z_]+ \| on \|' "$OUT/$side-$n/table.md" | cut -d'|' -f2,4-6,10-11
  grep -E '^\| (parrot|request-level) \| median \|' "$OUT/$side-$n/table.md"
done
