//! The short chaos pass: a fault of each kind (a Redis restart with AOF always, a SIGSTOP
//! stall of Redis, a PostgreSQL immediate restart and `pg_terminate_backend`, a SIGKILL and
//! restart of a private MariaDB server (InnoDB crash recovery), a SIGKILL of the server on
//! redb, a full disk under SQLite and under redb, a SIGSTOP stall of the
//! DynamoDB emulator, a private single-threaded `moto_server`) hit a retry storm of a few hundred
//! operations, a quarter of them also flashing firmware; a double execution (phantom worker,
//! extra VM, double flash, on every row, the server SIGKILL included), a lost stored
//! response, an unfinished operation or a hung request fails the test. Every server is private (loopback
//! ports 7110-7113, temp dirs) and cleaned up by the run. The full run is
//! `cargo run --release -p idem-harness -- chaos` (RELIABILITY.md, "Chaos run").

use std::path::PathBuf;
use std::time::Duration;

use idem_harness::chaos::{self, ChaosConfig, Fault};
use idem_harness::firmware::Bmc;

/// The run's first private port: `default`, or `LEASEBROKER_CHAOS_PORT` when set (so two
/// checkouts on one machine do not collide).
fn base_port(default: u16) -> u16 {
    std::env::var("LEASEBROKER_CHAOS_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_chaos_pass_has_no_double_execution_and_no_lost_response() {
    let cfg = ChaosConfig {
        exe: PathBuf::from(env!("CARGO_BIN_EXE_idem-harness")),
        faults: Fault::one_of_each_kind(),
        operations: 80,
        concurrency: 16,
        fault_after: Duration::from_millis(1_000),
        // Longer than the layer's 2 s store deadline by half a second: a stall exactly as
        // long as the deadline answered a 503 only to a probe sent in its first
        // milliseconds, so whether the stall showed at all was a coin toss.
        fault_for: Duration::from_millis(2_500),
        // Renewal keeps a running handler's claim across a store outage only while the
        // outage is shorter than the lease minus one renewal interval (lease / 3): 5 s
        // covers the 2.5 s faults (with 3 s, the last renewal before a 2 s full disk could
        // lapse right as the disk was freed, and a retry reclaimed running flashes).
        lease: Duration::from_secs(5),
        base_port: base_port(7110),
        // A quarter of the operations also flash firmware; a flash (6 s) outlives the lease
        // (5 s), so the faults hit running flashes that only renewal keeps claimed.
        firmware_every: 4,
        flash: Duration::from_secs(6),
        lease_renewal: true,
        // The BMC with a task monitor: a flash killed with its server is adopted by the
        // retry, so every row, the app kill included, must be free of double flashes.
        bmc: Bmc::Tasks,
    };
    let rows = chaos::run(&cfg).await.expect("chaos run");
    let report = chaos::report(&rows, &cfg);
    println!("{report}");
    assert_eq!(rows.len(), cfg.faults.len());
    for r in &rows {
        assert!(!r.failed(), "{} / {}: {r:?}\n{report}", r.backend, r.fault);
    }
    // The firmware operations ran: each fault's storm flashed.
    assert!(rows.iter().all(|r| r.firmware_operations == u64::from(cfg.operations / cfg.firmware_every)), "{report}");
    // Every fault was applied: each stalled store (Redis, the DynamoDB emulator) made the
    // server answer 503 while it was away.
    for stalled in rows.iter().filter(|r| r.fault.starts_with("stall")) {
        assert!(stalled.unavailable_503 > 0, "the {} stall answered no 503: {stalled:?}", stalled.backend);
    }
}
