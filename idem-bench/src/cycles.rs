//! `idem-bench cycles`: claim -> complete -> replay cycles through a backend's store,
//! against that backend's raw baseline, in alternating slices of one process.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use idem_core::{BoxError, ClaimOutcome, MemoryStore, Store};
use idem_postgres::PostgresStore;
use idem_redb::RedbStore;
use idem_redis::RedisStore;

use crate::baseline::{MySqlByHand, MySqlStatements, NaiveRedb, NaiveSqlite, PostgresByHand, RedisByHand};
use crate::workload::{Summary, Workload, drive};
use crate::{Backend, Endpoints};

/// Settings of one `cycles` row.
#[derive(Debug, clap::Args)]
pub(crate) struct CyclesArgs {
    /// The backend.
    #[arg(long, value_enum)]
    backend: Backend,
    /// Concurrent callers (tokio tasks), each running whole cycles back to back.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Cycles measured for the library and again for the baseline.
    #[arg(long, default_value_t = 4000)]
    count: u64,
    /// Alternating slices (baseline, library, library, baseline, ...) the count is split
    /// into, so a change in machine load hits both columns.
    #[arg(long, default_value_t = 4)]
    rounds: u64,
    /// Stored response body size, bytes.
    #[arg(long, default_value_t = 256)]
    body_bytes: usize,
    /// Skip the replay step (claim -> complete only, as the peer comparison does).
    #[arg(long)]
    no_replay: bool,
    /// Append the row to this CSV file.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// With `--backend redis`: run on the Redis Cluster reachable at these comma-separated
    /// node URLs (e.g. the six nodes `scripts/redis-cluster` starts on 7000-7005) instead
    /// of `--redis-url`; the baseline's `SET NX` + `SET` go to the same cluster.
    #[arg(long, value_delimiter = ',')]
    redis_cluster: Vec<String>,
    /// With `--backend postgres`: `Config::with_listen(true)`, so every completion sends
    /// `NOTIFY` (what waking a waiting duplicate costs the completions).
    #[arg(long)]
    pg_listen: bool,
    #[command(flatten)]
    endpoints: Endpoints,
}

enum Baseline {
    None,
    Redb(NaiveRedb),
    Sqlite(NaiveSqlite),
    Redis(RedisByHand),
    // Boxed: it holds the store's prepared statements, several times the other variants.
    Postgres(Box<PostgresByHand>),
    Mysql(Box<MySqlByHand>),
}

impl Baseline {
    async fn cycle(&self, work: &Workload, i: u64, replay: bool) -> Result<(), BoxError> {
        let req = work.request("base", i);
        let response = work.response();
        match self {
            Baseline::None => Ok(()),
            Baseline::Redb(b) => b.cycle(req, response, replay).await,
            Baseline::Sqlite(b) => b.cycle(req, response, replay).await,
            Baseline::Redis(b) => b.cycle(req, response, replay).await,
            Baseline::Postgres(b) => b.cycle(req, response, replay).await,
            Baseline::Mysql(b) => b.cycle(req, response, replay).await,
        }
    }
}

/// One library cycle: claim a fresh key, complete it, claim again and find the response.
async fn library_cycle(store: &dyn Store, work: &Workload, i: u64, replay: bool) -> Result<(), BoxError> {
    let req = work.request("lib", i);
    let ClaimOutcome::Claimed(record) = store.claim(req.clone()).await? else {
        return Err("library: fresh key not claimed".into());
    };
    store.complete(record.id, record.token, work.response()).await?;
    if !replay {
        return Ok(());
    }
    match store.claim(req).await? {
        ClaimOutcome::Existing { record, .. } if record.response.is_some() => Ok(()),
        _ => Err("library: replay did not find the response".into()),
    }
}

