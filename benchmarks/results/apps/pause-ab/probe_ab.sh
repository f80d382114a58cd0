#!/bin/bash
# Alternating probes of the mixed-tenant workload with steps that pause for latency work
# (`serve --pause-steps on`) and without (off), the order reversed in round 2: each
# prints the chain's calls (ready, TTFT, latency) and the engine's steps from the chain's
# submission on (`benchmarks/mixed_tenant_probe.py`, 2 pairs of texts per server).
cd "$(dirname "$0")/../../../.."
for round in 1 2; do
  for setting in on off; do
    [ $round = 2 ] && { [ $setting = on ] && setting=off || setting=on; }
    d=$(mktemp -d)
    .venv/bin/python benchmarks/appbench/serve.py --port 8311 --data-dir "$d" --pause-steps $setting > /tmp/probe-server-$setting-$round.log 2>&1 &
    pid=$!
    for i in $(seq 120); do curl -sf http://127.0.0.1:8311/v1/models >/dev/null && break; sleep 1; done
    echo "== round $round pause $setting $(date +%T)"
    .venv/bin/python benchmarks/mixed_tenant_probe.py http://127.0.0.1:8311 --pairs 2 --steps 40 > /tmp/probe-$setting-$round.txt 2>&1
    grep -E "^== |ttft" /tmp/probe-$setting-$round.txt
    kill $pid; wait $pid 2>/dev/null
  done
done
