#!/usr/bin/env bash
# Rust peer comparison: idem's HTTP layer (idem_http::IdempotencyLayer) against the
# `idempotent` crate's tower layer (crates.io, 2.0.0), each over a memory and a Redis store,
# with the bare handler as the baseline. Same handler, route and load as `idem-bench http`:
# POST /v1/workers answering 201, a Location and 8 bytes of JSON; wrk over loopback with a Lua
# script that gives every request its own Idempotency-Key (mode `first`) or cycles a pool of
# keys completed during the warm-up (mode `replay`).
#
#   bench/peer-rs.sh [--seconds 5] [--rounds 3] [--stores "memory redis"]
#                    [--modes "first replay"] [--connections 32] [--threads 1] [--pool 1000]
#                    [--redis-url redis://127.0.0.1:6379] [--peer-scope auth|none]
#                    [--bin PATH (skip the build)] [--raw FILE]
#
# Every slice is a fresh server process (bench/peer-rs, binary `peer-server`: --impl
# idem|peer|bare --store memory|redis), warmed up (1 s of fresh keys; in mode `replay`, 2 s
# that complete the pool of --pool keys per wrk thread), then loaded with
# `wrk -t<threads> -c<connections> -d<seconds>s`. Measured per slice: wrk's req/s, and the
# server's CPU per request: utime+stime of its pid (/proc/<pid>/stat, clock ticks of
# `getconf CLK_TCK`) before and after the wrk run, over wrk's completed requests. With
# --store redis also the Redis server's CPU per request over the same window (its pid from
# INFO server; other clients of that Redis count too). The order alternates every round
# (idem, peer, bare; then bare, peer, idem; ...), so idem and peer take turns going first.
# The table shows medians over the rounds.
#
# The Lua script checks every response: in mode `first` each must be a 201 without
# Idempotent-Replayed, in mode `replay` a 201 with `Idempotent-Replayed: true` (both layers
# set that header on a replay); any other answer is counted, printed, and fails the run (exit
# 1) after the tables, as do wrk socket errors.
#
# Builds peer-server in release with `--ignore-rust-version` (the peer declares Rust 1.98)
# into $CARGO_TARGET_DIR (default bench/peer-rs/target, ignored by git). Needs wrk and, for
# --stores redis, a Redis on --redis-url; keys go under `peer-rs-<run id>-...` prefixes and
# are deleted after each slice (redis-cli --scan).
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=5
ROUNDS=3
STORES="memory redis"
MODES="first replay"
CONNS=32
THREADS=1
POOL=1000
REDIS_URL=redis://127.0.0.1:6379
PEER_SCOPE=auth
BIN=""
RAW=""
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) SECS=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --stores) STORES=$2; shift 2 ;;
        --modes) MODES=$2; shift 2 ;;
        --connections) CONNS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --pool) POOL=$2; shift 2 ;;
        --redis-url) REDIS_URL=$2; shift 2 ;;
        --peer-scope) PEER_SCOPE=$2; shift 2 ;;
        --bin) BIN=$2; shift 2 ;;
        --raw) RAW=$2; shift 2 ;;
        -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

command -v wrk >/dev/null || { echo "wrk not found (apt-get install -y wrk)" >&2; exit 1; }
if [ -z "$BIN" ]; then
    TARGET=${CARGO_TARGET_DIR:-$PWD/bench/peer-rs/target}
    CARGO_TARGET_DIR=$TARGET cargo build --release --ignore-rust-version \
        --manifest-path bench/peer-rs/Cargo.toml >&2
    BIN=$TARGET/release/peer-server
fi
[ -x "$BIN" ] || { echo "no peer-server binary at $BIN" >&2; exit 1; }

TICK=$(getconf CLK_TCK)
RUN=$(date +%s)-$$
WORK=$(mktemp -d /tmp/peer-rs.XXXXXX)
RAW=${RAW:-$WORK/raw.tsv}
LUA=$WORK/keys.lua
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP PIPE

cat > "$LUA" <<'EOF'
-- Every request its own key (mode "first"), or keys cycled from a per-thread pool of `pool`
-- keys (mode "replay"). The run id makes keys unique across slices, the thread id across
-- wrk threads. response() checks every answer; done() prints one CHECK line.
local threads = {}
function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end
local counter = 0
local prefix = "k"
local mode = "first"
local pool = 1000
seen, non2xx, not201, replayed, fresh = 0, 0, 0, 0, 0
codes = {}
function init(args)
  mode = args[1] or "first"
  prefix = (args[2] or "run") .. "-" .. tid .. "-"
  pool = tonumber(args[3] or "1000")
end
function request()
  counter = counter + 1
  local n = counter
  if mode == "replay" then n = counter % pool end
  return wrk.format("POST", "/v1/workers", {
    ["Authorization"] = "Bearer bench-token",
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = prefix .. n,
  }, '{"gpus":8}')
