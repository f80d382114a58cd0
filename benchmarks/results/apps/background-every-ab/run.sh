#!/bin/bash
cd /work/main
for round in 1 2; do
  if [ $round = 1 ]; then order="6 12"; else order="12 6"; fi
  for every in $order; do
    echo "== round $round every $every $(date +%T)"
    timeout 900 .venv/bin/python benchmarks/apps.py --workloads mixed_tenant --cache on --reps 2 --hf-reps 0 \
      --seed $((round*1000)) --server-arg=--background-every --server-arg=$every --out benchmarks/results/apps/background-every-ab/out/r${round}-e${every} > benchmarks/results/apps/background-every-ab/out/r${round}-e${every}.log 2>&1
    grep -A12 "^Mixed tenants" benchmarks/results/apps/background-every-ab/out/r${round}-e${every}/table.md | grep -E "median|within|FIFO|throughput"
  done
done
