//! The retry storm on a real Redis Cluster while its topology changes: busy slots migrated
//! between primaries (what `redis-cli --cluster reshard` does), a manual failover
//! (`CLUSTER FAILOVER` on a replica) and a forced one (SIGKILL of a primary). Every run:
//! 0 phantom workers, 0 extra VMs, every operation completes within its budget. The store
//! is opened through the `--store redis-cluster://...?wait=1` form. The cluster is private
//! (six nodes on 127.0.0.1:7020-7025, in a temporary directory), so the shared cluster on
//! 7000-7005 is never disturbed. The rows go into RELIABILITY.md ("Redis Cluster").

#[path = "../../../idem-redis/tests/common/cluster.rs"]
mod cluster;

use std::time::{Duration, Instant};

use cluster::PrivateCluster;
use idem_core::Policy;
use idem_redis::redis;
use leasebroker::app::{Config, Faults};
use leasebroker::server::{Server, StoreSpec, open};
use leasebroker::storm::{self, StormConfig, StormMode, StormReport};
use tokio::net::TcpListener;

const BASE: u16 = 7020;
const NODE_TIMEOUT_MS: u64 = 1_000;

#[derive(Clone, Copy, Debug)]
enum Fault {
    Migration,
    ManualFailover,
    ForcedFailover,
}

/// Slots of `port` that hold keys now (found by `SCAN` + `CLUSTER KEYSLOT`), at most 64.
async fn busy_slots(cluster: &PrivateCluster, port: u16) -> Vec<u16> {
    let mut c = cluster.node(port).await;
    let (_, keys): (u64, Vec<String>) =
        redis::cmd("SCAN").arg(0).arg("COUNT").arg(2_000).query_async(&mut c).await.expect("SCAN");
    let mut slots = std::collections::BTreeSet::new();
    for k in keys {
        let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(&k).query_async(&mut c).await.expect("KEYSLOT");
        slots.insert(slot);
        if slots.len() == 64 {
            break;
        }
    }
    slots.into_iter().collect()
}

async fn inject(cluster: &mut PrivateCluster, fault: Fault) -> String {
    let primaries = cluster.primaries().await;
    let (first, second) = (primaries[0].port, primaries[1].port);
    match fault {
        Fault::Migration => {
            let slots = busy_slots(cluster, first).await;
            assert!(!slots.is_empty(), "the storm wrote keys on {first}");
            cluster.migrate_slots(&slots, first, second).await;
            format!("{} busy slots {first} -> {second}", slots.len())
        }
        Fault::ManualFailover | Fault::ForcedFailover => {
            let replica = cluster.replica_of(first).await;
            if let Fault::ManualFailover = fault {
                let mut r = cluster.node(replica).await;
                let () = redis::cmd("CLUSTER").arg("FAILOVER").query_async(&mut r).await.expect("CLUSTER FAILOVER");
            } else {
                cluster.kill(first);
            }
            for _ in 0..300 {
                if cluster.primaries().await.iter().any(|p| p.port == replica) {
                    break;
                }
                // Waiting for the election: no clock is involved.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if let Fault::ForcedFailover = fault {
                cluster.restart(first, NODE_TIMEOUT_MS).await;
            }
            format!("primary {first} -> replica {replica}")
        }
    }
}

async fn storm_across(
    cluster: &mut PrivateCluster,
    fault: Fault,
    dir: &std::path::Path,
) -> (StormReport, String, u128) {
    let nodes: Vec<String> = cluster.urls().iter().map(|u| u.trim_start_matches("redis://").to_owned()).collect();
    let spec: StoreSpec = format!("redis-cluster://{}?wait=1", nodes.join(",")).parse().expect("cluster spec");
    let (store, infra) = open(&spec, &dir.join(format!("state-{fault:?}.redb"))).await.expect("open the cluster store");
    let faults = Faults { drop_rate: 0.25, hold_ms: 400, work_ms: 20, ..Faults::default() };
    let config =
        Config { policy: Policy::default().with_lease_ttl(Duration::from_secs(3)), faults, ..Config::default() };
    let server =
        Server::start(TcpListener::bind("127.0.0.1:0").await.expect("bind"), store, infra, &config).expect("start");
    let storm = tokio::spawn(storm::run(StormConfig {
        target: server.url(),
        mode: StormMode::Create,
        operations: 400,
        principals: 8,
        concurrency: 32,
        attempt_timeout_ms: 300,
        budget_ms: 60_000,
        token_prefix: format!("cluster-{fault:?}"),
    }));
    // Let the storm load every shard, then change the topology under it.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let at = Instant::now();
    let what = inject(cluster, fault).await;
    cluster.wait_healthy().await;
    let healed_ms = at.elapsed().as_millis();
    let report = storm.await.expect("storm task").expect("storm");
    server.stop().await.expect("stop");
    (report, what, healed_ms)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_survives_migration_and_failovers() {
    let mut cluster = PrivateCluster::start(BASE, NODE_TIMEOUT_MS).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut rows = Vec::new();
    for fault in [Fault::Migration, Fault::ManualFailover, Fault::ForcedFailover] {
        let (r, what, healed_ms) = storm_across(&mut cluster, fault, dir.path()).await;
        println!("{fault:?} ({what}):\n{}", r.table());
        let extra_vms = r.server.boots.saturating_sub(u64::from(r.operations));
        rows.push(format!(
            "| {fault:?} ({what}) | {} | {} | {} | {} | {} | {} | {} | {healed_ms} | {} |",
            r.operations,
            r.succeeded,
            r.failed,
            r.attempts,
            r.server_errors,
            r.phantoms(),
            extra_vms,
            r.elapsed_ms
        ));
        assert_eq!(r.failed, 0, "{fault:?}: every operation completes within its budget: {r:?}");
        assert_eq!(r.phantoms(), 0, "{fault:?}: phantom workers: {r:?}");
        assert_eq!(extra_vms, 0, "{fault:?}: extra VMs: {r:?}");
        assert_eq!(r.server.workers, u64::from(r.operations), "{fault:?}: {r:?}");
    }
    println!(
        "| fault | operations | succeeded | failed | attempts | 5xx | phantom workers | extra VMs | healed (ms) | elapsed (ms) |"
    );
    for row in rows {
        println!("{row}");
    }
}
