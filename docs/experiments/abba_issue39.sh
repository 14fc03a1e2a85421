#!/bin/bash
# ABBA: A = today's ridge (c52abe3, /tmp/base39), B = c52abe3 with this change's files (/tmp/new39)
cd /tmp
PY="/work/main/.venv/bin/python -P"
for spec in "1 4" "16 32" "64 64"; do
  set -- $spec
  for who in A B B A; do
    if [ $who = A ]; then R=/tmp/base39_ridge.py; else R=/tmp/new39_ridge.py; fi
    load=$(cut -d' ' -f1 /proc/loadavg)
    out=$($PY $R bench throughput --workload W1 --in-flight $1 --requests $2 --no-static --threads 2 --json /tmp/abba_${who}_$1_$RANDOM.json 2>/dev/null | grep -E "^ *W1" | head -1 | tr '\n' ' ')
    echo "streams=$1 requests=$2 $who load=$load :: $out"
  done
done
