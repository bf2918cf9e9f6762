//! The store on a Redis Cluster whose topology changes under it: a slot migrated between
//! primaries (`ASK` while it moves, `MOVED` after), a script cache the new owner lacks
//! (`NOSCRIPT`), a manual failover (`CLUSTER FAILOVER` on a replica) and a forced one
//! (SIGKILL of a primary), with and without `WAIT 1`. Each test runs its own six-node
//! cluster on private loopback ports (7010-7015, 7030-7035), so the shared cluster on
//! 7000-7005 is never disturbed.

use crate::cluster_nodes as cluster;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cluster::PrivateCluster;
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Receipt, Record, RecordState, Scope, Store,
    StoredResponse,
};
use idem_redis::{Config, RedisStore, ReplicaAck, redis};

/// Node timeout of the private clusters: a killed primary is replaced within a few seconds.
const NODE_TIMEOUT_MS: u64 = 1_000;

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

async fn claim(store: &RedisStore, key: &str) -> Record {
    match store.claim(req(key)).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("fresh key {key}: {other:?}"),
    }
}

fn stat(info: &str, name: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(":calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A record whose slot is being migrated is followed to its new primary: after its key was
/// `MIGRATE`d (slot still `MIGRATING`) the old owner answers `ASK`, and the store sends
/// `ASKING` + the script to the importing node, which lacks the script (`SCRIPT FLUSH`), so
/// the call comes back as `EVAL` there; after `SETSLOT NODE` the stale slot map meets `MOVED`.
/// Every call succeeds; the record ends completed on the new owner only.
#[tokio::test]
async fn a_migrating_slot_is_followed_with_ask_then_moved() {
    let cluster = PrivateCluster::start(7010, NODE_TIMEOUT_MS).await;
    let store =
        RedisStore::connect_cluster(cluster.urls(), Config::default().with_prefix("mig:")).await.expect("connect");
    let r = claim(&store, "k").await;
    let key = store.record_key(r.id);
    let from = cluster.primary_for(&key).await;
    let to = cluster.primaries().await.into_iter().map(|p| p.port).find(|&p| p != from).expect("another primary");
    let (mut src, mut dst) = (cluster.node(from).await, cluster.node(to).await);
    let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(&key).query_async(&mut src).await.expect("KEYSLOT");
    let nodes = cluster.nodes().await.expect("nodes");
    let id = |port: u16| nodes.iter().find(|n| n.port == port).expect("node").id.clone();
    let setslot = |state: &str, node: String| {
        let mut c = redis::cmd("CLUSTER");
        c.arg("SETSLOT").arg(slot).arg(state).arg(node);
        c
    };
    let () = setslot("IMPORTING", id(from)).query_async(&mut dst).await.expect("IMPORTING");
    let () = setslot("MIGRATING", id(to)).query_async(&mut src).await.expect("MIGRATING");
    let _: redis::Value = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(to)
        .arg(&key)
        .arg(0)
        .arg(5_000)
        .query_async(&mut src)
        .await
        .expect("MIGRATE");
    let () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut dst).await.expect("SCRIPT FLUSH");
    let evals_before: String = redis::cmd("INFO").arg("commandstats").query_async(&mut dst).await.expect("INFO");

    // ASK: the key left the old owner while the slot still migrates.
    let got = store.get(r.id).await.expect("get through ASK").expect("present on the importing node");
    assert_eq!(got.token, r.token);
    let done = store.complete(r.id, r.token, StoredResponse::new(201, vec![], b"{}".to_vec())).await;
    let done = done.expect("complete through ASK");
    let evals_after: String = redis::cmd("INFO").arg("commandstats").query_async(&mut dst).await.expect("INFO");
    assert!(stat(&evals_after, "cmdstat_eval") > stat(&evals_before, "cmdstat_eval"), "NOSCRIPT was answered by EVAL");
    assert!(stat(&evals_after, "cmdstat_asking") >= 2, "the calls went through ASKING:\n{evals_after}");
    // The record as written, read back (still through ASK): the receipt reports it.
    let written = store.get(r.id).await.expect("get through ASK").expect("present on the importing node");
    assert_eq!(done, Receipt::of(&written), "the receipt reports the record as written");
    assert_eq!(written.state, RecordState::Completed);

    // MOVED: the migration ends; the store's slot map still names the old owner.
    for p in cluster.primaries().await {
        let mut c = cluster.node(p.port).await;
        let () = setslot("NODE", id(to)).query_async(&mut c).await.expect("SETSLOT NODE");
    }
    let got = store.get(r.id).await.expect("get after MOVED").expect("present");
    assert_eq!(got.state, RecordState::Completed);
    let r2 = store.claim(req("k")).await.expect("claim after MOVED");
    assert!(matches!(r2, ClaimOutcome::Existing { ref record, .. } if record.state == RecordState::Completed));
    let exists: i64 = redis::cmd("EXISTS").arg(&key).query_async(&mut src).await.unwrap_or(0);
    assert_eq!(exists, 0, "the old owner no longer has the record");
}

/// What one failover run saw.
#[derive(Debug, Default)]
struct FailoverRun {
    /// claim + complete pairs that returned Ok.
    completed: u64,
    /// Calls that failed (retryably) while the cluster changed.
    errors: u64,
    /// Acknowledged completed records missing or not completed afterwards.
    lost: u64,
    /// From the fault until the cluster was healthy again (replica promoted and, after a
    /// kill, the old primary back as a replica), ms.
    healed_ms: u128,
}

/// How a failover is brought about.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// `CLUSTER FAILOVER` on the replica of the first primary.
    Manual,
    /// SIGKILL of the first primary; restarted (it rejoins as a replica) once its replica
    /// took over.
    Kill,
}

