//! The retry storm against the demo's server, in one binary: lost responses on a redb file,
//! firmware flashes longer than their lease with lease renewal on and off, the task BMC
//! itself, and a Redis Cluster whose topology changes under the storm.

#[cfg(feature = "live-tests")]
#[path = "../../../idem-redis/tests/it/cluster_nodes.rs"]
mod cluster;

use std::time::Duration;

use idem_core::Policy;
use idem_harness::storm::{self, StormConfig, StormMode};
use leasebroker::app::{Config, Faults};
use leasebroker::server::{Server, StoreSpec, open};
use tokio::net::TcpListener;

async fn start(path: &std::path::Path, faults: Faults) -> Server {
    let (store, infra) = open(&StoreSpec::Redb(path.to_path_buf()), &path.with_extension("state")).await.unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut policy = Policy::default();
    policy.lease_ttl = Duration::from_secs(3);
    Server::start(listener, store, infra, &Config { policy, faults, ..Config::default() }).unwrap()
}

#[tokio::test]
async fn storm_with_lost_responses_makes_no_phantom_workers() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Faults { drop_rate: 0.3, hold_ms: 600, work_ms: 150, hypervisor_fail_rate: 0.05, ..Faults::default() };
    let server = start(&dir.path().join("lb.redb"), faults).await;
    let report = storm::run(StormConfig {
        target: server.url(),
        mode: StormMode::Create,
        operations: 60,
        principals: 3,
        concurrency: 16,
        attempt_timeout_ms: 300,
        budget_ms: 30_000,
        token_prefix: "e2e".into(),
    })
    .await
    .unwrap();
    println!("{}", report.table());
    assert_eq!(report.failed, 0);
    assert_eq!(report.succeeded, 60);
    assert_eq!(report.phantoms(), 0);
    assert_eq!(report.extra_vms(), 0, "VMs booted beyond one per operation");
    assert_eq!(report.server.infra.workers, 60);
    // A failed boot keeps its node and lease journalled; the retry reuses them and only
    // boots, so nothing is allocated twice.
    assert_eq!(
        (report.server.infra.allocations, report.server.infra.leases, report.server.infra.boots),
        (60, 60, 60),
        "{report:?}"
    );
    assert_eq!(report.distinct_ids, 60);
    // The faults really fired: some answers were lost and replayed.
    assert!(report.transport_errors > 0 && report.replays > 0, "{report:?}");
    server.stop().await.unwrap();
}

mod firmware_renewal {
    //! A firmware flash three times longer than its lease, stormed with retries over real
    //! sockets: without lease renewal a retry reclaims the record while the flash runs, starts
    //! a second flash of the same node and bricks it. With renewal (the default) every flash
    //! runs once, on redb, SQLite, Redis and PostgreSQL.
    //!
    //! Each backend runs the same storm twice, side by side on two servers: renewal on (no
    //! double flash, nothing bricked) and renewal off (double flashes, bricked nodes), so the
    //! test proves that renewal is what prevents them.

    use std::path::Path;
    use std::time::Duration;

    use idem_core::Policy;
    use idem_harness::firmware::{self, Bmc};
    use idem_harness::storm::{self, StormConfig, StormMode, StormReport};
    use idem_http::LeaseRenewal;
    use leasebroker::app::{Config, Faults};
    use leasebroker::server::StoreSpec;
    use tokio::net::TcpListener;

    /// The lease: short, as renewal allows.
    const LEASE: Duration = Duration::from_secs(2);
    /// A flash: three leases long, so without renewal every flash outlives its lease.
    const FLASH_MS: u64 = 6_000;
    const OPERATIONS: u32 = 6;

    async fn storm_with(spec: &str, state: &Path, lease_renewal: LeaseRenewal) -> StormReport {
        let store_spec: StoreSpec = spec.parse().unwrap();
        let config = Config {
            policy: {
                let mut policy = Policy::default();
                policy.lease_ttl = LEASE;
                policy
            },
            lease_renewal,
            // Lost responses on top of the short attempt timeouts: answers held past the
            // client's timeout, so retries arrive after the work too.
            faults: Faults { drop_rate: 0.3, hold_ms: 800, ..Faults::default() },
            ..Config::default()
        };
        // The blind BMC: renewal is the only thing that keeps a second flash away, which is
        // what this test measures. The task BMC would adopt the running flash even without
        // renewal.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = firmware::start(listener, &store_spec, state, config, FLASH_MS, Bmc::Blind)
            .await
            .unwrap_or_else(|e| panic!("{spec}: {e} (scripts/services starts Redis and PostgreSQL)"));
        let report = storm::run(StormConfig {
            target: server.url(),
            mode: StormMode::Firmware,
            operations: OPERATIONS,
            principals: 2,
            concurrency: OPERATIONS as usize,
            // Every first attempt times out long before its flash ends; the retries poll it.
            attempt_timeout_ms: 500,
            budget_ms: 25_000,
            // Fresh principals per run: the shared servers keep records for 24 h.
            token_prefix: format!("fw-{}", uuid::Uuid::new_v4().simple()),
        })
        .await
        .unwrap();
        println!("{spec}, renewal {lease_renewal:?}:\n{}", report.table());
        // Flashes still running in detached handlers (renewal off) are not waited for.
        server.stop().await.unwrap();
        report
    }

