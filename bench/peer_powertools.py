#!/usr/bin/env python3
"""The peer side of the idempotency comparison: AWS Powertools for Lambda (Python), with its
Redis persistence layer, on the same local Redis as idem-redis.

Workload, the same shape as `idem-bench cycles --backend redis --no-replay`: a decorated
function is called by N concurrent callers (threads), every call with a distinct
idempotency key, so each call is a first-time claim (the layer's in-progress record), the
function body, and the completion (the stored response, a 256-byte body plus a Location).
Prints calls per second and p50/p99 latency per call.

The package is installed from PyPI at bench time by bench/peer.sh into a virtualenv; it is
never committed. Keys carry a per-run prefix (`idem-bench-peer:<run>`) and expire after
600 s; nothing is deleted.
"""

import argparse
import os
import threading
import time
import uuid
import warnings

import redis
from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
from aws_lambda_powertools.utilities.idempotency.persistence.redis import RedisCachePersistenceLayer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=6379)
    args = parser.parse_args()

    # The layer warns that it is deprecated in favour of CachePersistenceLayer (same code)
    # and that no Lambda context was registered (there is none outside Lambda).
    warnings.simplefilter("ignore")
    run = uuid.uuid4().hex[:12]
    # One connection per caller, as the Rust side's multiplexed connection never runs out.
    client = redis.Redis(
        host=args.host, port=args.port, decode_responses=True, max_connections=args.concurrency + 8
    )
    layer = RedisCachePersistenceLayer(client=client)
    config = IdempotencyConfig(expires_after_seconds=600)
    body = "x" * 256

    @idempotent_function(
        data_keyword_argument="order",
        persistence_store=layer,
        config=config,
        key_prefix=f"idem-bench-peer:{run}",
    )
    def create_worker(order: dict) -> dict:
        return {"status": 201, "location": "/v1/workers/7c3f5d1e-91a4", "body": body}

    def drive(first: int, count: int) -> tuple[float, list[float]]:
        lock = threading.Lock()
        state = {"next": 0}
        latencies: list[float] = []
        errors: list[BaseException] = []

        def caller() -> None:
            mine = []
            try:
                run_calls(mine)
            except BaseException as e:  # noqa: BLE001 - reported after join
                with lock:
                    errors.append(e)
            with lock:
                latencies.extend(mine)

        def run_calls(mine: list[float]) -> None:
            while True:
                with lock:
                    i = state["next"]
                    state["next"] += 1
                if i >= count:
                    break
                t = time.perf_counter()
                out = create_worker(order={"key": f"{first + i}", "gpus": 8})
                mine.append(time.perf_counter() - t)
                assert out["status"] == 201

        threads = [threading.Thread(target=caller) for _ in range(args.concurrency)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit(f"{len(errors)} callers failed; first: {errors[0]!r}")
        if len(latencies) != count:
            raise SystemExit(f"{len(latencies)} calls completed, expected {count}")
        return time.perf_counter() - started, sorted(latencies)

    drive(10_000_000, min(200, args.count))  # warm-up: connections, imports, caches
    seconds, lat = drive(0, args.count)

    def q(p: float) -> float:
        return lat[min(len(lat) - 1, round((len(lat) - 1) * p))] * 1e3

    print(f"{'peer':<24} {'conc':>5} {'calls':>7} {'calls/s':>10} {'p50 ms':>9} {'p99 ms':>9}")
    print(
        f"{'powertools-redis':<24} {args.concurrency:>5} {len(lat):>7} {len(lat) / seconds:>10.0f} "
        f"{q(0.5):>9.3f} {q(0.99):>9.3f}"
    )
    print(f"(aws-lambda-powertools, redis-py, python {os.sys.version.split()[0]}, {args.concurrency} threads)")


if __name__ == "__main__":
    main()
