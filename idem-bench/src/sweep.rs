//! `idem-bench sweep`: resident memory while a store sweeps a large backlog of expired
//! records in bounded batches.
//!
//! The store reads a `ManualClock`: the records are claimed (in flight, 60 s lease, 600 s
//! retention), the clock moves one hour ahead so every one of them is expired, then
//! `sweep(batch)` runs until it reports no `more`. Peak RSS comes from the kernel's
//! high-water mark (`VmHWM`), reset (`/proc/self/clear_refs`) right before the sweep, so it
//! shows what the sweep itself needed, next to the RSS the loaded store already had.
//! For Postgres the records and the sweep's work live in the server; the figure is the
//! client's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{BoxError, ClaimOutcome, ManualClock, Store, UnixMillis};
use idem_postgres::PostgresStore;
use idem_redb::RedbStore;

use crate::workload::{Workload, drive};
use crate::{Backend, Endpoints};

/// Settings of one `sweep` row.
#[derive(Debug, clap::Args)]
pub(crate) struct SweepArgs {
    /// The backend (redb, sqlite or postgres; Redis expires records on its own).
    #[arg(long, value_enum)]
    backend: Backend,
    /// Expired records to sweep.
    #[arg(long, default_value_t = 100_000)]
    records: u64,
    /// Records per `sweep` call.
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Concurrent callers while loading the records.
    #[arg(long, default_value_t = 64)]
    load_concurrency: usize,
    #[command(flatten)]
    endpoints: Endpoints,
}

/// `VmRSS` and `VmHWM` of this process, KiB.
fn rss_kib() -> Result<(u64, u64), BoxError> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok((field("VmRSS:"), field("VmHWM:")))
}

/// Runs one row and prints it.
pub(crate) async fn run(args: SweepArgs) -> Result<(), BoxError> {
    let run = crate::run_id();
    let dir = crate::bench_dir()?;
    let clock = Arc::new(ManualClock::new(UnixMillis(1_800_000_000_000)));
    let mut drop_schema = None;
    let store: Arc<dyn Store> = match args.backend {
        Backend::Redb => Arc::new(RedbStore::open(
            dir.path().join("sweep.redb"),
            idem_redb::Config::default().with_clock(clock.clone()),
        )?),
        Backend::Sqlite => {
            let (path, c) = (dir.path().join("sweep.sqlite3"), clock.clone());
            Arc::new(
                tokio::task::spawn_blocking(move || {
                    idem_sqlite::SqliteStore::open(path, idem_sqlite::Config::default().with_clock(c))
                })
                .await??,
            )
        }
        Backend::Postgres => {
            let schema = format!("idem_bench_sweep_{run}");
            let config = idem_postgres::Config::default().with_schema(schema.clone()).with_clock(clock.clone());
            let store = PostgresStore::connect(&args.endpoints.postgres_url, config).await?;
            drop_schema = Some((store.clone(), schema));
            Arc::new(store)
        }
        Backend::Memory | Backend::Redis | Backend::Mysql => {
            return Err("sweep is measured for redb, sqlite and postgres".into());
        }
    };
    let work = Arc::new(Workload::new(&run, 0));
    let load_started = Instant::now();
    let cycle = {
        let (store, work) = (Arc::clone(&store), Arc::clone(&work));
        Arc::new(move |i: u64| {
            let (store, work) = (Arc::clone(&store), Arc::clone(&work));
            async move {
                match store.claim(work.request("sweep", i)).await? {
                    ClaimOutcome::Claimed(_) => Ok::<(), BoxError>(()),
                    ClaimOutcome::Existing { .. } => Err("fresh key not claimed".into()),
                }
            }
        })
    };
    drive(cycle, args.load_concurrency, 0, args.records).await?;
    let load_secs = load_started.elapsed().as_secs_f64();
    clock.advance(Duration::from_secs(3600));

    let (rss_before, _) = rss_kib()?;
    std::fs::write("/proc/self/clear_refs", "5")?;
    let started = Instant::now();
    let (mut removed, mut calls) = (0u64, 0u64);
    loop {
        let out = store.sweep(args.batch).await?;
        removed += out.removed;
        calls += 1;
        if !out.more {
            break;
        }
    }
    let sweep_secs = started.elapsed().as_secs_f64();
    let (rss_after, peak) = rss_kib()?;
    if let Some((store, schema)) = drop_schema {
        idem_postgres::sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE")).execute(store.pool()).await?;
    }
    println!(
        "{:<9} {:>9} {:>6} {:>9} {:>7} {:>9} {:>9} {:>13} {:>13} {:>13}",
        "backend",
        "records",
        "batch",
        "removed",
        "calls",
        "load s",
        "sweep s",
        "RSS before MiB",
        "peak sweep MiB",
        "RSS after MiB"
    );
    println!(
        "{:<9} {:>9} {:>6} {:>9} {:>7} {:>9.1} {:>9.1} {:>13.1} {:>13.1} {:>13.1}",
        args.backend.name(),
        args.records,
        args.batch,
        removed,
        calls,
        load_secs,
        sweep_secs,
        rss_before as f64 / 1024.0,
        peak as f64 / 1024.0,
        rss_after as f64 / 1024.0,
    );
    if removed != args.records {
        return Err(format!("swept {removed} records, expected {}", args.records).into());
    }
    Ok(())
}
