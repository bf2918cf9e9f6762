//! The conformance suite (every scenario, the model-based test) against a real Redis
//! Cluster: `IDEM_REDIS_CLUSTER_URLS`, default the six nodes (three primaries, three
//! replicas) `scripts/redis-cluster` starts on 127.0.0.1:7000-7005. Fails, never skips,
//! when the cluster is not reachable. Plus what only a cluster shows: records spread over
//! every primary, and the start-up checks reach every primary.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ManualClock, Scope, Store};
use idem_redis::{Config, PersistenceCheck, RedisStore};

/// Each scenario gets a backend of its own; it remembers the random prefix it opened so a
/// peer opens a second, independent cluster connection on the same records.
#[derive(Default)]
struct Cluster {
    prefix: Mutex<Option<String>>,
}

#[async_trait]
impl idem_conformance::Backend for Cluster {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let prefix = common::fresh_prefix();
        *self.prefix.lock().expect("prefix lock") = Some(prefix.clone());
        Arc::new(common::connect_cluster(common::test_config(&prefix, Arc::new(clock))).await)
    }

    async fn open_peer(&self, _store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let prefix = self.prefix.lock().expect("prefix lock").clone().expect("open ran first");
        Arc::new(common::connect_cluster(common::test_config(&prefix, Arc::new(clock))).await)
    }

    /// The production configuration: every `now` is the `TIME` of the key's primary.
    async fn open_server_clock(&self) -> Option<Arc<dyn Store>> {
        let config = Config::default().with_prefix(common::fresh_prefix());
        Some(Arc::new(common::connect_cluster(config).await))
    }
}

idem_conformance::store_tests!(Cluster::default());

fn req(key: &str) -> ClaimRequest {
    let scope = Scope::new("p", Endpoint::new("POST", "/v1/workers")).expect("scope");
    ClaimRequest::new(
        scope,
        IdempotencyKey::parse(key.as_bytes()).expect("key"),
        Fingerprint::of_bytes(b"body"),
        Duration::from_secs(30),
        Duration::from_secs(60),
    )
}

/// `CLUSTER KEYSLOT` and the primary serving it, asked of the cluster itself.
async fn primary_of(key: &str) -> String {
    let client = redis::Client::open(common::cluster_urls()[0].as_str()).expect("url");
    let mut c = client.get_multiplexed_async_connection().await.expect("node connection");
    let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut c).await.expect("KEYSLOT");
    let shards: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut c).await.expect("SLOTS");
    for shard in shards {
        let (Some(redis::Value::Int(lo)), Some(redis::Value::Int(hi))) = (shard.first(), shard.get(1)) else {
            continue;
        };
        if (*lo..=*hi).contains(&slot) {
            return format!("{:?}", shard.get(2));
        }
    }
    panic!("slot {slot} has no primary");
}

/// Records land on every primary (the hash tag is the record id), and each is served by
/// its own slot's primary: 60 claims touch all three shards and each reads back.
#[tokio::test]
async fn records_spread_over_every_primary() {
    let store = common::connect_cluster(Config::default().with_prefix(common::fresh_prefix())).await;
    let mut primaries = std::collections::BTreeSet::new();
    for i in 0..60 {
        let r = req(&format!("k{i}"));
        let ClaimOutcome::Claimed(rec) = store.claim(r).await.expect("claim") else { panic!("fresh key") };
        assert_eq!(store.get(rec.id).await.expect("get").expect("present").token, rec.token);
        primaries.insert(primary_of(&store.record_key(rec.id)).await);
    }
    assert_eq!(primaries.len(), 3, "three primaries serve records: {primaries:?}");
}

/// The persistence check runs on every primary: the test cluster runs without persistence,
/// so `Refuse` refuses (naming a node) and the default `Warn` starts.
#[tokio::test]
async fn persistence_check_reaches_the_cluster_primaries() {
    let urls = common::cluster_urls();
    let e = RedisStore::connect_cluster(&urls, Config::default().with_persistence_check(PersistenceCheck::Refuse))
        .await
        .expect_err("no persistence on the test cluster");
    assert!(matches!(&e, idem_redis::Error::NotDurable { node, .. } if node.contains("127.0.0.1")), "{e:?}");
    RedisStore::connect_cluster(&urls, Config::default()).await.expect("Warn (the default) starts");
}

/// Pins: a single-node URL pointed at a node of a three-primary cluster started quietly, then served only that
/// node's slots and failed every other key with `MOVED` (a permanent error, HTTP 500) for
/// good; start-up refuses it and names `connect_cluster`. Nothing is written to the node.
///
/// Pins `docs/failures.md#redis-wait-refused-or-redirected-past-its-budget`.
#[tokio::test]
async fn a_single_node_connection_to_a_cluster_node_is_refused() {
    let url = common::cluster_urls().into_iter().next().expect("a node");
    let e = RedisStore::connect(&url, Config::default().with_prefix(common::fresh_prefix()))
        .await
        .expect_err("a cluster node is not a single server");
    assert!(matches!(&e, idem_redis::Error::Config(m) if m.contains("connect_cluster")), "{e:?}");
    assert!(!e.is_retryable());
}