end
function response(status, headers, body)
  seen = seen + 1
  if status < 200 or status > 299 then non2xx = non2xx + 1 end
  if status ~= 201 then
    not201 = not201 + 1
    codes[status] = (codes[status] or 0) + 1
  end
  local r = headers["idempotent-replayed"] or headers["Idempotent-Replayed"]
  if r == "true" then replayed = replayed + 1 else fresh = fresh + 1 end
end
function done(summary, latency, requests)
  local t = { seen = 0, non2xx = 0, not201 = 0, replayed = 0, fresh = 0 }
  local all = {}
  for _, thread in ipairs(threads) do
    for k, _ in pairs(t) do t[k] = t[k] + (thread:get(k) or 0) end
    for code, n in pairs(thread:get("codes") or {}) do all[code] = (all[code] or 0) + n end
  end
  local list = {}
  for code, n in pairs(all) do table.insert(list, code .. "x" .. n) end
  if #list == 0 then list = { "-" } end
  io.write(string.format("CHECK seen=%d non2xx=%d not201=%d replayed=%d fresh=%d codes=%s\n",
    t.seen, t.non2xx, t.not201, t.replayed, t.fresh, table.concat(list, ",")))
end
EOF

REDIS_PID=""
redis_ticks() {
    if [ -n "$REDIS_PID" ] && [ -r "/proc/$REDIS_PID/stat" ]; then cpu_ticks "$REDIS_PID"; else echo 0; fi
}
cpu_ticks() {
    local s
    s=$(cat "/proc/$1/stat")
    s=${s##*) }
    # shellcheck disable=SC2086
    set -- $s
    # After "(comm) ": field 3 (state) is $1, so utime (14) is ${12} and stime (15) ${13}.
    echo $(( ${12} + ${13} ))
}

# Runs wrk; prints "<requests> <req/s> <socket errors> <CHECK fields>".
run_wrk() { # url seconds mode keyrun
    local out reqs rps errs check
    out=$(wrk -t"$THREADS" -c"$CONNS" -d"$2"s -s "$LUA" "$1" -- "$3" "$4" "$POOL" 2>&1) || {
        echo "wrk failed: $out" >&2; return 1; }
    reqs=$(awk '/requests in/{print $1}' <<<"$out")
    rps=$(awk '/^Requests\/sec:/{print $2}' <<<"$out")
    errs=$(awk '/Socket errors:/{gsub(",",""); print $4+$6+$8+$10}' <<<"$out")
    check=$(grep '^CHECK' <<<"$out" | cut -d' ' -f2-)
    echo "${reqs:-0} ${rps:-0} ${errs:-0} ${check:-missing}"
}

start_server() { # impl store run
    local log=$WORK/server-$3.log i
    : >"$log"
    "$BIN" --impl "$1" --store "$2" --port 0 --run "$3" --redis-url "$REDIS_URL" \
        --peer-scope "$PEER_SCOPE" >"$log" 2>&1 &
    SERVER_PID=$!
    for i in $(seq 100); do
        if grep -q '^ready' "$log"; then
            URL=$(awk '/^ready/{print $4}' "$log")
            return 0
        fi
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.1
    done
    echo "peer-server --impl $1 --store $2 did not start:" >&2
    cat "$log" >&2
    return 1
}

stop_server() {
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}

redis_forget() { # run id: delete the slice's keys
    command -v redis-cli >/dev/null || return 0
    redis-cli -u "$REDIS_URL" --scan --pattern "peer-rs-$1-*" 2>/dev/null \
        | xargs -r -n 1000 redis-cli -u "$REDIS_URL" UNLINK >/dev/null 2>&1 || true
}

FAILED=0
# Parses "seen=.. non2xx=.. not201=.. replayed=.. fresh=.. codes=.." into shell variables.
check_ok() { # mode check-fields requests errors  -> 0 when every response was as expected
    local mode=$1 seen non2xx not201 replayed fresh codes kv
    for kv in $2; do local "${kv%%=*}"="${kv#*=}"; done
    [ "${4:-0}" = 0 ] || return 1
    [ "$not201" = 0 ] || return 1
    if [ "$mode" = first ]; then [ "$replayed" = 0 ]; else [ "$fresh" = 0 ]; fi
}

printf 'store\tmode\timpl\tround\trequests\treq_s\tserver_cpu_us_per_req\tredis_cpu_us_per_req\tsocket_errors\tcheck\n' >"$RAW"
echo "peer-server: $BIN; wrk -t$THREADS -c$CONNS, $ROUNDS x ${SECS} s per server; CLK_TCK $TICK; run $RUN" >&2
for store in $STORES; do
    REDIS_PID=""
    if [ "$store" = redis ]; then
        REDIS_PID=$(redis-cli -u "$REDIS_URL" info server 2>/dev/null | awk -F: '/^process_id/{print $2}' | tr -d '\r' || true)
    fi
    for mode in $MODES; do
        for round in $(seq "$ROUNDS"); do
            if [ $((round % 2)) = 1 ]; then order="idem peer bare"; else order="bare peer idem"; fi
            for impl in $order; do
                slice="$RUN-$store-$mode-$round-$impl"
                start_server "$impl" "$store" "$slice"
                if [ "$mode" = replay ]; then
                    keys="$slice-pool"
                    out=$(run_wrk "$URL" 2 replay "$keys"); read -r wreqs _ werrs wcheck <<<"$out"
                    if [ "$wreqs" -lt $((POOL * THREADS)) ]; then
                        echo "warm-up did not complete the pool ($wreqs requests < $((POOL * THREADS)))" >&2; exit 1
                    fi
                else
                    out=$(run_wrk "$URL" 1 first "$slice-warm"); read -r wreqs _ werrs wcheck <<<"$out"
                fi
                case "$wcheck" in *"non2xx=0 "*) ;; *)
                    if [ "$impl" != bare ]; then echo "warm-up $impl $store $mode: $wcheck" >&2; FAILED=1; fi ;;
                esac
                [ "$mode" = replay ] || keys="$slice-load"
                c0=$(cpu_ticks "$SERVER_PID"); r0=$(redis_ticks)
                out=$(run_wrk "$URL" "$SECS" "$mode" "$keys"); read -r reqs rps errs check <<<"$out"
                c1=$(cpu_ticks "$SERVER_PID"); r1=$(redis_ticks)
                stop_server
                [ "$store" = redis ] && redis_forget "$slice"
                cpu=$(awk -v d=$((c1 - c0)) -v n="$reqs" -v t="$TICK" 'BEGIN{printf "%.2f", n ? d / t * 1e6 / n : 0}')
                rcpu=$(awk -v d=$((r1 - r0)) -v n="$reqs" -v t="$TICK" 'BEGIN{printf "%.2f", n ? d / t * 1e6 / n : 0}')
                status=ok
                # The bare server has no idempotency: every answer is a fresh 201, so its
                # replay-mode check (replayed answers) does not apply; its 201s still must.
                if [ "$impl" = bare ]; then
                    case "$check" in *"not201=0 "*) [ "$errs" = 0 ] || status=FAIL ;; *) status=FAIL ;; esac
                elif ! check_ok "$mode" "$check" "$reqs" "$errs"; then
                    status=FAIL
                fi
                [ "$status" = ok ] || FAILED=1
                printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s %s\n' "$store" "$mode" "$impl" "$round" \
                    "$reqs" "$rps" "$cpu" "$rcpu" "$errs" "$status" "$check" >>"$RAW"
                printf '%-6s %-6s %-4s round %s: %7.0f req/s %7s us/req server %6s us/req redis  %s %s\n' \
                    "$store" "$mode" "$impl" "$round" "$rps" "$cpu" "$rcpu" "$status" "$check" >&2
            done
        done
    done
