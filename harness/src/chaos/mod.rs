//! The chaos run: the retry storm against the rig's `serve` on a real store while a fault
//! hits the store or the server, one row per fault, one table per backend.
//!
//! For each fault the run starts its own store server (a private `redis-server`, a private
//! PostgreSQL cluster made with `initdb`, a private MariaDB server made with
//! `mariadb-install-db`, a private `moto_server` for DynamoDB, a SQLite or
//! redb file on a small tmpfs) and its
//! own `idem-harness serve` child, on the loopback ports it is given, in temp dirs; it
//! drives the storm (every operation one key, kept across retries; a quarter of the
//! responses held past the client's attempt timeout, so they are lost after the work was
//! done), hits the fault while the storm runs, lifts it, and then:
//! - every [`ChaosConfig::firmware_every`]-th operation is a firmware operation: it
//!   creates its worker, then flashes the worker's node under a key of its own
//!   (`POST /v1/workers/{id}/firmware`). A flash lasts longer than the lease, so only
//!   lease renewal keeps a retry from reclaiming it and starting a second flash; the
//!   faults hit while flashes run;
//! - sends every operation once more with its key (after the storm, with a long budget):
//!   an operation that had its 201 must get it replayed, same worker; one that did not
//!   must replay or finish now. A 201 whose replay names another worker, or is not a
//!   replay, is a **lost stored response**;
//! - reads the server's counts: workers beyond one per operation are **phantom workers**,
//!   VMs booted beyond one per operation **extra VMs**, firmware flashes beyond one per
//!   firmware operation **double flashes**;
//! - from a probe that sends a fresh keyed request every 100 ms during the fault: the 503s
//!   and the slowest answer while the fault lasted (a stall must be answered within the
//!   layer's store deadline, never hang), and the **time to recover** from lifting the fault
//!   to the probe's first answer from the handler. The probe reboots workers that do not
//!   exist (a stored 404), so it never creates anything the counts would see.
//!
//! Everything is cleaned up by the run itself (child processes killed by id, temp dirs
//! removed, the tmpfs unmounted), also when it fails half-way.

pub mod servers;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_client::{IdempotentClient, OperationKey, RetryPolicy};
use tokio::sync::Semaphore;

use self::servers::{
    AppServer, PrivateCluster, PrivateMariaDB, PrivateMoto, PrivatePostgres, PrivateRedis, RedisPersistence,
    ServerError, SmallDisk, signal,
};
use crate::firmware::Bmc;
use crate::storm::{Counts, counts};

/// A backend the run covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    /// A private `redis-server`.
    Redis,
    /// A private six-node Redis Cluster.
    RedisCluster,
    /// A private PostgreSQL cluster.
    Postgres,
    /// A private MariaDB server (the `idem-mysql` store).
    MySql,
    /// A SQLite file.
    Sqlite,
    /// A redb file.
    Redb,
    /// A private `moto_server` (the DynamoDB emulator).
    Dynamo,
}

impl Backend {
    /// The table title.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis-cluster",
            Backend::Postgres => "postgres",
            Backend::MySql => "mysql",
            Backend::Sqlite => "sqlite",
            Backend::Redb => "redb",
            Backend::Dynamo => "dynamodb",
        }
    }
}

/// One fault the run injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL of the Redis server, restarted at once on the same dir.
    RedisRestart(RedisPersistence),
    /// Immediate shutdown of the PostgreSQL cluster (SIGQUIT), started again.
    PostgresImmediateRestart,
    /// `pg_terminate_backend` of every connection of the store's pool.
    PostgresTerminateBackends,
    /// SIGKILL of the MariaDB server, started again on the same data dir (InnoDB crash
    /// recovery).
    MySqlRestart,
    /// SIGSTOP of the store's server processes for the stall time, then SIGCONT.
    Stall(Backend),
    /// SIGKILL of the server under test, restarted on the same store.
    AppKill(Backend),
    /// The store file's disk fills up for the stall time (a tmpfs), then frees.
    FullDisk(Backend),
    /// SIGKILL of a Redis Cluster primary, not replaced: its replica is promoted and has
    /// no replica of its own, under this replica acknowledgement.
    ClusterPrimaryKill(ClusterAck),
}

/// The replica acknowledgement of a [`Fault::ClusterPrimaryKill`] run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterAck {
    /// `WAIT 1`, a shard without a replica refused (`Shortfall::Strict`).
    Strict,
    /// `WAIT 1`, a shard without a replica written with none (`Shortfall::Degrade`).
    Degrade,
    /// No `WAIT`.
    NoWait,
}

impl ClusterAck {
    /// The store URL's options.
    fn query(self) -> &'static str {
        match self {
            ClusterAck::Strict => "?wait=1",
            ClusterAck::Degrade => "?wait=1&shortfall=degrade",
            ClusterAck::NoWait => "",
        }
    }
}

impl Fault {
    /// The backend the fault runs on.
    #[must_use]
    pub fn backend(self) -> Backend {
        match self {
            Fault::RedisRestart(_) => Backend::Redis,
            Fault::PostgresImmediateRestart | Fault::PostgresTerminateBackends => Backend::Postgres,
            Fault::MySqlRestart => Backend::MySql,
            Fault::Stall(b) | Fault::AppKill(b) | Fault::FullDisk(b) => b,
            Fault::ClusterPrimaryKill(_) => Backend::RedisCluster,
        }
    }