/// Runs one row and prints it.
pub(crate) async fn run(args: CyclesArgs) -> Result<(), BoxError> {
    if !args.redis_cluster.is_empty() && args.backend != Backend::Redis {
        return Err("--redis-cluster goes with --backend redis".into());
    }
    let run = crate::run_id();
    let dir = crate::bench_dir()?;
    let work = Arc::new(Workload::new(&run, args.body_bytes));
    let mut redb_store = None;
    let mut cleanup_pg = None;
    let mut mysql_store = None;
    let (library, baseline): (Arc<dyn Store>, Baseline) = match args.backend {
        Backend::Memory => (Arc::new(MemoryStore::new()), Baseline::None),
        Backend::Redb => {
            let store = RedbStore::open(dir.path().join("library.redb"), idem_redb::Config::default())?;
            redb_store = Some(store.clone());
            (Arc::new(store), Baseline::Redb(NaiveRedb::create(&dir.path().join("naive.redb"))?))
        }
        Backend::Sqlite => {
            let (lib, naive) = (dir.path().join("library.sqlite3"), dir.path().join("naive.sqlite3"));
            let store = tokio::task::spawn_blocking(move || {
                idem_sqlite::SqliteStore::open(lib, idem_sqlite::Config::default())
            })
            .await??;
            let naive = tokio::task::spawn_blocking(move || NaiveSqlite::create(&naive)).await??;
            (Arc::new(store), Baseline::Sqlite(naive))
        }
        Backend::Redis => {
            let prefix = format!("idem-bench:{run}:");
            let config = idem_redis::Config::default().with_prefix(format!("{prefix}lib:"));
            let store = if args.redis_cluster.is_empty() {
                RedisStore::connect(&args.endpoints.redis_url, config).await?
            } else {
                RedisStore::connect_cluster(&args.redis_cluster, config).await?
            };
            let hand = RedisByHand::new(store.connection(), format!("{prefix}hand:"));
            (Arc::new(store), Baseline::Redis(hand))
        }
        Backend::Postgres => {
            let config = idem_postgres::Config::default()
                .with_schema(crate::PG_SCHEMA)
                .with_max_connections(args.endpoints.pg_pool)
                .with_listen(args.pg_listen);
            let store = PostgresStore::connect(&args.endpoints.postgres_url, config).await?;
            cleanup_pg = Some(store.clone());
            let hand = PostgresByHand::new(&store);
            (Arc::new(store), Baseline::Postgres(Box::new(hand)))
        }
        Backend::Mysql => {
            let config = idem_mysql::Config::default()
                .with_table_prefix(crate::MYSQL_PREFIX)
                .with_max_connections(args.endpoints.mysql_pool);
            let store = idem_mysql::MySqlStore::connect(&args.endpoints.mysql_url, config).await?;
            mysql_store = Some(store.clone());
            let hand = MySqlByHand::new(store.pool().clone(), crate::MYSQL_PREFIX);
            (Arc::new(store), Baseline::Mysql(Box::new(hand)))
        }
    };
    let baseline = Arc::new(baseline);
    let replay = !args.no_replay;
    let lib = {
        let (store, work) = (Arc::clone(&library), Arc::clone(&work));
        Arc::new(move |i| {
            let (store, work) = (Arc::clone(&store), Arc::clone(&work));
            async move { library_cycle(&*store, &work, i, replay).await }
        })
    };
    let base = {
        let (baseline, work) = (Arc::clone(&baseline), Arc::clone(&work));
        Arc::new(move |i| {
            let (baseline, work) = (Arc::clone(&baseline), Arc::clone(&work));
            async move { baseline.cycle(&work, i, replay).await }
        })
    };
    let has_baseline = !matches!(*baseline, Baseline::None);

    // Warm-up: files, connections, prepared statements and script caches settle first.
    let warm = (args.count / 20).clamp(16, 500);
    drive(Arc::clone(&lib), args.concurrency, 0, warm).await?;
    if has_baseline {
        drive(Arc::clone(&base), args.concurrency, 0, warm).await?;
    }
    let stats_before = redb_store.as_ref().map(RedbStore::batch_stats);

    let rounds = args.rounds.max(1);
    let slice = (args.count / rounds).max(1);
    let (mut lib_sum, mut base_sum) = (Summary::default(), Summary::default());
    let (mut lib_statements, mut base_statements) = (Statements::default(), Statements::default());
    let pool = mysql_store.as_ref().map(|s| s.pool().clone());
    for r in 0..rounds {
        let first = warm + r * slice;
        if r % 2 == 0 && has_baseline {
            let before = Statements::read(pool.as_ref()).await?;
            base_sum.merge(drive(Arc::clone(&base), args.concurrency, first, slice).await?);
            base_statements.add(before, Statements::read(pool.as_ref()).await?);
        }
        let before = Statements::read(pool.as_ref()).await?;
        lib_sum.merge(drive(Arc::clone(&lib), args.concurrency, first, slice).await?);
        lib_statements.add(before, Statements::read(pool.as_ref()).await?);
        if r % 2 == 1 && has_baseline {
            let before = Statements::read(pool.as_ref()).await?;
            base_sum.merge(drive(Arc::clone(&base), args.concurrency, first, slice).await?);
            base_statements.add(before, Statements::read(pool.as_ref()).await?);
        }
    }
    let per_batch = match (redb_store.as_ref().map(RedbStore::batch_stats), stats_before) {
        (Some(after), Some(before)) if after.batches > before.batches => {
            Some((after.operations - before.operations) as f64 / (after.batches - before.batches) as f64)
        }
        _ => None,
    };
    if let Some(store) = &mysql_store {
        let sql = format!("DELETE FROM {} WHERE principal = ?", MySqlStatements::for_prefix(crate::MYSQL_PREFIX).table);
        idem_mysql::sqlx::query(&sql).bind(work.principal.as_bytes()).execute(store.pool()).await?;
    }
    if let Some(store) = cleanup_pg {
        let sql = format!("DELETE FROM {}.records WHERE principal = $1", crate::PG_SCHEMA);
        idem_postgres::sqlx::query(&sql).bind(work.principal.as_bytes()).execute(store.pool()).await?;
    }

    let ratio = if has_baseline && base_sum.rate() > 0.0 { lib_sum.rate() / base_sum.rate() } else { f64::NAN };
    let cycle = if replay { "claim+complete+replay" } else { "claim+complete" };
    println!(
        "{:<9} {:>5} {:>7} {:>12} {:>9} {:>9} {:>12} {:>9} {:>9} {:>7} {:>9}",
        "backend",
        "conc",
        "cycles",
        "lib cyc/s",
        "p50 ms",
        "p99 ms",
        "base cyc/s",
        "p50 ms",
        "p99 ms",
        "ratio",
        "ops/batch"
    );
    let backend = if args.redis_cluster.is_empty() { args.backend.name() } else { "redis-cl" };
    println!(
        "{:<9} {:>5} {:>7} {:>12.0} {:>9.3} {:>9.3} {:>12} {:>9} {:>9} {:>7} {:>9}",
        backend,
        args.concurrency,
        lib_sum.cycles,
        lib_sum.rate(),
        lib_sum.quantile_ms(0.5),
        lib_sum.quantile_ms(0.99),
        if has_baseline { format!("{:.0}", base_sum.rate()) } else { "-".into() },
        if has_baseline { format!("{:.3}", base_sum.quantile_ms(0.5)) } else { "-".into() },
        if has_baseline { format!("{:.3}", base_sum.quantile_ms(0.99)) } else { "-".into() },
        if has_baseline { format!("{ratio:.2}x") } else { "-".into() },
        per_batch.map_or_else(|| "-".into(), |b| format!("{b:.1}")),
    );
    println!("(one cycle = {cycle}; each store call is one op, so ops/s = {} x cycles/s)", if replay { 3 } else { 2 });
    if pool.is_some() {
        println!(
            "statements per cycle (server counters, whole server): library {}, by hand {}",
            lib_statements.per_cycle(lib_sum.cycles),
            base_statements.per_cycle(base_sum.cycles)
        );
    }
    if let Some(path) = args.csv {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        writeln!(
            f,
            "{},{},{},{},{:.1},{:.4},{:.4},{:.1},{:.4},{:.4},{:.3},{}",
            backend,
            args.concurrency,
            cycle,
            lib_sum.cycles,
            lib_sum.rate(),
            lib_sum.quantile_ms(0.5),
            lib_sum.quantile_ms(0.99),
            base_sum.rate(),
            base_sum.quantile_ms(0.5),
            base_sum.quantile_ms(0.99),
            ratio,
            per_batch.map_or_else(String::new, |b| format!("{b:.1}")),
        )?;
    }
    if let Baseline::Redb(naive) = &*baseline {
        let expected = warm + slice * rounds;
        let found = naive.len()?;
        if found != expected {
            return Err(format!("redb baseline holds {found} records, expected {expected}").into());
        }
    }
    Ok(())
}

