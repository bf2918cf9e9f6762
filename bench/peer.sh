#!/usr/bin/env bash
# Peer comparison: idem-redis claim+complete against AWS Powertools for Lambda (Python) with
# its Redis persistence layer, same local Redis, same workload shape (N concurrent callers,
# distinct keys, claim -> function -> stored response), at each concurrency given.
#
#   bench/peer.sh [concurrency...]        (default: 1 8 32)
#
# Installs the peer from PyPI into $IDEM_PEER_VENV (default /tmp/idem-peer-venv) on first
# use; nothing of it is committed. Needs Redis on 127.0.0.1:6379 and a release build of
# idem-bench ($IDEM_BENCH, default $CARGO_TARGET_DIR/release/idem-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${IDEM_PEER_VENV:-/tmp/idem-peer-venv}
BENCH=${IDEM_BENCH:-${CARGO_TARGET_DIR:-target}/release/idem-bench}
COUNT=${IDEM_PEER_COUNT:-4000}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import aws_lambda_powertools, redis, boto3" 2>/dev/null; then
    python3 -m venv "$VENV"
    # boto3: the idempotency package imports its DynamoDB layer unconditionally.
    "$VENV/bin/pip" install -q aws-lambda-powertools redis boto3
fi
"$VENV/bin/pip" show aws-lambda-powertools redis | grep -E '^(Name|Version)' | paste - - 
printf '%-6s %12s %12s %8s\n' conc "idem cyc/s" "peer cyc/s" ratio
for c in "${@:-1 8 32}"; do
    for conc in $c; do
        ours=$("$BENCH" cycles --backend redis --no-replay --concurrency "$conc" --count "$((COUNT * 4))" | awk 'NR==2{print $4}')
        theirs=$("$VENV/bin/python" bench/peer_powertools.py --concurrency "$conc" --count "$COUNT" | awk 'NR==2{print $4}')
        awk -v c="$conc" -v a="$ours" -v b="$theirs" 'BEGIN{printf "%-6s %12.0f %12.0f %7.1fx\n", c, a, b, a/b}'
    done
done