    /// The row title.
    #[must_use]
    pub fn label(self) -> String {
        match self {
            Fault::RedisRestart(p) => format!("restart, {}", p.label()),
            Fault::PostgresImmediateRestart => "immediate restart".into(),
            Fault::PostgresTerminateBackends => "pg_terminate_backend".into(),
            Fault::MySqlRestart => "restart (SIGKILL, crash recovery)".into(),
            Fault::Stall(_) => "stall (SIGSTOP)".into(),
            Fault::AppKill(_) => "app server SIGKILL".into(),
            Fault::FullDisk(_) => "full disk (tmpfs)".into(),
            Fault::ClusterPrimaryKill(ack) => format!(
                "primary killed, not replaced, {}",
                match ack {
                    ClusterAck::Strict => "wait=1 strict",
                    ClusterAck::Degrade => "wait=1 degrade",
                    ClusterAck::NoWait => "no wait",
                }
            ),
        }
    }

    /// Whether the configuration is durable, so the run requires zero phantoms, extra VMs
    /// and lost responses. Redis without persistence loses every record on restart: its
    /// loss is measured, not required to be zero.
    #[must_use]
    pub fn durable(self) -> bool {
        !matches!(self, Fault::RedisRestart(RedisPersistence::None))
    }

    /// Whether the fault kills the process running the handlers. Under the blind BMC
    /// ([`Bmc::Blind`]) a flash is one journalled step with nothing to reconcile by: a
    /// flash running when its process dies has no outcome in the journal, so the retry
    /// that reclaims the record after the lease starts a second one (renewal died with the
    /// process). The task BMC ([`Bmc::Tasks`]) lets the retry find the flash and adopt it.
    #[must_use]
    pub fn kills_handler(self) -> bool {
        matches!(self, Fault::AppKill(_))
    }

    /// Every fault of the full run, in table order.
    #[must_use]
    pub fn all() -> Vec<Fault> {
        vec![
            Fault::RedisRestart(RedisPersistence::AofAlways),
            Fault::RedisRestart(RedisPersistence::AofEverysec),
            Fault::RedisRestart(RedisPersistence::None),
            Fault::Stall(Backend::Redis),
            Fault::AppKill(Backend::Redis),
            Fault::PostgresImmediateRestart,
            Fault::PostgresTerminateBackends,
            Fault::Stall(Backend::Postgres),
            Fault::AppKill(Backend::Postgres),
            Fault::MySqlRestart,
            Fault::Stall(Backend::MySql),
            Fault::AppKill(Backend::MySql),
            Fault::FullDisk(Backend::Sqlite),
            Fault::AppKill(Backend::Sqlite),
            Fault::FullDisk(Backend::Redb),
            Fault::AppKill(Backend::Redb),
            Fault::Stall(Backend::Dynamo),
            Fault::ClusterPrimaryKill(ClusterAck::Strict),
            Fault::ClusterPrimaryKill(ClusterAck::Degrade),
            Fault::ClusterPrimaryKill(ClusterAck::NoWait),
        ]
    }

    /// Whether operations may end unfinished by design: strict acknowledgement refuses the
    /// keys of a shard without a replica for as long as it has none (503s, never a hang).
    #[must_use]
    pub fn refuses_by_design(self) -> bool {
        matches!(self, Fault::ClusterPrimaryKill(ClusterAck::Strict))
    }

    /// One fault of each kind (the short pass `cargo test` runs).
    #[must_use]
    pub fn one_of_each_kind() -> Vec<Fault> {
        vec![
            Fault::RedisRestart(RedisPersistence::AofAlways),
            Fault::Stall(Backend::Redis),
            Fault::PostgresImmediateRestart,
            Fault::PostgresTerminateBackends,
            Fault::MySqlRestart,
            Fault::AppKill(Backend::Redb),
            Fault::FullDisk(Backend::Sqlite),
            // redb latches a failed commit until its file is reopened: the row fails unless
            // the store reopens by itself.
            Fault::FullDisk(Backend::Redb),
            Fault::Stall(Backend::Dynamo),
        ]
    }
}

/// Settings of a chaos run.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// The `idem-harness` binary, whose `serve` is the server under test.
    pub exe: PathBuf,
    /// The faults, in order.
    pub faults: Vec<Fault>,
    /// Logical operations per fault.
    pub operations: u32,
    /// Operations in flight at once.
    pub concurrency: usize,
    /// When the fault hits, after the storm started.
    pub fault_after: Duration,
    /// How long a stall or a full disk lasts; how long a restarted server stays down.
    pub fault_for: Duration,
    /// The server's lease TTL.
    pub lease: Duration,
    /// First of the private loopback ports the run may use (it uses this one to +3, and a
    /// Redis Cluster +4 to +9 with their bus ports 10000 above).
    pub base_port: u16,
    /// Every this many operations one is a firmware operation (creates its worker, then
    /// flashes it); 0 for none.
    pub firmware_every: u32,
    /// How long the server's simulated BMC takes to flash, longer than [`Self::lease`]
    /// so that a flash outlives its lease and needs renewal.
    pub flash: Duration,
    /// The server's lease renewal (`false` only to show the double flashes it prevents).
    pub lease_renewal: bool,
    /// The server's BMC ([`Bmc::Tasks`] by default; [`Bmc::Blind`] only to show what a
    /// BMC that cannot be asked about its flashes loses when the server is killed).
    pub bmc: Bmc,
}

impl ChaosConfig {
    /// The full run: every fault, 2,000 operations each, 32 at a time, 10 s stalls.
    #[must_use]
    pub fn full(exe: PathBuf) -> Self {
        Self {
            exe,
            faults: Fault::all(),
            operations: 2_000,
            concurrency: 32,
            fault_after: Duration::from_secs(3),
            fault_for: Duration::from_secs(10),
            lease: Duration::from_secs(3),
            base_port: 7100,
            firmware_every: 10,
            flash: Duration::from_secs(4),
            lease_renewal: true,
            bmc: Bmc::Tasks,
        }
    }
}