/// The server's statement counters (`SHOW GLOBAL STATUS`) and this process's CPU time,
/// read around each measured slice of a MySQL run: how many statements and round trips a
/// cycle costs on each side, and how much client CPU. The counters are global, so anything
/// else the server runs meanwhile is counted too.
#[derive(Clone, Copy, Debug, Default)]
struct Statements {
    /// `Questions`: statements the clients sent (text and prepared executions).
    questions: u64,
    /// `Com_stmt_execute`: prepared-statement executions.
    executes: u64,
    /// `Com_stmt_prepare`: statements prepared.
    prepares: u64,
    /// CPU time of this process (every thread): the client's side of the cycles.
    cpu: std::time::Duration,
}

impl Statements {
    /// The counters now; zeros without a MySQL pool.
    async fn read(pool: Option<&idem_mysql::sqlx::MySqlPool>) -> Result<Self, BoxError> {
        use idem_mysql::sqlx::{self, Row as _};
        let Some(pool) = pool else { return Ok(Self::default()) };
        let cpu = crate::http::process_cpu();
        let rows = sqlx::raw_sql(
            "SHOW GLOBAL STATUS WHERE Variable_name IN ('Questions', 'Com_stmt_execute', 'Com_stmt_prepare')",
        )
        .fetch_all(pool)
        .await?;
        let mut out = Self { cpu, ..Self::default() };
        for row in rows {
            let (name, value): (String, String) = (row.try_get(0)?, row.try_get(1)?);
            let value = value.parse()?;
            match name.to_ascii_lowercase().as_str() {
                "questions" => out.questions = value,
                "com_stmt_execute" => out.executes = value,
                "com_stmt_prepare" => out.prepares = value,
                _ => {}
            }
        }
        Ok(out)
    }

    /// Adds the difference `after - before`, less the one statement that read `after`.
    fn add(&mut self, before: Self, after: Self) {
        self.questions += after.questions.saturating_sub(before.questions).saturating_sub(1);
        self.executes += after.executes.saturating_sub(before.executes);
        self.prepares += after.prepares.saturating_sub(before.prepares);
        self.cpu += after.cpu.saturating_sub(before.cpu);
    }

    fn per_cycle(&self, cycles: u64) -> String {
        let c = cycles.max(1) as f64;
        format!(
            "{:.2} (of which {:.2} prepared executions, {:.3} prepares), client CPU {:.0} us",
            self.questions as f64 / c,
            self.executes as f64 / c,
            self.prepares as f64 / c,
            self.cpu.as_secs_f64() * 1e6 / c
        )
    }
}
