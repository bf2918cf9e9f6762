//! # idem-bench
//!
//! The benchmark harness behind `BENCHMARKS.md`. Every row of that file is one command of
//! this binary; all of them are measurements, none is a test (nothing here runs under
//! `cargo test`).
//!
//! ```text
//! cargo build --release -p idem-bench
//! idem-bench cycles --backend redb --concurrency 32        # library vs naive, one row
//! idem-bench cycles --backend mysql --no-replay            # MySqlStore vs its statements by hand
//! idem-bench scale --backend mysql --sizes 10000,1000000   # claim + complete as the table grows
//! idem-bench http --store memory --mode first              # layer vs bare handler (needs wrk)
//! idem-bench size --backend sqlite                         # bytes per record
//! idem-bench sweep --backend redb --records 1000000        # peak RSS while sweeping
//! idem-bench renew --backend postgres --handlers 1000      # lease renewals of long handlers
//! idem-bench memory --concurrency 64 --mib 100              # peak RSS of streamed responses
//! idem-bench pgtx --via pgbouncer                          # completion in the handler's transaction
//! idem-bench seal --store redis --mode replay --body 1024   # sealed vs unsealed responses
//! idem-bench wake --backend postgres --waiters 8            # waiting duplicates: polling vs waking
//! idem-bench consumer --broker nats --store redis           # messages/s with and without idem-consumer
//! ```
//!
//! # Layout
//! - `workload`: the shared request/response shape and the concurrent driver (latencies
//!   of every cycle, sorted for p50/p99).
//! - `baseline`: the raw baselines (naive one-commit-per-write redb and SQLite, Redis
//!   round trips by hand, the Postgres statements by hand, the MySQL transactions by hand).
//! - `cycles`: library against baseline, claim -> complete -> replay.
//! - `http`: an axum handler with and without `idem_http::IdempotencyLayer`, loaded by `wrk`.
//! - `seal`: sealed against unsealed stored responses behind the layer, in process.
//! - `size`: bytes per record per backend.
//! - `sweep`: peak resident memory while sweeping expired records.
//! - `renew`: N long handlers behind the layer renewing their leases: renewals per second
//!   sustained, and renewal's store load against claim + complete.
//! - `memory`: peak resident memory of N concurrent large streamed responses, with and
//!   without the layer, each side in a child process of its own.
//! - `pgtx`: claim + the handler's insert + completion in one transaction on a sqlx pool,
//!   against the same statements by hand, straight to PostgreSQL or through PgBouncer.
//! - `obs`: the layer per request with a silent INFO subscriber and a Prometheus recorder
//!   against the same without (two builds: `--features metrics` and default).
//! - `wake`: duplicates waiting for an in-flight request (`with_in_flight_wait`): time
//!   from the first attempt's completion to their answers, polling against waking.
//! - `consumer`: messages per second through `idem-consumer`'s JetStream or RabbitMQ glue
//!   against the same consumer acking them bare.
//! - `benches/pure.rs`: divan micro-benchmarks of the pure paths.
//!
//! Embedded files go to a temporary directory under `$IDEM_BENCH_DIR` (default the system
//! temporary directory): put it on the disk you want to measure, fsync on tmpfs is free.

mod baseline;
mod cache;
mod consumer;
mod cycles;
mod http;
mod memory;
mod obs;
mod pgtx;
mod renew;
mod scale;
mod seal;
mod size;
mod sweep;
mod wake;
mod workload;

use clap::{Parser, Subcommand, ValueEnum};
use idem_core::BoxError;

/// The Postgres schema every benchmark uses (its own, so it never touches the tests' tables).
pub(crate) const PG_SCHEMA: &str = "idem_bench";

/// The MySQL table prefix of `cycles` (its own, so it never touches the tests' tables;
/// `scale` uses one per run and drops it).
pub(crate) const MYSQL_PREFIX: &str = "idem_bench";

