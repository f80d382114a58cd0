#!/bin/bash
# Alternating mixed-tenant runs with the engine's urgent_linger off (0) and on (0.25 s, the
# default) on a 36-document batch; the log is log.txt (each run's mixed-tenant rows).
cd "$(dirname "$0")/../../../.."
for round in 1 2 3; do
  for lin in 0 0.25; do
    name=l$lin-r$round
    echo "== $name $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    .venv/bin/python benchmarks/apps.py --workloads mixed_tenant --cache on --hf-reps 0 --reps 1 --seed $((round*1000+11)) --server-arg=--urgent-linger --server-arg=$lin --size mixed_tenant.batch.docs=36 --out benchmarks/results/apps/linger-ab/d-$name 2>&1 | grep -v "it/s\]" | grep "^| parrot\|^| request\|^| chain\|^| batch"
  done
done
echo ALLDONE
