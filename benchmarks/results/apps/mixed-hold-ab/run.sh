#!/bin/bash
# Alternating mixed-tenant runs of several server settings (the order reversed in round 2,
# each round on texts of its own); prints each run's mixed-tenant medians. Settings are
# NAME=ARGS pairs, ARGS with commas for spaces, e.g.
#   SETTINGS="default= strict=--background-every,0,--background-share,0,--urgent-hold,0.03"
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/mixed-hold-ab}
SETTINGS=${SETTINGS:-"default= hold=--urgent-hold,0.03 strict=--background-every,0,--background-share,0,--urgent-hold,0.03"}
mkdir -p "$OUT"
for round in 1 2; do
  if [ $round = 1 ]; then order="$SETTINGS"; else order=$(echo $SETTINGS | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for setting in $order; do
    name=${setting%%=*}
    args=()
    for a in $(echo "${setting#*=}" | tr ',' ' '); do args+=("--server-arg=$a"); done
    echo "== round $round $name (${setting#*=}) $(date +%T)"
    timeout 900 .venv/bin/python benchmarks/apps.py --workloads mixed_tenant --cache on \
      --reps 2 --hf-reps 0 --seed $((round * 1000)) "${args[@]}" \
      --out "$OUT/r$round-$name" > "$OUT/r$round-$name.log" 2>&1
    grep -A12 "^Mixed tenants" "$OUT/r$round-$name/table.md" | grep -E "median"
  done
done