/// What one fault's run measured.
#[derive(Clone, Debug, Default)]
pub struct FaultRow {
    /// The fault's row title.
    pub fault: String,
    /// The backend.
    pub backend: &'static str,
    /// Whether zero loss is required.
    pub durable: bool,
    /// Logical operations.
    pub operations: u32,
    /// HTTP attempts of the storm (the check pass not counted).
    pub attempts: u64,
    /// Workers beyond one per operation.
    pub phantom_workers: u64,
    /// VMs booted beyond one per operation.
    pub extra_vms: u64,
    /// Of [`Self::operations`], those that also flashed firmware.
    pub firmware_operations: u64,
    /// Flashes the BMCs started beyond one per firmware operation.
    pub double_flashes: u64,
    /// Nodes a double flash bricked (their operations end in a stored 409, counted here
    /// and in [`Self::double_flashes`], not as unfinished).
    pub bricked: u64,
    /// 201s whose replay was another worker, or not a replay.
    pub lost_responses: u64,
    /// Operations that did not end with a 201 even in the check pass.
    pub unfinished: u64,
    /// Operations whose storm ended with a 201 (the check pass not counted).
    pub completed: u64,
    /// Attempts of the storm that ended in a connection error or the client's timeout
    /// (the held quarter of responses included).
    pub client_timeouts: u64,
    /// Unfinished operations are the fault's design, not a failure
    /// ([`Fault::refuses_by_design`]).
    pub refuses_by_design: bool,
    /// 503 answers the storm and the probe got while the fault lasted.
    pub unavailable_503: u64,
    /// The slowest answer to the probe while the fault lasted, ms (the probe is exempt
    /// from the drop fault's holds, so this is the server's own time).
    pub slowest_answer_ms: u64,
    /// Probe requests that got no answer within 10 s while the fault lasted (a hang).
    pub hung: u64,
    /// From lifting the fault to the probe's first answer from the handler, ms.
    pub recovery_ms: u64,
    /// The server refused the store's configuration at start-up: nothing was measured.
    pub refused: bool,
    /// What the fault did (connections terminated, bytes of filler, a restart it needed),
    /// or why it measured nothing.
    pub note: String,
}

impl FaultRow {
    /// Whether the row breaks the run's promise: any phantom, extra VM, double flash, lost
    /// response or unfinished operation on a durable configuration, a request that hung
    /// on any, or a server that did not recover on its own (`recovery_ms` is `u64::MAX`).
    /// A configuration that is not durable loses records on a restart by design (the
    /// store warns at start-up); its losses, unfinished operations included, are measured
    /// and shown, not failed.
    #[must_use]
    pub fn failed(&self) -> bool {
        self.durable
            && (self.phantom_workers > 0
                || self.extra_vms > 0
                || self.double_flashes > 0
                || self.lost_responses > 0
                || self.unfinished > 0 && !self.refuses_by_design)
            || self.hung > 0
            || self.recovery_ms == u64::MAX
    }
}

/// Renders the rows as one Markdown table per backend.
#[must_use]
pub fn tables(rows: &[FaultRow]) -> String {
    let mut out = String::new();
    // Each backend once, in the order of its first row: the short pass runs redb, then
    // SQLite, then redb again, and a `dedup` of neighbours printed redb's table twice.
    let mut backends: Vec<&str> = Vec::new();
    for r in rows {
        if !backends.contains(&r.backend) {
            backends.push(r.backend);
        }
    }
    for b in backends {
        out.push_str(&format!("\n#### {b}\n\n"));
        if b == Backend::RedisCluster.name() {
            out.push_str(
                "| fault | operations | completed | failed | 503s | client timeouts | phantom workers | extra VMs \
                 | attempts | unfinished after the check | slowest answer during fault | hung requests |\n",
            );
            out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
            for r in rows.iter().filter(|r| r.backend == b) {
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} ms | {} |\n",
                    r.fault,
                    r.operations,
                    r.completed,
                    u64::from(r.operations).saturating_sub(r.completed),
                    r.unavailable_503,
                    r.client_timeouts,
                    r.phantom_workers,
                    r.extra_vms,
                    r.attempts,
                    r.unfinished,
                    r.slowest_answer_ms,
                    r.hung
                ));
            }
            continue;
        }
        out.push_str(
            "| fault | operations | attempts | phantom workers | extra VMs | double flashes | lost stored responses \
             | unfinished operations | 503s during fault | slowest answer during fault | hung requests | time to recover |\n",
        );
        out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for r in rows.iter().filter(|r| r.backend == b) {
            let durable = if r.durable { "" } else { " (not durable)" };
            if r.refused {
                out.push_str(&format!("| {}{durable} | refused at start-up (see below) ||||||||||\n", r.fault));
                continue;
            }
            out.push_str(&format!(
                "| {}{durable} | {} | {} | {} | {} | {} | {} | {} | {} | {} ms | {} | {} ms |\n",
                r.fault,
                r.operations,
                r.attempts,
                r.phantom_workers,
                r.extra_vms,
                r.double_flashes,
                r.lost_responses,
                r.unfinished,
                r.unavailable_503,
                r.slowest_answer_ms,
                r.hung,
                r.recovery_ms
            ));
        }
    }
    out
}

/// Why the run could not go on.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// A private server or the server under test.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// The server's counters could not be read.
    #[error("cannot read the server's stats: {0}")]
    Stats(String),
}

