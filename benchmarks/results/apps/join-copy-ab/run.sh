#!/bin/bash
# The join A/B as it ran: /tmp/ab/tree-{base,recompute,head} were git worktrees of
# 18251f2 (base: Scheduler join loop and Engine.joins_forks switched off), 18251f2, and
# 492b365; ROUNDS="1 2 3 4" then ROUNDS="5 6 7 8". ma.sh: the apps.py A/B, base vs head.
for r in ${ROUNDS:-1 2 3 4}; do
  if [ $((r % 2)) = 1 ]; then order="base recompute head"; else order="head recompute base"; fi
  for t in $order; do
    (cd /tmp/ab/tree-$t && PYTHONPATH=/tmp/ab/tree-$t /work/main/.venv/bin/python /tmp/ab/drive.py $t $r >> /tmp/ab/results.jsonl 2>>/tmp/ab/err.log)
  done
done
echo finished >> /tmp/ab/results.jsonl
