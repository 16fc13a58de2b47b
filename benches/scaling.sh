#!/usr/bin/env bash
# The audit's scaling table (BENCHMARKS.md, "Audits at production shapes"): wall seconds and peak
# RSS of `check ROUTER --batch 4 --seq-len S`, default and `--exhaustive`, one run per cell, with
# the load average beside each row. Usage: [EXHAUSTIVE_UP_TO=S] benches/scaling.sh [BIN]
set -euo pipefail
bin=${1:-target/release/moe-audit}
skip_over=${EXHAUSTIVE_UP_TO:-8192}
cell() { # prints "seconds peak-MiB" of one check
  /usr/bin/time -f "%e %M" "$bin" check "$@" >/dev/null 2>/tmp/moe-audit-scaling.$$ || true
  tail -1 /tmp/moe-audit-scaling.$$ | awk '{printf "%s s | %.0f MiB", $1, $2 / 1024}'
}
echo '| router | S | default s | default peak | `--exhaustive` s | `--exhaustive` peak | load (1/5/15 min) |'
echo "|---|---|---|---|---|---|---|"
for router in megatron-probs deepseek-v3 benches/routers/megatron-probs-e256.toml; do
  for s in 512 1024 2048 4096 8192; do
    default=$(cell "$router" --batch 4 --seq-len "$s")
    if [ "$s" -le "$skip_over" ]; then exhaustive=$(cell "$router" --batch 4 --seq-len "$s" --exhaustive); else exhaustive="not run"; fi
    echo "| $(basename "$router" .toml) | $s | $default | $exhaustive | $(cut -d' ' -f1-3 /proc/loadavg) |"
  done
done
rm -f /tmp/moe-audit-scaling.$$