/// The store side of one fault's run: what must live as long as the run.
enum StoreSide {
    Redis(PrivateRedis),
    Cluster(PrivateCluster),
    Postgres(PrivatePostgres),
    MySql(PrivateMariaDB),
    Dynamo(PrivateMoto),
    File { _dir: tempfile::TempDir, disk: Option<SmallDisk> },
}

/// Runs every fault of `cfg` in turn and returns one row per fault.
///
/// # Errors
/// [`ChaosError`] when a server cannot be started or read.
pub async fn run(cfg: &ChaosConfig) -> Result<Vec<FaultRow>, ChaosError> {
    let mut rows = Vec::new();
    for &fault in &cfg.faults {
        eprintln!("chaos: {} / {} ...", fault.backend().name(), fault.label());
        let row = run_fault(cfg, fault).await?;
        eprintln!(
            "chaos: {} / {}: phantoms {} extra VMs {} double flashes {} (bricked {}) lost {} unfinished {} 503s {} \
             slowest {} ms recovered in {} ms",
            row.backend,
            row.fault,
            row.phantom_workers,
            row.extra_vms,
            row.double_flashes,
            row.bricked,
            row.lost_responses,
            row.unfinished,
            row.unavailable_503,
            row.slowest_answer_ms,
            row.recovery_ms
        );
        rows.push(row);
    }
    Ok(rows)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ServerError> + Send + 'static,
) -> Result<T, ServerError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ServerError::Failed { what: "task".into(), message: e.to_string() })?
}