    async fn renewal_prevents_double_flashes(backend: &str, spec: impl Fn(&Path, &str) -> String) {
        let dir = tempfile::tempdir().unwrap();
        let (spec_on, spec_off) = (spec(dir.path(), "on"), spec(dir.path(), "off"));
        let (state_on, state_off) = (dir.path().join("state-on.redb"), dir.path().join("state-off.redb"));
        let (on, off) = tokio::join!(
            storm_with(&spec_on, &state_on, LeaseRenewal::default()),
            storm_with(&spec_off, &state_off, LeaseRenewal::Off),
        );

        // Renewal on: one flash per operation, every operation answered 200.
        assert_eq!((on.succeeded, on.failed), (OPERATIONS, 0), "{backend}, renewal on: {on:?}");
        assert_eq!(on.server.bmc.flashes, u64::from(OPERATIONS), "{backend}, renewal on: flashes == operations");
        assert_eq!(on.server.bmc.bricked, 0, "{backend}, renewal on: bricked nodes");
        assert_eq!(on.double_flashes(), 0, "{backend}, renewal on: double flashes");
        // The retries really met the running flashes (in-flight 409s), and every answer came
        // from a retry (the first attempt always times out), so it is a replay.
        assert!(on.busy_409 > 0, "{backend}, renewal on: no retry met a running flash: {on:?}");
        assert_eq!(on.replays, u64::from(OPERATIONS), "{backend}, renewal on: {on:?}");

        // Renewal off, everything else equal: retries reclaim running flashes and brick nodes.
        assert!(off.server.bmc.bricked > 0, "{backend}, renewal off: no node bricked: {off:?}");
        assert!(off.double_flashes() > 0, "{backend}, renewal off: no double flash: {off:?}");
        // Each bricked node took exactly one extra flash: a bricked BMC starts none.
        assert_eq!(
            off.server.bmc.flashes,
            u64::from(OPERATIONS) + off.server.bmc.bricked,
            "{backend}, renewal off: {off:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn firmware_storm_on_redb() {
        renewal_prevents_double_flashes("redb", |dir, run| {
            format!("redb:{}", dir.join(format!("lb-{run}.redb")).display())
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn firmware_storm_on_sqlite() {
        renewal_prevents_double_flashes("sqlite", |dir, run| {
            format!("sqlite:{}", dir.join(format!("lb-{run}.sqlite")).display())
        })
        .await;
    }

    #[cfg(feature = "live-tests")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn firmware_storm_on_redis() {
        let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        renewal_prevents_double_flashes("redis", |_, _| url.clone()).await;
    }

    #[cfg(feature = "live-tests")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn firmware_storm_on_postgres() {
        let url =
            std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        renewal_prevents_double_flashes("postgres", |_, _| url.clone()).await;
    }
}

mod bmc {
    //! The task BMC (`bmc::Bmcs::start_flash_task` and its task monitor) on a real redb
    //! file: what the firmware route's reconcile relies on. A flash started by a caller that
    //! then dies is found by its id from a new process (the database reopened), keeps running
    //! on its own until its end time, and is then done; a second flash of a node while one
    //! runs bricks it, as on the blind BMC. The whole route under a SIGKILL of the server is
    //! the chaos short pass's app-kill row (`tests/chaos.rs`).

    use std::path::Path;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use idem_harness::bmc::{BmcError, Bmcs, FirmwareSpec, FlashProgress};

    fn open(path: &Path) -> Bmcs {
        Bmcs::new(Arc::new(redb::Database::create(path).unwrap())).unwrap()
    }

    fn firmware() -> FirmwareSpec {
        FirmwareSpec { image: "bmc-firmware".into(), version: "2.4.1".into() }
    }

    /// Polls the task monitor until the task is done; the bound only turns a hang into a
    /// failure.
    fn wait_done(infra: &Bmcs, id: &str) -> Result<FlashProgress, BmcError> {
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            match infra.finish_flash_task(id)? {
                FlashProgress::Running { .. } => {
                    assert!(Instant::now() < give_up, "task {id} never ended");
                    std::thread::sleep(Duration::from_millis(20));
                }
                done @ FlashProgress::Done(_) => return Ok(done),
            }
        }
    }

    /// A flash whose caller died had no trace a retry could find (the blind BMC), so the retry
    /// flashed again: the task BMC must answer for it, from a reopened database, by its id.
    #[test]
    fn a_flash_outlives_its_caller_and_is_found_by_its_id_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let started = {
            let infra = open(&path);
            assert_eq!(infra.flash_task("idem-a").unwrap(), None, "no task before the start");
            let task = infra.start_flash_task("node-00001", "idem-a", firmware(), 300).unwrap();
            assert_eq!(task.ends_at_ms - task.started_at_ms, 300);
            task
            // The caller and its database handle are gone here, as after a SIGKILL.
        };
        let infra = open(&path);
        assert_eq!(infra.flash_task("idem-a").unwrap(), Some(started.clone()), "the task monitor knows the flash");
        assert_eq!(infra.flash_task("idem-b").unwrap(), None, "another id is another operation");
        let FlashProgress::Done(flash) = wait_done(&infra, "idem-a").unwrap() else { unreachable!() };
        assert_eq!((flash.node.as_str(), flash.number, flash.firmware), ("node-00001", started.number, firmware()));
        // Asking again is a read: still done, nothing flashed again.
        assert!(matches!(infra.finish_flash_task("idem-a").unwrap(), FlashProgress::Done(_)));
        let stats = infra.stats().unwrap();
        assert_eq!((stats.flashes, stats.bricked), (1, 0));
    }

