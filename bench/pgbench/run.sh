#!/bin/sh
# run.sh DB [CLIENTS] [ROUNDS]: the scripts of this directory in turns, 3 s each, one
# pgbench per script per round (prepared protocol), as the postgres user; prints
# pairs/s (pgbench's tps: one transaction per statement, a pair per script run) per
# round and the mean per script. Run setup.sql in DB first.
set -eu
db=${1:?database}; c=${2:-1}; rounds=${3:-5}
dir=$(cd "$(dirname "$0")" && pwd)
for r in $(seq "$rounds"); do
  for s in raw raw_async fence wide epoch kept; do
    tps=$(pgbench -n -M prepared -f "$dir/$s.sql" -T 3 -c "$c" -j "$((c < 2 ? c : 2))" "$db" 2>/dev/null | awk '/^tps/ {print $3}')
    echo "$r $s $tps"
  done
done | awk '{print; s[$2] += $3; n[$2]++} END {for (k in s) printf "mean %-9s %.0f\n", k, s[k] / n[k]}'
