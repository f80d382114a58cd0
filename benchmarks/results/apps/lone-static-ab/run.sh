#!/bin/bash
# A/B of the lone-static change: one user, cache on, base (03dde41) vs head, alternating
# (paths of the machine it ran on: /tmp/base a worktree of 03dde41, /work/main at 0e4016d)
set -u
PY=/work/main/.venv/bin/python
for round in 1 2; do
  for side in base head; do
    if [ $side = base ]; then TREE=/tmp/base; else TREE=/work/main; fi
    D=$(mktemp -d)
    (cd $TREE && PYTHONPATH=$TREE TOKENIZERS_PARALLELISM=false $PY benchmarks/appbench/serve.py --port 8941 --data-dir $D > /tmp/ab/server-$side-$round.log 2>&1) &
    for i in $(seq 1 120); do curl -sf http://127.0.0.1:8941/healthz >/dev/null && break; sleep 1; done
    (cd /work/main && $PY benchmarks/apps_scaling.py --url http://127.0.0.1:8941 --users 1 --prompt 256 1024 --reps 2 --out /tmp/ab/$side-$round > /tmp/ab/$side-$round.log 2>&1)
    pkill -f "appbench/serve.py --port 8941"; sleep 3
    echo "$side $round"; grep "^| [0-9]" /tmp/ab/$side-$round/scaling.md
  done
done