    /// The task BMC is no more forgiving than the blind one: what protects a node is asking
    /// before flashing, not the BMC. A second flash started while one runs bricks the node.
    #[test]
    fn a_second_flash_of_a_running_node_bricks_it() {
        let dir = tempfile::tempdir().unwrap();
        let infra = open(&dir.path().join("state.redb"));
        infra.start_flash_task("node-00002", "idem-first", firmware(), 5_000).unwrap();
        infra.start_flash_task("node-00002", "idem-second", firmware(), 100).unwrap();
        let stats = infra.stats().unwrap();
        assert_eq!((stats.flashes, stats.bricked), (2, 1));
        assert!(matches!(wait_done(&infra, "idem-second"), Err(BmcError::Bricked { .. })));
        assert!(matches!(
            infra.start_flash_task("node-00002", "idem-third", firmware(), 100),
            Err(BmcError::Bricked { .. })
        ));
        // A flash of another node after the first one ended is fine.
        infra.start_flash_task("node-00003", "idem-other", firmware(), 50).unwrap();
        assert!(matches!(wait_done(&infra, "idem-other").unwrap(), FlashProgress::Done(_)));
    }
}

#[cfg(feature = "live-tests")]
mod redis_cluster {
    //! The retry storm on a real Redis Cluster while its topology changes: busy slots migrated
    //! between primaries (what `redis-cli --cluster reshard` does), a manual failover
    //! (`CLUSTER FAILOVER` on a replica) and a forced one (SIGKILL of a primary). Every run:
    //! 0 phantom workers, 0 extra VMs, every operation completes within its budget. The store
    //! is opened through the `--store redis-cluster://...?wait=1` form. The cluster is private
    //! (six nodes on 127.0.0.1:7020-7025, in a temporary directory), so the shared cluster on
    //! 7000-7005 is never disturbed. The rows go into RELIABILITY.md ("Redis Cluster").

    use std::time::{Duration, Instant};

    use idem_core::Policy;
    use idem_harness::storm::{self, StormConfig, StormMode, StormReport};
    use idem_redis::redis;
    use leasebroker::app::{Config, Faults};
    use leasebroker::server::{Server, StoreSpec, open};
    use tokio::net::TcpListener;

    use super::cluster::PrivateCluster;

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
        let (store, infra) =
            open(&spec, &dir.join(format!("state-{fault:?}.redb"))).await.expect("open the cluster store");
        let faults = Faults { drop_rate: 0.25, hold_ms: 400, work_ms: 20, ..Faults::default() };
        let config = Config {
            policy: {
                let mut p = Policy::default();
                p.lease_ttl = Duration::from_secs(3);
                p
            },
            faults,
            ..Config::default()
        };
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
            let extra_vms = r.server.infra.boots.saturating_sub(u64::from(r.operations));
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
            assert_eq!(r.server.infra.workers, u64::from(r.operations), "{fault:?}: {r:?}");
        }
        println!(
            "| fault | operations | succeeded | failed | attempts | 5xx | phantom workers | extra VMs | healed (ms) | elapsed (ms) |"
        );
        for row in rows {
            println!("{row}");
        }
    }
}