done

# Medians per store/mode/impl, then one table per store/mode.
awk -F'\t' -v secs="$SECS" -v rounds="$ROUNDS" -v conns="$CONNS" -v threads="$THREADS" '
function median(list,   n, a, i, j, t) {
    n = split(list, a, " ")
    for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
NR == 1 { next }
{
    k = $1 SUBSEP $2 SUBSEP $3
    rps[k] = rps[k] " " $6; cpu[k] = cpu[k] " " $7; rcpu[k] = rcpu[k] " " $8
    if ($10 !~ /^ok/) bad[k]++
    if (!(($1 SUBSEP $2) in seen)) { seen[$1 SUBSEP $2] = 1; order[++n] = $1 SUBSEP $2 }
}
END {
    for (i = 1; i <= n; i++) {
        split(order[i], sm, SUBSEP); s = sm[1]; m = sm[2]
        printf "\n%s store, mode %s (wrk -t%s -c%s, %s x %s s per server, medians)\n", s, m, threads, conns, rounds, secs
        printf "| impl | req/s | server CPU us/req | added CPU us/req over bare | Redis CPU us/req | failed slices |\n"
        printf "|---|---:|---:|---:|---:|---:|\n"
        split("bare idem peer", impls, " ")
        for (j = 1; j <= 3; j++) {
            k = s SUBSEP m SUBSEP impls[j]
            if (!(k in rps)) continue
            R[impls[j]] = median(rps[k]); C[impls[j]] = median(cpu[k]); RC[impls[j]] = median(rcpu[k])
            added = impls[j] == "bare" ? "-" : sprintf("%.2f", C[impls[j]] - C["bare"])
            printf "| %s | %.0f | %.2f | %s | %s | %d |\n", impls[j], R[impls[j]], C[impls[j]], added,
                s == "redis" ? sprintf("%.2f", RC[impls[j]]) : "-", bad[k] + 0
        }
        if (("idem" in R) && ("peer" in R) && R["peer"] > 0 && C["peer"] > 0)
            printf "idem/peer throughput %.2fx; idem CPU / peer CPU %.2fx; added CPU over bare: idem %.2f us, peer %.2f us\n",
                R["idem"] / R["peer"], C["idem"] / C["peer"], C["idem"] - C["bare"], C["peer"] - C["bare"]
        delete R; delete C; delete RC
    }
}' "$RAW"
echo "raw slices: $RAW" >&2
if [ "$FAILED" != 0 ]; then
    echo "FAILED: some responses were not what the mode expects (see the CHECK fields above)" >&2
    exit 1
fi
