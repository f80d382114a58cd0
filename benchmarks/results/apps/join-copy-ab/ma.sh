#!/bin/bash
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="base head"; else order="head base"; fi
  for t in $order; do
    (cd /tmp/ab/tree-$t && PYTHONPATH=/tmp/ab/tree-$t /work/main/.venv/bin/python benchmarks/apps.py --workloads multi_agent map_reduce --cache on --hf-reps 0 --seed $((r*1000)) --out /tmp/ab/ma-$t-$r > /tmp/ab/ma-$t-$r.log 2>&1)
  done
done
echo finished > /tmp/ab/ma.done