async fn run_fault(cfg: &ChaosConfig, fault: Fault) -> Result<FaultRow, ChaosError> {
    let backend = fault.backend();
    let work = tempfile::tempdir().map_err(|e| ChaosError::Stats(e.to_string()))?;
    let store_port = cfg.base_port + 1;
    let app_port = cfg.base_port + 2;
    let (mut side, spec) = match backend {
        Backend::Redis => {
            let persistence = match fault {
                Fault::RedisRestart(p) => p,
                _ => RedisPersistence::AofAlways,
            };
            let redis = blocking(move || PrivateRedis::start(store_port, persistence)).await?;
            let url = redis.url();
            (StoreSide::Redis(redis), url)
        }
        Backend::RedisCluster => {
            let Fault::ClusterPrimaryKill(ack) = fault else { unreachable!("the only cluster fault") };
            let base = cfg.base_port + 4;
            let cluster = blocking(move || PrivateCluster::start(base)).await?;
            let url = format!("{}{}", cluster.url(), ack.query());
            (StoreSide::Cluster(cluster), url)
        }
        Backend::Postgres => {
            let pg = blocking(move || PrivatePostgres::start(store_port)).await?;
            let url = pg.url();
            (StoreSide::Postgres(pg), url)
        }
        Backend::MySql => {
            let db = blocking(move || PrivateMariaDB::start(store_port)).await?;
            let url = db.url();
            (StoreSide::MySql(db), url)
        }
        Backend::Dynamo => {
            let moto = blocking(move || PrivateMoto::start(store_port)).await?;
            // The region in the spec; the credentials (the emulator takes any) in the
            // server's environment, where the AWS SDK looks for them.
            let spec = format!("dynamodb://chaos?endpoint={}&region=us-east-1", moto.url());
            (StoreSide::Dynamo(moto), spec)
        }
        Backend::Sqlite | Backend::Redb => {
            let dir = tempfile::tempdir().map_err(|e| ChaosError::Stats(e.to_string()))?;
            let disk = match fault {
                Fault::FullDisk(_) => Some(blocking(|| SmallDisk::mount(64)).await?),
                _ => None,
            };
            let base = disk.as_ref().map_or(dir.path(), SmallDisk::path).to_path_buf();
            let spec = match backend {
                Backend::Sqlite => format!("sqlite:{}", base.join("records.sqlite3").display()),
                _ => format!("redb:{}", base.join("records.redb").display()),
            };
            (StoreSide::File { _dir: dir, disk }, spec)
        }
    };
    let args = vec![
        "--store".to_string(),
        spec,
        "--state".into(),
        work.path().join("state.redb").display().to_string(),
        "--lease-ms".into(),
        cfg.lease.as_millis().to_string(),
        "--drop-rate".into(),
        "0.25".into(),
        // Held past the client's attempt timeout: the response is lost after the work.
        "--hold-ms".into(),
        "2500".into(),
        "--work-ms".into(),
        "100".into(),
        "--flash-ms".into(),
        cfg.flash.as_millis().to_string(),
        "--lease-renewal".into(),
        if cfg.lease_renewal { "on" } else { "off" }.into(),
        "--bmc".into(),
        match cfg.bmc {
            Bmc::Tasks => "tasks",
            Bmc::Blind => "blind",
        }
        .into(),
    ];
    let exe = cfg.exe.clone();
    let log = work.path().join("serve.log");
    let log_path = log.clone();
    let env = match backend {
        Backend::Dynamo => {
            vec![("AWS_ACCESS_KEY_ID".into(), "test".into()), ("AWS_SECRET_ACCESS_KEY".into(), "test".into())]
        }
        _ => Vec::new(),
    };
    let mut app = match blocking(move || AppServer::start(&exe, app_port, args, env, &log)).await {
        Ok(app) => app,
        // A store that refuses a configuration that loses records on restart (the Redis
        // persistence check) is the right answer for a non-durable row: say so.
        Err(e) if !fault.durable() => {
            let why = std::fs::read_to_string(&log_path).unwrap_or_default();
            let why = why.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_owned();
            return Ok(FaultRow {
                fault: fault.label(),
                backend: backend.name(),
                durable: false,
                refused: true,
                note: format!("the server refused this configuration at start-up ({e}: {why})"),
                ..FaultRow::default()
            });
        }
        Err(e) => return Err(e.into()),
    };
    let target = app.url();
    let http = reqwest::Client::builder().pool_max_idle_per_host(cfg.concurrency).build().map_err(stats_err)?;
    let before = stats(&http, &target).await?;

    let storm = tokio::spawn(storm(http.clone(), target.clone(), cfg.operations, cfg.concurrency, cfg.firmware_every));
    tokio::time::sleep(cfg.fault_after).await;

    // The fault, with the probe running while it lasts.
    let during = Arc::new(AtomicBool::new(true));
    let probe = tokio::spawn(probe(http.clone(), target.clone(), Arc::clone(&during)));
    let mut note = String::new();
    match (fault, &mut side) {
        (Fault::RedisRestart(_), StoreSide::Redis(redis)) => {
            redis.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            tokio::task::block_in_place(|| redis.restart())?;
        }
        (Fault::Stall(_), StoreSide::Redis(redis)) => {
            let pid = redis.pid().unwrap_or(0);
            signal(pid, "STOP")?;
            tokio::time::sleep(cfg.fault_for).await;
            signal(pid, "CONT")?;
        }
        (Fault::PostgresImmediateRestart, StoreSide::Postgres(pg)) => {
            tokio::task::block_in_place(|| pg.immediate_restart())?;
        }
        (Fault::PostgresTerminateBackends, StoreSide::Postgres(pg)) => {
            let n = tokio::task::block_in_place(|| pg.terminate_backends())?;
            note = format!("{n} connections terminated");
            tokio::time::sleep(Duration::from_secs(1)).await;
            let n = tokio::task::block_in_place(|| pg.terminate_backends())?;
            note.push_str(&format!(", then {n} more a second later"));
        }
        (Fault::Stall(_), StoreSide::Postgres(pg)) => {
            let pids = pg.stop()?;
            tokio::time::sleep(cfg.fault_for).await;
            for &p in &pids {
                signal(p, "CONT")?;
            }
        }
        (Fault::MySqlRestart, StoreSide::MySql(db)) => {
            // Down for a second, as the Redis restart: the storm and the probe meet a
            // server that refuses connections, then one in crash recovery.
            db.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            tokio::task::block_in_place(|| db.restart())?;
        }
        (Fault::Stall(_), StoreSide::MySql(db)) => {
            let pid = db.pid().unwrap_or(0);
            signal(pid, "STOP")?;
            tokio::time::sleep(cfg.fault_for).await;
            signal(pid, "CONT")?;
        }
        (Fault::Stall(_), StoreSide::Dynamo(moto)) => {
            let pid = moto.pid().unwrap_or(0);
            signal(pid, "STOP")?;
            tokio::time::sleep(cfg.fault_for).await;
            signal(pid, "CONT")?;
        }
        (Fault::FullDisk(_), StoreSide::File { disk: Some(disk), .. }) => {
            let filled = tokio::task::block_in_place(|| disk.fill())?;
            note = format!("{filled} bytes of filler filled the disk");
            tokio::time::sleep(cfg.fault_for).await;
            disk.free();
        }
        (Fault::ClusterPrimaryKill(_), StoreSide::Cluster(cluster)) => {
            // Killed and left dead: its replica takes over after the node timeout and has
            // no replica of its own for the rest of the run.
            let port = cluster.first_primary();
            cluster.kill(port);
            note = format!("primary 127.0.0.1:{port} killed, its replica promoted with no replica of its own");
            tokio::time::sleep(cfg.fault_for).await;
        }
        (Fault::AppKill(_), _) => {
            app.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            tokio::task::block_in_place(|| app.restart())?;
        }
        _ => note = "fault does not apply to this backend".into(),
    }
    let lifted = Instant::now();
    during.store(false, Ordering::SeqCst);
    let seen = probe.await.map_err(|e| ChaosError::Stats(e.to_string()))?;
    // Every store must come back on its own once the fault is lifted: redb reopens its
    // file after a full disk (its `PreviousIo` latch), so no restart is done for anyone.
    let recovery_ms = recover(&http, &target, lifted, RECOVERY_LIMIT).await;
    if recovery_ms.is_none() {
        note.push_str(&format!(
            "{}NOT RECOVERED: no request was served {} s after the fault was lifted",
            if note.is_empty() { "" } else { "; " },
            RECOVERY_LIMIT.as_secs()
        ));
    }
    let recovery_ms = recovery_ms.unwrap_or(u64::MAX);

    let ops = storm.await.map_err(|e| ChaosError::Stats(e.to_string()))?;
    let (lost_responses, unfinished) = check(&http, &target, &ops.results).await;
    let done = stats(&http, &target).await?.since(&before);
    let (workers, boots) = (done.infra.workers, done.infra.boots);
    let (flashes, bricked) = (done.bmc.flashes, done.bmc.bricked);
    let n = u64::from(cfg.operations);
    let firmware_operations = ops.results.iter().filter(|o| o.flash.is_some()).count() as u64;
    let double_flashes = flashes.saturating_sub(firmware_operations);
    if double_flashes > 0 {
        note.push_str(&format!(
            "{}{double_flashes} double flashes ({bricked} nodes bricked){}",
            if note.is_empty() { "" } else { "; " },
            if fault.kills_handler() && cfg.bmc == Bmc::Blind {
                ": flashes running when the server was killed had no outcome in the journal, and the retries that \
                 reclaimed them after the lease flashed again (the blind BMC has nothing to reconcile by)"
            } else {
                ""
            }
        ));
    }
    drop(app);
    drop(side);
    Ok(FaultRow {
        fault: fault.label(),
        backend: backend.name(),
        durable: fault.durable(),
        operations: cfg.operations,
        attempts: ops.attempts,
        phantom_workers: workers.saturating_sub(n),
        extra_vms: boots.saturating_sub(n),
        firmware_operations,
        double_flashes,
        bricked,
        lost_responses,
        unfinished,
        completed: ops.results.iter().filter(|o| o.worker.is_some()).count() as u64,
        client_timeouts: ops.transport_errors,
        refuses_by_design: fault.refuses_by_design(),
        unavailable_503: seen.unavailable + ops.unavailable_during.load(Ordering::SeqCst),
        slowest_answer_ms: seen.slowest_ms,
        hung: seen.hung,
        refused: false,
        recovery_ms,
        note,
    })
}

