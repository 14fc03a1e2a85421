#!/bin/bash
# ABBA for issue 40: A = 265a54a (one LLMEngine class), B = 5101ad8 (builder, core, output processor)
# /tmp/abba40/A and B: `git archive 265a54a` and `git archive 5101ad8` unpacked; launch.py: docs/experiments/tree_launch.py
cd /tmp/abba40
PY="/work/main/.venv/bin/python -P"
for round in 1 2; do
for spec in "1 4" "16 32"; do
  set -- $spec
  for who in A B B A; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    out=$($PY launch.py /tmp/abba40/$who bench throughput --workload W1 --in-flight $1 --requests $2 --no-static --threads 2 2>/dev/null | grep -E "^ *W1" | head -1 | tr -s ' ')
    echo "round=$round streams=$1 requests=$2 $who load=$load :: $out"
  done
done
done