async fn failover(cluster: &mut PrivateCluster, fault: Fault) {
    let primary = cluster.primaries().await[0].port;
    let replica = cluster.replica_of(primary).await;
    match fault {
        Fault::Manual => {
            let mut r = cluster.node(replica).await;
            let () = redis::cmd("CLUSTER").arg("FAILOVER").query_async(&mut r).await.expect("CLUSTER FAILOVER");
        }
        Fault::Kill => cluster.kill(primary),
    }
    for _ in 0..300 {
        if cluster.primaries().await.iter().any(|p| p.port == replica) {
            break;
        }
        // Waiting for the election: no clock is involved.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if let Fault::Kill = fault {
        cluster.restart(primary, NODE_TIMEOUT_MS).await;
    }
}

/// Writers claim and complete fresh records on every shard while a failover runs;
/// afterwards every record whose complete returned Ok is read back.
async fn writers_across(cluster: &mut PrivateCluster, ack: Option<ReplicaAck>, fault: Fault) -> FailoverRun {
    let config = Config::default().with_prefix(format!("fo-{}:", uuid::Uuid::new_v4().simple())).with_replica_ack(ack);
    let store = Arc::new(RedisStore::connect_cluster(cluster.urls(), config).await.expect("connect"));
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (store, stop, errors) = (store.clone(), stop.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let rec = match store.claim(req(&format!("w{w}-{i}"))).await {
                    Ok(ClaimOutcome::Claimed(rec)) => rec,
                    Ok(other) => panic!("fresh key: {other:?}"),
                    Err(e) => {
                        assert!(e.is_retryable(), "{e:?}");
                        errors.fetch_add(1, Ordering::Relaxed);
                        // A client's backoff while the shard has no primary.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                match store.complete(rec.id, rec.token, StoredResponse::new(201, vec![], b"{}".to_vec())).await {
                    Ok(_) => done.push((rec.id, Instant::now())),
                    Err(e) => {
                        assert!(e.is_retryable(), "{e:?}");
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            done
        }));
    }
    // Let the writers fill every shard, then break one.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fault_at = Instant::now();
    failover(cluster, fault).await;
    cluster.wait_healthy().await;
    let healed_after = fault_at.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut done = Vec::new();
    for t in tasks {
        done.extend(t.await.expect("writer"));
    }
    let mut run =
        FailoverRun { completed: done.len() as u64, errors: errors.load(Ordering::Relaxed), ..FailoverRun::default() };
    run.healed_ms = healed_after.as_millis();
    for (id, _) in &done {
        match store.get(*id).await.expect("get after the failover") {
            Some(r) if r.state == RecordState::Completed => {}
            _ => run.lost += 1,
        }
    }
    run
}