fn stats_err(e: impl std::fmt::Display) -> ChaosError {
    ChaosError::Stats(e.to_string())
}

async fn stats(http: &reqwest::Client, target: &str) -> Result<Counts, ChaosError> {
    counts(http, target, true).await.map_err(stats_err)
}

/// One logical operation: its principal, key and body, the worker its 201 named, and for
/// a firmware operation its flash.
struct Op {
    token: String,
    key: OperationKey,
    body: String,
    worker: Option<String>,
    flash: Option<FlashOp>,
}

/// The flash of a firmware operation: its key (made with the operation, kept across
/// retries and the check pass) and the flash number its 200 named.
struct FlashOp {
    key: OperationKey,
    number: Option<u64>,
}

/// Whether operation `op` of the storm also flashes firmware.
fn is_firmware(op: u32, every: u32) -> bool {
    every > 0 && op % every == every - 1
}

fn flash_number(body: &[u8]) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("flash")?.as_u64()
}

struct StormOutcome {
    results: Vec<Op>,
    attempts: u64,
    transport_errors: u64,
    unavailable_during: Arc<AtomicU64>,
}

fn create_body(op: u32) -> String {
    format!(r#"{{"image":"worker-base:2025.11","cpu":16,"memory_gb":64,"labels":{{"team":"chaos","op":"{op}"}}}}"#)
}

fn worker_id(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(v.get("id")?.as_str()?.to_owned())
}

fn client(budget: Duration) -> RetryPolicy {
    RetryPolicy::default()
        // Longer than the layer's 2 s store deadline (a 503 arrives in time), shorter than
        // the server's 2.5 s hold (a held response is lost).
        .with_attempt_timeout(Duration::from_millis(2_300))
        .with_budget(budget)
        .with_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .with_max_attempts(200)
}

async fn storm(
    http: reqwest::Client,
    target: String,
    operations: u32,
    concurrency: usize,
    firmware_every: u32,
) -> StormOutcome {
    let client = Arc::new(IdempotentClient::new(http, client(Duration::from_secs(60))));
    let gate = Arc::new(Semaphore::new(concurrency.max(1)));
    let prefix = format!("chaos-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let unavailable_during = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for op in 0..operations {
        let (client, gate, target) = (Arc::clone(&client), Arc::clone(&gate), target.clone());
        let token = format!("{prefix}-{}", op % 4);
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            let key = OperationKey::generate();
            let body = create_body(op);
            let reply = client
                .request(reqwest::Method::POST, format!("{target}/v1/workers"), &key)
                .header("authorization", &format!("Bearer {token}"))
                .json_body(body.clone())
                .send()
                .await;
            let (worker, mut attempts, mut unavailable, transport) = match reply {
                Ok(r) => {
                    let w = (r.status == 201).then(|| worker_id(&r.body)).flatten();
                    let s = r.stats;
                    (w, u64::from(s.attempts), u64::from(s.server_errors), u64::from(s.transport_errors))
                }
                Err(idem_client::ClientError::GaveUp { stats: s, .. }) => {
                    (None, u64::from(s.attempts), u64::from(s.server_errors), u64::from(s.transport_errors))
                }
                Err(_) => (None, 1, 0, 1),
            };
            let mut flash =
                is_firmware(op, firmware_every).then(|| FlashOp { key: OperationKey::generate(), number: None });
            // A firmware operation whose worker was not created yet flashes it in the
            // check pass, with the same key.
            if let (Some(f), Some(w)) = (flash.as_mut(), worker.as_deref()) {
                let (n, a, u, _) = send_flash(&client, &target, &token, w, &f.key).await;
                f.number = n;
                attempts += a;
                unavailable += u;
            }
            (Op { token, key, body, worker, flash }, attempts, unavailable, transport)
        }));
    }
    let mut out = StormOutcome {
        results: Vec::new(),
        attempts: 0,
        transport_errors: 0,
        unavailable_during: Arc::clone(&unavailable_during),
    };
    let mut unavailable = 0;
    for t in tasks {
        if let Ok((op, attempts, u, transport)) = t.await {
            out.results.push(op);
            out.attempts += attempts;
            out.transport_errors += transport;
            unavailable += u;
        }
    }
    // Every 5xx of the storm: the server answers 5xx only for an unavailable store (503)
    // or a failed boot, and the run's boots do not fail.
    out.unavailable_during.store(unavailable, Ordering::SeqCst);
    out
}

/// Flashes `worker`'s node under `key`: (the flash number of its 200, attempts, 5xx, the
/// final status if any).
async fn send_flash(
    client: &IdempotentClient,
    target: &str,
    token: &str,
    worker: &str,
    key: &OperationKey,
) -> (Option<u64>, u64, u64, Option<u16>) {
    let reply = client
        .request(reqwest::Method::POST, format!("{target}/v1/workers/{worker}/firmware"), key)
        .header("authorization", &format!("Bearer {token}"))
        .json_body(crate::storm::FIRMWARE_BODY)
        .send()
        .await;
    match reply {
        Ok(r) => (
            (r.status == 200).then(|| flash_number(&r.body)).flatten(),
            u64::from(r.stats.attempts),
            u64::from(r.stats.server_errors),
            Some(r.status.as_u16()),
        ),
        Err(idem_client::ClientError::GaveUp { stats, .. }) => {
            (None, u64::from(stats.attempts), u64::from(stats.server_errors), None)
        }
        Err(_) => (None, 1, 0, None),
    }
}

