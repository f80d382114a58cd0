#!/bin/bash
# Alternating runs of three workloads that have no throughput calls (cache off), with
# `serve --pause-steps on` and off, the order reversed in round 2: pausing must cost them
# nothing (their calls are all latency: no step pauses)
cd "$(dirname "$0")/../../../../.."
for round in 1 2; do
  order="on off"; [ $round = 2 ] && order="off on"
  for p in $order; do
    echo "== round $round pause $p $(date +%T)"
    timeout 900 .venv/bin/python benchmarks/apps.py --workloads chain_summary map_reduce shared_prompt --cache off \
      --reps 2 --hf-reps 0 --seed $((round * 1000)) --server-arg=--pause-steps --server-arg=$p \
      --out ${OUT:-/tmp/wl-ab}/r$round-$p > ${OUT:-/tmp/wl-ab}-r$round-$p.log 2>&1
    grep -E "^\| (chain_summary|map_reduce|shared_prompt) " ${OUT:-/tmp/wl-ab}/r$round-$p/table.md | cut -d'|' -f2,4,5,6
  done
done