/// With `WAIT 1`, a manual failover (`CLUSTER FAILOVER` on a replica: the replica catches
/// up, then takes over) and a forced one (SIGKILL of a primary; its replica is promoted
/// after the node timeout) lose no record whose complete returned Ok; the old primary
/// restarts and rejoins as a replica. Calls during the change fail retryably, never with
/// a wrong answer. The same runs without WAIT are printed for RELIABILITY.md (a forced
/// failover may lose the last writes there; that is what WAIT is for).
#[tokio::test]
async fn failovers_lose_no_acknowledged_completion_with_wait() {
    let mut cluster = PrivateCluster::start(7030, NODE_TIMEOUT_MS).await;
    let ack = Some(ReplicaAck::new(1, Duration::from_millis(1_000)));
    for (fault, ack, name) in [
        (Fault::Manual, ack, "manual failover, WAIT 1"),
        (Fault::Kill, ack, "forced failover (SIGKILL), WAIT 1"),
        (Fault::Manual, None, "manual failover, no WAIT"),
        (Fault::Kill, None, "forced failover (SIGKILL), no WAIT"),
    ] {
        let run = writers_across(&mut cluster, ack, fault).await;
        // One row of RELIABILITY.md's Redis Cluster table.
        println!("| {name} | {} | {} | {} | {} |", run.completed, run.errors, run.lost, run.healed_ms);
        assert!(run.completed > 0, "{name}: {run:?}");
        if ack.is_some() {
            assert_eq!(run.lost, 0, "{name}: an acknowledged completion was lost: {run:?}");
        }
    }
}

/// Holds a node's event loop for 800 ms with a script that only reads `TIME` (below the
/// 5 s busy threshold, so other clients simply wait).
fn hold_node(mut c: redis::aio::MultiplexedConnection) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let script = "local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] \
                      repeat local n = redis.call('TIME') until n[1] * 1000000 + n[2] - s > tonumber(ARGV[1]) \
                      return 1";
        let _: i64 = redis::cmd("EVAL").arg(script).arg(0).arg(800_000).query_async(&mut c).await.expect("hold");
    })
}

/// Pins: the `redis` crate's cluster client, with its default retries, sends a claim again
/// after its connection dropped, and the claim that had already run then reads as another
/// request's claim (`Existing`, in flight). The store's own client (`retries(0)`) reports
/// what happened: a retryable error, the claim whole on its primary, never sent twice.
/// Ordered deterministically: a busy script holds the key's primary while the claim and
/// then `CLIENT KILL TYPE normal` queue up; the claim runs, and its connection is killed
/// before the reply is written.
///
/// Pins `docs/failures.md#cluster-slot-moves-or-fails-over`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_never_resent_after_its_connection_dropped() {
    let cluster = PrivateCluster::start(7040, NODE_TIMEOUT_MS).await;
    for driver_retries in [false, true] {
        let config = Config::default().with_prefix(format!("kill-{driver_retries}:"));
        let store = if driver_retries {
            let client = redis::cluster::ClusterClient::new(cluster.urls()).expect("client");
            let conn = client.get_async_connection().await.expect("connection");
            RedisStore::from_connection(conn, config).await.expect("store")
        } else {
            RedisStore::connect_cluster(cluster.urls(), config).await.expect("store")
        };
        let r = req("k");
        let port = cluster.primary_for(&store.record_key(r.id())).await;
        let (holder, mut killer) = (cluster.node(port).await, cluster.node(port).await);
        // Warm the store's connection to that node (the claim must not open it during the hold).
        assert_eq!(store.get(r.id()).await.expect("get"), None);
        let hold = hold_node(holder);
        // Lets already-sent bytes reach the node while it is held: orders events on the
        // wire, no clock is involved.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let claim = {
            let (store, r) = (store.clone(), r.clone());
            tokio::spawn(async move { store.claim(r).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let kill = tokio::spawn(async move {
            let n: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("normal")
                .arg("SKIPME")
                .arg("yes")
                .query_async(&mut killer)
                .await
                .expect("CLIENT KILL");
            n
        });
        hold.await.expect("hold task");
        assert!(kill.await.expect("kill task") >= 1, "the store's connection was killed");
        let outcome = claim.await.expect("claim task");
        let on_node = store.get(r.id()).await.expect("get").expect("the claim ran before the kill");
        assert_eq!(on_node.state, RecordState::InFlight);
        if driver_retries {
            // The failure this store avoids: the resent claim met the claim it had made.
            assert!(
                matches!(&outcome, Ok(ClaimOutcome::Existing { record, .. }) if record.token == on_node.token),
                "the driver resent the claim: {outcome:?}"
            );
        } else {
            let e = outcome.expect_err("the reply was lost with the connection");
            assert!(e.is_retryable(), "{e:?}");
        }
    }
}