/// A keyed request that goes through the claim and the completion but creates nothing:
/// a reboot of a worker that does not exist (404, a stored answer). So the probe's own
/// requests never show up as workers or VMs.
fn probe_request(http: &reqwest::Client, target: &str, n: u32) -> reqwest::RequestBuilder {
    http.post(format!("{target}/v1/workers/w-chaos-probe-{n}/reboot"))
        .bearer_auth("chaos-probe")
        .header(leasebroker::app::NO_FAULTS, "1")
        .header("idempotency-key", OperationKey::generate().as_str())
        .header("content-type", "application/json")
        .body("{}")
}

/// What the probe saw while the fault lasted.
struct Probe {
    unavailable: u64,
    slowest_ms: u64,
    hung: u64,
}

/// How long the probe waits for an answer before it counts the request as hung: far past
/// the layer's 2 s store deadline and the drop fault's 2.5 s hold.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

async fn probe(http: reqwest::Client, target: String, during: Arc<AtomicBool>) -> Probe {
    // A probe goes out every 100 ms whether or not the one before was answered: a probe
    // whose claim landed just before a stall waits out the stall in its completion's
    // resends, and probes sent one after another then saw nothing of the stall but that one
    // slow answer.
    let mut sent = tokio::task::JoinSet::new();
    let mut n = 0u32;
    while during.load(Ordering::SeqCst) {
        n += 1;
        let request = probe_request(&http, &target, n).timeout(PROBE_TIMEOUT);
        sent.spawn(async move {
            let started = Instant::now();
            let answer = request.send().await;
            (answer, u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX))
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut seen = Probe { unavailable: 0, slowest_ms: 0, hung: 0 };
    while let Some(joined) = sent.join_next().await {
        let Ok((answer, took)) = joined else { continue };
        match answer {
            Ok(r) => {
                seen.unavailable += u64::from(r.status() == 503);
                seen.slowest_ms = seen.slowest_ms.max(took);
            }
            // No answer at all: the request hung (a refused connection while the server
            // process is down, in the app kill, is not a hang).
            Err(e) if e.is_timeout() => seen.hung += 1,
            Err(_) => {}
        }
    }
    seen
}

/// Sends fresh probe requests until one is answered by the handler (its 404): ms from
/// `lifted` to then.
async fn recover(http: &reqwest::Client, target: &str, lifted: Instant, limit: Duration) -> Option<u64> {
    let mut n = 0u32;
    while lifted.elapsed() < limit {
        n += 1;
        let ok = probe_request(http, target, n)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .is_ok_and(|r| r.status() == 404);
        if ok {
            return Some(u64::try_from(lifted.elapsed().as_millis()).unwrap_or(u64::MAX));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// How long after a fault is lifted the server must answer again on its own.
const RECOVERY_LIMIT: Duration = Duration::from_secs(15);

/// Sends every operation once more with its key (and a firmware operation's flash with
/// its own key): returns (lost stored responses, operations still without a 201, or a
/// firmware operation without its flash's 200).
async fn check(http: &reqwest::Client, target: &str, ops: &[Op]) -> (u64, u64) {
    let client = Arc::new(IdempotentClient::new(http.clone(), client(Duration::from_secs(30))));
    let gate = Arc::new(Semaphore::new(64));
    let mut tasks = Vec::new();
    for op in ops {
        let (client, gate, target) = (Arc::clone(&client), Arc::clone(&gate), target.to_owned());
        let (token, key, body, first) = (op.token.clone(), op.key.clone(), op.body.clone(), op.worker.clone());
        let flash = op.flash.as_ref().map(|f| (f.key.clone(), f.number));
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            let reply = client
                .request(reqwest::Method::POST, format!("{target}/v1/workers"), &key)
                .header("authorization", &format!("Bearer {token}"))
                .json_body(body)
                .send()
                .await;
            let again = match &reply {
                Ok(r) if r.status == 201 => worker_id(&r.body).map(|w| (w, r.replayed)),
                _ => None,
            };
            let worker = again.as_ref().map(|(w, _)| w.clone());
            let (mut lost, unfinished) = match (first, again) {
                // The first 201 must come back as a replay naming the same worker.
                (Some(first), Some((w, replayed))) => (!replayed || w != first, false),
                (Some(_), None) => (true, false),
                (None, Some(_)) => (false, false),
                (None, None) => (false, true),
            };
            let Some((flash_key, first_flash)) = flash else { return (lost, unfinished) };
            let Some(worker) = worker else { return (lost, true) };
            // The flash's first 200 must come back naming the same flash (a replay); one
            // that had none must replay or flash now.
            let (again, _, _, status) = send_flash(&client, &target, &token, &worker, &flash_key).await;
            lost |= first_flash.is_some_and(|n| again != Some(n));
            // A stored 409 is a bricked node: a final answer, counted as a double flash.
            (lost, unfinished || again.is_none() && status != Some(409))
        }));
    }
    let (mut lost, mut unfinished) = (0, 0);
    for t in tasks {
        if let Ok((l, u)) = t.await {
            lost += u64::from(l);
            unfinished += u64::from(u);
        }
    }
    (lost, unfinished)
}

/// The path of the running binary, for the server under test.
///
/// # Errors
/// When the OS cannot say.
pub fn current_exe() -> std::io::Result<PathBuf> {
    std::env::current_exe()
}

/// The run's Markdown report: the tables and a verdict line.
#[must_use]
pub fn report(rows: &[FaultRow], cfg: &ChaosConfig) -> String {
    let flashing = u64::from(cfg.operations).checked_div(u64::from(cfg.firmware_every)).unwrap_or(0);
    let mut out = format!(
        "{} operations per fault ({} of them also flash firmware, each flash {} ms), {} at a time, a quarter of \
         responses lost after the work, lease {} ms (renewal {}), {} BMC, faults lasting {} ms, hitting {} ms into the \
         storm.\n",
        cfg.operations,
        flashing,
        cfg.flash.as_millis(),
        cfg.concurrency,
        cfg.lease.as_millis(),
        if cfg.lease_renewal { "on" } else { "off" },
        match cfg.bmc {
            Bmc::Tasks => "task",
            Bmc::Blind => "blind",
        },
        cfg.fault_for.as_millis(),
        cfg.fault_after.as_millis()
    );
    out.push_str(&tables(rows));
    for r in rows.iter().filter(|r| !r.note.is_empty()) {
        out.push_str(&format!("\n- {} / {}: {}", r.backend, r.fault, r.note));
    }
    out.push('\n');
    out
}

/// Whether the run's ports stay clear of the shared servers' (Redis 6379, Postgres 5432,
/// MariaDB 3306).
#[must_use]
pub fn uses_private_ports(cfg: &ChaosConfig) -> bool {
    let ports = cfg.base_port..=cfg.base_port + 9;
    !ports.contains(&6379) && !ports.contains(&5432) && !ports.contains(&3306)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Pins: the strict row refuses a shard's keys for as long as it has no replica, so its
    // unfinished operations are the design, not a failure; a phantom worker still fails it.
    #[test]
    fn a_strict_cluster_row_may_leave_operations_unfinished_but_never_run_twice() {
        let fault = Fault::ClusterPrimaryKill(ClusterAck::Strict);
        let mut row = FaultRow {
            fault: fault.label(),
            backend: fault.backend().name(),
            durable: fault.durable(),
            operations: 10,
            completed: 7,
            unfinished: 3,
            refuses_by_design: fault.refuses_by_design(),
            ..FaultRow::default()
        };
        assert!(!row.failed(), "{row:?}");
        assert!(
            tables(std::slice::from_ref(&row)).contains("| primary killed, not replaced, wait=1 strict | 10 | 7 | 3 |")
        );
        row.phantom_workers = 1;
        assert!(row.failed());
        assert!(!Fault::ClusterPrimaryKill(ClusterAck::Degrade).refuses_by_design());
    }

    // Pins: a double flash on a durable configuration must fail the row (the column once
    // could not fail: the storm flashed nothing).
    #[test]
    fn a_double_flash_fails_a_durable_row_and_shows_in_the_table() {
        let row = FaultRow {
            fault: "stall (SIGSTOP)".into(),
            backend: "redis",
            durable: true,
            operations: 80,
            firmware_operations: 20,
            double_flashes: 1,
            ..FaultRow::default()
        };
        assert!(row.failed());
        let table = tables(std::slice::from_ref(&row));
        assert!(table.contains("| 0 | 0 | 1 | 0 |"), "{table}");
        assert!(!FaultRow { double_flashes: 0, ..row.clone() }.failed());
        // Not durable: measured, not required to be zero.
        assert!(!FaultRow { durable: false, ..row }.failed());
    }

    // Pins: the full run exited 1 on Redis without persistence alone, whose wiped records
    // left 8 operations unfinished: a non-durable row's losses are measured (a column of
    // the table), while an unfinished operation on a durable row or a hang anywhere fails.
    #[test]
    fn unfinished_operations_fail_durable_rows_and_show_for_all() {
        let row = FaultRow {
            fault: "restart".into(),
            backend: "redis",
            durable: false,
            unfinished: 8,
            ..FaultRow::default()
        };
        assert!(!row.failed());
        assert!(tables(std::slice::from_ref(&row)).contains("| 0 | 0 | 0 | 0 | 8 |"));
        assert!(FaultRow { durable: true, ..row.clone() }.failed());
        assert!(FaultRow { hung: 1, ..row }.failed());
    }

    // Pins: a store that never recovered after the fault was lifted once passed the run
    // (the server was restarted for it); it must fail the row now.
    #[test]
    fn a_server_that_does_not_recover_fails_the_row() {
        let row = FaultRow { fault: "full disk (tmpfs)".into(), backend: "redb", durable: true, ..FaultRow::default() };
        assert!(!row.failed());
        assert!(FaultRow { recovery_ms: u64::MAX, ..row }.failed());
    }

    #[test]
    fn a_backend_whose_rows_are_apart_gets_one_table() {
        let row =
            |fault: &str, backend| FaultRow { fault: fault.into(), backend, durable: true, ..FaultRow::default() };
        let rows = [row("app server SIGKILL", "redb"), row("full disk", "sqlite"), row("full disk", "redb")];
        let table = tables(&rows);
        assert_eq!(table.matches("#### redb").count(), 1, "{table}");
        assert!(table.find("#### redb") < table.find("#### sqlite"), "{table}");
    }

    #[test]
    fn every_nth_operation_flashes() {
        let flashing: Vec<u32> = (0..12).filter(|&op| is_firmware(op, 4)).collect();
        assert_eq!(flashing, [3, 7, 11]);
        assert!(!(0..12).any(|op| is_firmware(op, 0)));
    }
}
