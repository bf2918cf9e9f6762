#!/usr/bin/env bash
# Every `cycles` row of BENCHMARKS.md: each backend at 1, 8, 32 and 128 concurrent callers,
# library against its raw baseline in the same process. Appends to bench/results/cycles.csv
# and redraws bench/throughput.svg.
#
#   bench/cycles.sh [backend...]          (default: memory redb sqlite redis postgres)
#
# Needs Redis on 127.0.0.1:6379, Postgres on 127.0.0.1:5432 (user postgres, db test), and a
# release build: cargo build --release -p idem-bench. Embedded files go under
# $IDEM_BENCH_DIR (default the system temp dir); fsync on tmpfs is free, use a real disk.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${IDEM_BENCH:-${CARGO_TARGET_DIR:-target}/release/idem-bench}
CSV=bench/results/cycles.csv
mkdir -p bench/results
[ -s "$CSV" ] || echo "backend,concurrency,cycle,cycles,lib_cycles_per_s,lib_p50_ms,lib_p99_ms,base_cycles_per_s,base_p50_ms,base_p99_ms,ratio,ops_per_batch" > "$CSV"
count() {
    case $1 in
        memory) echo 200000 ;;
        redis) echo 20000 ;;
        *) echo 3000 ;;
    esac
}
for backend in "${@:-memory redb sqlite redis postgres}"; do
    for b in $backend; do
        for conc in 1 8 32 128; do
            "$BENCH" cycles --backend "$b" --concurrency "$conc" --count "$(count "$b")" --csv "$CSV" | sed -n 2p
        done
    done
done
python3 bench/plot.py "$CSV" bench/throughput.svg
