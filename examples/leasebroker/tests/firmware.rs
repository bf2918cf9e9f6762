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
use idem_http::LeaseRenewal;
use leasebroker::app::{Bmc, Config, Faults};
use leasebroker::server::{Server, StoreSpec, open};
use leasebroker::storm::{self, StormConfig, StormMode, StormReport};
use tokio::net::TcpListener;

/// The lease: short, as renewal allows.
const LEASE: Duration = Duration::from_secs(2);
/// A flash: three leases long, so without renewal every flash outlives its lease.
const FLASH_MS: u64 = 6_000;
const OPERATIONS: u32 = 6;

async fn storm_with(spec: &str, state: &Path, lease_renewal: LeaseRenewal) -> StormReport {
    let store_spec: StoreSpec = spec.parse().unwrap();
    let (store, infra) = open(&store_spec, state)
        .await
        .unwrap_or_else(|e| panic!("{spec}: {e} (scripts/services starts Redis and PostgreSQL)"));
    let config = Config {
        policy: Policy::default().with_lease_ttl(LEASE),
        lease_renewal,
        // Lost responses on top of the short attempt timeouts: answers held past the
        // client's timeout, so retries arrive after the work too.
        faults: Faults { drop_rate: 0.3, hold_ms: 800, ..Faults::default() },
        flash_ms: FLASH_MS,
        // The blind BMC: renewal is the only thing that keeps a second flash away, which
        // is what this test measures. The task BMC would adopt the running flash even
        // without renewal.
        bmc: Bmc::Blind,
    };
    let server = Server::start(TcpListener::bind("127.0.0.1:0").await.unwrap(), store, infra, &config).unwrap();
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
    assert_eq!(on.server.flashes, u64::from(OPERATIONS), "{backend}, renewal on: flashes == operations");
    assert_eq!(on.server.bricked, 0, "{backend}, renewal on: bricked nodes");
    assert_eq!(on.double_flashes(), 0, "{backend}, renewal on: double flashes");
    // The retries really met the running flashes (in-flight 409s), and every answer came
    // from a retry (the first attempt always times out), so it is a replay.
    assert!(on.busy_409 > 0, "{backend}, renewal on: no retry met a running flash: {on:?}");
    assert_eq!(on.replays, u64::from(OPERATIONS), "{backend}, renewal on: {on:?}");

    // Renewal off, everything else equal: retries reclaim running flashes and brick nodes.
    assert!(off.server.bricked > 0, "{backend}, renewal off: no node bricked: {off:?}");
    assert!(off.double_flashes() > 0, "{backend}, renewal off: no double flash: {off:?}");
    // Each bricked node took exactly one extra flash: a bricked BMC starts none.
    assert_eq!(off.server.flashes, u64::from(OPERATIONS) + off.server.bricked, "{backend}, renewal off: {off:?}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn firmware_storm_on_redis() {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    renewal_prevents_double_flashes("redis", |_, _| url.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn firmware_storm_on_postgres() {
    let url = std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    renewal_prevents_double_flashes("postgres", |_, _| url.clone()).await;
}
