#!/bin/bash
# alternating: default CPU share policy vs 4 background tokens riding along each step
cd "$(dirname "$0")/../../../.." && mkdir -p /tmp/mtab
for round in 1 2; do
  for cfg in default ride4; do
    if [ $cfg = default ]; then extra=(); else extra=(--server-arg=--background-tokens --server-arg=4); fi
    .venv/bin/python benchmarks/apps.py --workloads mixed_tenant --cache on --reps 2 --seed $((60000 + 1000*round)) "${extra[@]}" --out /tmp/mtab/$cfg-r$round > /tmp/mtab/$cfg-r$round.log 2>&1
    echo "$cfg round $round done $(date +%T)"
  done
done
