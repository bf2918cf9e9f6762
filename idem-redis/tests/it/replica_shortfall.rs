//! Pins: on a Redis Cluster with `WAIT 1`, a shard that lost its replica turned a third of
//! the key space into hung requests: every `WAIT` to it blocked the node's one multiplexed
//! connection for its whole timeout, so its calls queued behind each other past any
//! deadline, and nothing said why. Now a shard known to be short is refused before writing
//! (`Shortfall::Strict`, a retryable error at once) or written with the replicas it has
//! (`Shortfall::Degrade`), and the other shards keep serving.
//!
//! Pins `docs/failures.md#redis-cluster-shard-without-its-replica`.
//!
//! Runs its own six-node cluster on 7160-7165 (it kills nodes), never the shared one.

use crate::cluster_nodes as cluster;

use std::time::{Duration, Instant};

use cluster::PrivateCluster;
use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use idem_redis::{Config, Error, RedisStore, ReplicaAck, Shortfall};

const NODE_TIMEOUT_MS: u64 = 1_000;
/// The HTTP layer's default store deadline: a call must answer within it.
const DEADLINE: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(1);

fn req(key: &str) -> ClaimRequest {
    let scope = Scope::new("p", Endpoint::new("POST", "/v1/workers")).expect("scope");
    ClaimRequest::new(
        scope,
        IdempotencyKey::parse(key.as_bytes()).expect("key"),
        Fingerprint::of_bytes(b"body"),
        Duration::from_secs(30),
        Duration::from_secs(600),
    )
}

async fn store(cluster: &PrivateCluster, prefix: &str, shortfall: Shortfall) -> RedisStore {
    let ack = ReplicaAck::new(1, WAIT).with_shortfall(shortfall);
    let config = Config::default().with_prefix(prefix).with_replica_ack(Some(ack));
    RedisStore::connect_cluster(cluster.urls(), config).await.expect("connect")
}

/// What one operation (claim, then complete) came to, and how long it took.
#[derive(Debug)]
enum Outcome {
    Done,
    /// Refused retryably with a shortfall (`timeout_ms` 0: before writing).
    Shortfall {
        timeout_ms: u64,
    },
    /// Missed the deadline: the hung request of the issue.
    TimedOut,
    Other(#[allow(dead_code, reason = "read through Debug in the assertion messages")] String),
}

async fn operation(store: RedisStore, key: String) -> (String, Outcome, Duration) {
    let started = Instant::now();
    let outcome = match tokio::time::timeout(DEADLINE, store.claim(req(&key))).await {
        Err(_) => Outcome::TimedOut,
        Ok(Ok(ClaimOutcome::Claimed(r))) => {
            match tokio::time::timeout(
                DEADLINE,
                store.complete(r.id, r.token, StoredResponse::new(201, vec![], vec![])),
            )
            .await
            {
                Err(_) => Outcome::TimedOut,
                Ok(Ok(_)) => Outcome::Done,
                Ok(Err(e)) => Outcome::Other(format!("complete: {e:?}")),
            }
        }
        Ok(Ok(other)) => Outcome::Other(format!("fresh key: {other:?}")),
        Ok(Err(e)) => match std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Error>()) {
            Some(Error::ReplicaShortfall { timeout_ms, .. }) if e.is_retryable() => {
                Outcome::Shortfall { timeout_ms: *timeout_ms }
            }
            _ => Outcome::Other(format!("claim: {e:?}")),
        },
    };
    (key, outcome, started.elapsed())
}

/// `n` operations on fresh keys, 32 at a time, each with the primary that serves it.
async fn storm(cluster: &PrivateCluster, store: &RedisStore, tag: &str, n: usize) -> Vec<(u16, Outcome, Duration)> {
    let mut out = Vec::new();
    let keys: Vec<String> = (0..n).map(|i| format!("{tag}-{i}")).collect();
    for batch in keys.chunks(32) {
        let tasks: Vec<_> = batch.iter().map(|k| tokio::spawn(operation(store.clone(), k.clone()))).collect();
        for t in tasks {
            let (key, outcome, took) = t.await.expect("task");
            let id = req(&key).id();
            out.push((cluster.primary_for(&store.record_key(id)).await, outcome, took));
        }
    }
    out
}

