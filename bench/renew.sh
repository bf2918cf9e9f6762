#!/usr/bin/env bash
# Every `renew` row of BENCHMARKS.md: 1,000 long handlers behind the layer renewing their
# leases at the default interval (lease / 3), on each backend, at the leases below (the
# shorter the lease, the more renewals per second). Appends to bench/results/renew.csv.
#
#   bench/renew.sh [backend...]          (default: memory redb sqlite redis postgres)
#
# Needs Redis on 127.0.0.1:6379, Postgres on 127.0.0.1:5432 (user postgres, db test), and a
# release build: cargo build --release -p idem-bench. Embedded files go under
# $IDEM_BENCH_DIR (default the system temp dir); fsync on tmpfs is free, use a real disk.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${IDEM_BENCH:-${CARGO_TARGET_DIR:-target}/release/idem-bench}
CSV=bench/results/renew.csv
mkdir -p bench/results
[ -s "$CSV" ] || echo "backend,handlers,lease_ms,interval_ms,demand_per_s,sustained_per_s,p50_ms,p99_ms,max_ms,late,failed,timed_out,least_left_ms,renewals_per_handler,claim_p50_ms,complete_p50_ms,renewals_per_claim_complete_write,leases_held,on_schedule,load1" > "$CSV"
for b in ${@:-memory redb sqlite redis postgres}; do
    "$BENCH" renew --backend "$b" --lease-ms 2000 --hold-ms 20000 --csv "$CSV" | sed -n "2,3p"
    for lease in 600 300 150 75; do
        "$BENCH" renew --backend "$b" --lease-ms "$lease" --hold-ms 10000 --csv "$CSV" | sed -n "2,3p"
    done
done