#[derive(Debug, Parser)]
#[command(
    name = "idem-bench",
    about = "idem benchmarks: store cycles, HTTP overhead, storage cost, sweep memory, lease renewal, streamed-response memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Claim -> complete -> replay cycles: library against the backend's raw baseline.
    Cycles(cycles::CyclesArgs),
    /// Claim + complete latency as the store holds 10k, 1M, 10M live records.
    Scale(scale::ScaleArgs),
    /// A trivial axum handler with and without the idempotency layer, loaded by wrk.
    Http(http::HttpArgs),
    /// Bytes per record: in flight, completed with a 1 KiB body, with a 100 KiB body.
    Size(size::SizeArgs),
    /// Peak resident memory while sweeping expired records.
    Sweep(sweep::SweepArgs),
    /// Long handlers behind the layer renewing their leases: renewals/s sustained, late
    /// renewals, and renewal's store load against claim + complete.
    Renew(renew::RenewArgs),
    /// Peak RSS of N concurrent large streamed responses, with and without the layer.
    Memory(memory::MemoryArgs),
    /// Claim + the handler's insert + completion in one transaction (sqlx pool), against
    /// the same statements sent by hand through the same pool.
    Pgtx(pgtx::PgTxArgs),
    /// Sealed against unsealed stored responses behind the layer (first-time requests or
    /// replays), interleaved runs.
    Seal(seal::SealArgs),
    /// Replays behind the layer on Redis or PostgreSQL, with and without the in-process
    /// cache of completed records (idem-cache), interleaved runs; then the cache's memory
    /// under a key-churning load.
    Cache(cache::CacheArgs),
    /// The layer per request with a silent INFO subscriber and (built with `metrics`) a
    /// Prometheus recorder installed, or without; no sockets.
    Obs(obs::ObsArgs),
    Wake(wake::WakeArgs),
    /// Messages per second through idem-consumer's glue (NATS JetStream or RabbitMQ)
    /// against the same consumer without it, interleaved runs.
    Consumer(consumer::ConsumerArgs),
}

/// A store backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
    /// `idem_core::MemoryStore`.
    Memory,
    /// `idem_redb::RedbStore` (group commit, durable).
    Redb,
    /// `idem_sqlite::SqliteStore` (group commit, `synchronous = FULL`).
    Sqlite,
    /// `idem_redis::RedisStore`.
    Redis,
    /// `idem_postgres::PostgresStore`.
    Postgres,
    /// `idem_mysql::MySqlStore` (MySQL 8 or MariaDB 10.11).
    Mysql,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redb => "redb",
            Backend::Sqlite => "sqlite",
            Backend::Redis => "redis",
            Backend::Postgres => "postgres",
            Backend::Mysql => "mysql",
        }
    }
}

/// Where the servers are.
#[derive(Debug, clap::Args)]
pub(crate) struct Endpoints {
    /// Redis URL.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Postgres URL.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    postgres_url: String,
    /// Postgres pool size (library and baseline share the pool).
    #[arg(long, default_value_t = 16)]
    pg_pool: usize,
    /// MySQL or MariaDB URL.
    #[arg(long, default_value = "mysql://root@127.0.0.1:3306/test")]
    mysql_url: String,
    /// MySQL pool size (library and baseline share the pool; 16 is the store's default).
    #[arg(long, default_value_t = 16)]
    mysql_pool: usize,
}

/// A short random id for this run's keys, principals and prefixes.
pub(crate) fn run_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// A temporary directory under `$IDEM_BENCH_DIR` (or the system temporary directory).
pub(crate) fn bench_dir() -> Result<tempfile::TempDir, BoxError> {
    Ok(match std::env::var_os("IDEM_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir)?,
        None => tempfile::tempdir()?,
    })
}

fn main() -> Result<(), BoxError> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        match cli.command {
            Command::Cycles(args) => cycles::run(args).await,
            Command::Scale(args) => scale::run(args).await,
            Command::Http(args) => http::run(args).await,
            Command::Size(args) => size::run(args).await,
            Command::Sweep(args) => sweep::run(args).await,
            Command::Renew(args) => renew::run(args).await,
            Command::Memory(args) => memory::run(args).await,
            Command::Pgtx(args) => pgtx::run(args).await,
            Command::Seal(args) => seal::run(args).await,
            Command::Cache(args) => cache::run(args).await,
            Command::Obs(args) => obs::run(args).await,
            Command::Wake(args) => wake::run(args).await,
            Command::Consumer(args) => consumer::run(args).await,
        }
    })
}