/// Waits (up to 30 s) until `port` is marked failed by the cluster.
async fn wait_failed(cluster: &PrivateCluster, port: u16) {
    for _ in 0..300 {
        if cluster.nodes().await.is_some_and(|n| n.iter().any(|n| n.port == port && n.failed)) {
            return;
        }
        // Waiting for gossip to mark the node failed: no clock is involved.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("node {port} was never marked failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shard_without_its_replica_answers_at_once() {
    let mut cluster = PrivateCluster::start(7160, NODE_TIMEOUT_MS).await;
    let primaries = cluster.primaries().await;
    let short = primaries[0].port;
    let replica = cluster.replica_of(short).await;
    let running = store(&cluster, "rs-run:", Shortfall::Strict).await;
    let mut counts = running.replicas().await.expect("replicas");
    counts.sort();
    assert_eq!(counts.iter().map(|c| c.1).collect::<Vec<_>>(), vec![1, 1, 1], "{counts:?}");

    // The replica dies under a running store: its primary's next WAIT falls short once, after
    // the WAIT timeout; from then on the store knows, and the shard's claims are refused at once.
    let mut on_short = (0..).map(|i| format!("k{i}")).map(|k| {
        let id = req(&k).id();
        (k, running.record_key(id))
    });
    let mut short_keys = Vec::new();
    while short_keys.len() < 3 {
        let (k, rk) = on_short.next().expect("keys");
        if cluster.primary_for(&rk).await == short {
            short_keys.push(k);
        }
    }
    // One record on that shard completed while it still had its replica.
    let (_, done, _) = operation(running.clone(), short_keys[2].clone()).await;
    assert!(matches!(done, Outcome::Done), "{done:?}");
    cluster.kill(replica);
    let (_, first, took) = operation(running.clone(), short_keys[0].clone()).await;
    assert!(matches!(first, Outcome::Shortfall { timeout_ms: 1_000 }), "{first:?} after {took:?}");
    let (_, second, took) = operation(running.clone(), short_keys[1].clone()).await;
    assert!(matches!(second, Outcome::Shortfall { timeout_ms: 0 }), "{second:?}");
    assert!(took < Duration::from_millis(100), "refused before writing, at once: {took:?}");
    // A record already there is still answered: the completed one replays, nothing is refused.
    match running.claim(req(&short_keys[2])).await.expect("a stored response is still answered") {
        ClaimOutcome::Existing { record, .. } => assert!(record.response.is_some(), "{record:?}"),
        other => panic!("the completed record: {other:?}"),
    }

    // Once the cluster marks the replica failed, a store started afresh reads it at start-up.
    wait_failed(&cluster, replica).await;
    let strict = store(&cluster, "rs-strict:", Shortfall::Strict).await;
    let counts = strict.replicas().await.expect("replicas");
    assert!(counts.contains(&(format!("127.0.0.1:{short}"), 0)), "{counts:?}");
    let results = storm(&cluster, &strict, "strict", 96).await;
    let mut slowest = Duration::ZERO;
    for (port, outcome, took) in &results {
        slowest = slowest.max(*took);
        if *port == short {
            assert!(matches!(outcome, Outcome::Shortfall { timeout_ms: 0 }), "{port}: {outcome:?} after {took:?}");
        } else {
            assert!(matches!(outcome, Outcome::Done), "{port} keeps serving: {outcome:?} after {took:?}");
        }
    }
    let refused = results.iter().filter(|r| r.0 == short).count();
    assert!(refused > 0 && refused < results.len(), "keys on every shard: {refused} of {}", results.len());
    println!("strict: {refused} of {} refused (shard {short}), slowest {slowest:?}", results.len());
    through_the_layer(&cluster, &strict, short).await;

    let degrade = store(&cluster, "rs-degrade:", Shortfall::Degrade).await;
    let results = storm(&cluster, &degrade, "degrade", 96).await;
    let slowest = results.iter().map(|r| r.2).max().unwrap_or_default();
    for (port, outcome, took) in &results {
        assert!(matches!(outcome, Outcome::Done), "{port}: {outcome:?} after {took:?}");
    }
    assert!(degrade.replicas().await.expect("replicas").contains(&(format!("127.0.0.1:{short}"), 0)));
    println!("degrade: {} of {} completed, slowest {slowest:?}", results.len(), results.len());

    // A primary killed and not replaced: its replica is promoted and has none of its own.
    // The running store learns it from the topology change and refuses that shard at once.
    let killed = primaries[1].port;
    let promoted = cluster.replica_of(killed).await;
    // A fresh key per attempt: an attempt cut off by the deadline mid-failover may have left
    // its claim in flight.
    let mut keys = Vec::new();
    while keys.len() < 200 {
        let (k, rk) = on_short.next().expect("keys");
        if cluster.primary_for(&rk).await == killed {
            keys.push(k);
        }
    }
    let mut keys = keys.into_iter();
    cluster.kill(killed);
    let started = Instant::now();
    loop {
        let (_, outcome, took) = operation(running.clone(), keys.next().expect("enough keys")).await;
        if matches!(outcome, Outcome::Shortfall { timeout_ms: 0 }) && took < Duration::from_millis(100) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{promoted} promoted but not refused: {outcome:?}");
        assert!(!matches!(outcome, Outcome::Done), "a claim on a shard without a replica was acknowledged");
        // Waiting for the failover: no clock is involved.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let counts = running.replicas().await.expect("replicas");
    assert!(counts.contains(&(format!("127.0.0.1:{promoted}"), 0)), "{counts:?}");
    println!("promoted {promoted} refused {:?} after the kill", started.elapsed());
}

/// What a client sees through the HTTP layer on the strict store: a key on the short shard
/// gets 503 with `Retry-After` well within the layer's store deadline, and the handler
/// never runs; a key on another shard gets the handler's 201.
async fn through_the_layer(cluster: &PrivateCluster, store: &RedisStore, short: u16) {
    use tower::{Layer, ServiceExt};
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = tower::service_fn({
        let runs = runs.clone();
        move |_: http::Request<http_body_util::Full<bytes::Bytes>>| {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut res = http::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")));
            *res.status_mut() = http::StatusCode::CREATED;
            async { Ok::<_, std::convert::Infallible>(res) }
        }
    });
    let service = idem_http::IdempotencyLayer::new(std::sync::Arc::new(store.clone())).layer(handler);
    let (mut on_short, mut elsewhere) = (None, None);
    for i in 0.. {
        let key = format!("http-{i}");
        // The layer's record id for this key: the bearer principal and the concrete path.
        let scope = Scope::new(idem_http::BearerToken::principal_for(b"tok"), Endpoint::new("POST", "/v1/workers"))
            .expect("scope");
        let id = scope.record_id(&IdempotencyKey::parse(key.as_bytes()).expect("key"));
        let slot =
            if cluster.primary_for(&store.record_key(id)).await == short { &mut on_short } else { &mut elsewhere };
        slot.get_or_insert(key);
        if on_short.is_some() && elsewhere.is_some() {
            break;
        }
    }
    for (key, expected) in [(on_short.expect("a key"), 503), (elsewhere.expect("a key"), 201)] {
        let req = http::Request::post("/v1/workers")
            .header("authorization", "Bearer tok")
            .header("idempotency-key", &key)
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .expect("request");
        let started = Instant::now();
        let res = service.clone().oneshot(req).await.expect("infallible");
        let took = started.elapsed();
        assert_eq!(res.status().as_u16(), expected, "{key} after {took:?}");
        if expected == 503 {
            assert!(res.headers().contains_key("retry-after"), "{:?}", res.headers());
            assert!(took < Duration::from_millis(500), "answered at once, not at the deadline: {took:?}");
        }
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1, "the handler ran for the other shard's key only");
}
