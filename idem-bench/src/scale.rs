//! `idem-bench scale`: claim + complete latency and throughput as a store holds more live
//! records.
//!
//! One store per run. Before each measured size the store is filled up to that many live
//! (completed, unexpired) records, written straight into the backend's tables in large
//! transactions with the store's own encoding (going through the `Store` API would take
//! hours at 10 million). Then `--count` claim + complete cycles of fresh keys run from
//! `--concurrency` callers through the `Store` API, and the row gives cycles/s, p50 and
//! p99 of one cycle, and p50 against the smallest size's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{BoxError, ClaimOutcome, FencingToken, Record, RecordId, RecordState, Store, UnixMillis};

use crate::Endpoints;
use crate::workload::{Summary, Workload, drive};

/// Backends with a table to fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ScaleBackend {
    Redb,
    Sqlite,
    Postgres,
    Mysql,
}

/// Settings of one `scale` run.
#[derive(Debug, clap::Args)]
pub(crate) struct ScaleArgs {
    /// The backend.
    #[arg(long, value_enum)]
    backend: ScaleBackend,
    /// Live records before each measurement, ascending, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [10_000u64, 1_000_000, 10_000_000])]
    sizes: Vec<u64>,
    /// Concurrent callers.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Claim + complete cycles measured at each size.
    #[arg(long, default_value_t = 5000)]
    count: u64,
    /// With `--backend mysql`: one store (tables of their own) per size, all filled first,
    /// then measured in alternating slices (forward, then backward order, `--rounds`
    /// times), so a change in the machine's load hits every size alike.
    #[arg(long)]
    interleave: bool,
    /// Slices per size with `--interleave` (the count is split among them).
    #[arg(long, default_value_t = 8)]
    rounds: u64,
    #[command(flatten)]
    endpoints: Endpoints,
}

/// The live record number `n` of the fill: its own id, completed, a day of retention.
fn filler(template: &Record, n: u64) -> Record {
    let mut record = template.clone();
    // Spread like BLAKE3 ids (splitmix64 of n), so inserts land all over the B-trees.
    let mut id = [0u8; 32];
    let mut x = n;
    for chunk in id.chunks_exact_mut(8) {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    record.id = RecordId::from_bytes(id);
    record
}

/// A completed record to copy: the workload's response, expiring in a day.
fn template(work: &Workload) -> Record {
    let now = idem_core::Clock::now(&idem_core::SystemClock);
    let req = work.request("fill", 0);
    Record {
        id: req.id(),
        scope: req.scope().clone(),
        key: req.key().clone(),
        fingerprint: req.fingerprint(),
        state: RecordState::Completed,
        token: FencingToken::first_at(now),
        response: Some(work.response()),
        created_at: now,
        started_at: now,
        lease_expires_at: now,
        expires_at: UnixMillis(now.0 + 86_400_000),
    }
}

const CHUNK: u64 = 100_000;

/// Rows per multi-row `INSERT` of the MySQL fill (12 parameters each, well under the
/// protocol's 65,535 per statement).
const MYSQL_ROWS_PER_INSERT: u64 = 1000;

/// The id of row `j` of a MySQL fill of `m` rows numbered from `from`: uniform over the
/// id space like BLAKE3 ids, and ascending in `j`. The first 8 bytes are the start of
/// `j`'s slice of `2^64 / m` plus an offset inside it, the other 24 those of
/// [`filler`]. InnoDB keeps rows in a B-tree on the primary key (the id): inserting a
/// fill in id order passes through the tree once, where random order would read a leaf
/// page per row once the table outgrows the buffer pool.
fn mysql_fill_id(template: &Record, from: u64, m: u64, j: u64) -> RecordId {
    let mut id = *filler(template, from + j).id.as_bytes();
    let width = u64::MAX / m.max(1);
    let offset = u64::from_le_bytes(id[..8].try_into().expect("8 bytes")) % width.max(1);
    id[..8].copy_from_slice(&(j * width + offset).to_be_bytes());
    RecordId::from_bytes(id)
}

/// Fills `<prefix>_records` with rows `from..to`: completed records in the store's own
/// encoding (the columns and values idem-mysql writes), in id order, 1000 rows per
/// `INSERT` and `CHUNK` rows per transaction.
async fn fill_mysql(
    store: &idem_mysql::MySqlStore,
    prefix: &str,
    template: &Record,
    from: u64,
    to: u64,
) -> Result<(), BoxError> {
    use idem_mysql::sqlx;
    let response = idem_core::codec::encode_response(template.response.as_ref().ok_or("no response")?);
    let table = crate::baseline::MySqlStatements::for_prefix(prefix).table;
    let cols = crate::baseline::MYSQL_COLUMNS.join(", ");
    let row = format!("({})", vec!["?"; crate::baseline::MYSQL_COLUMNS.len()].join(", "));
    let token = i64::try_from(template.token.0)?;
    let (m, mut n) = (to - from, from);
    let mut conn = store.pool().acquire().await?;
    while n < to {
        let chunk_end = (n + CHUNK).min(to);
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        while n < chunk_end {
            let end = (n + MYSQL_ROWS_PER_INSERT).min(chunk_end);
            let sql =
                format!("INSERT INTO {table} ({cols}) VALUES {}", vec![row.as_str(); (end - n) as usize].join(", "));
            let mut q = sqlx::query(&sql);
            for i in n..end {
                let id = mysql_fill_id(template, from, m, i - from);
                q = q
                    .bind(id.as_bytes().to_vec())
                    .bind(b"scale-fill".as_slice())
                    .bind(b"POST /x".as_slice())
                    .bind(format!("fill-{i}").into_bytes())
                    .bind(template.fingerprint.as_bytes().as_slice())
                    .bind("completed")
                    .bind(token)
                    .bind(response.as_slice())
                    .bind(template.created_at.0)
                    .bind(template.started_at.0)
                    .bind(template.lease_expires_at.0)
                    .bind(template.expires_at.0);
            }
            q.execute(&mut *tx).await?;
            n = end;
        }
        tx.commit().await?;
    }
    sqlx::raw_sql(&format!("ANALYZE TABLE {table}")).execute(&mut *conn).await?;
    Ok(())
}

fn fill_redb(db: &redb::Database, template: &Record, from: u64, to: u64) -> Result<(), BoxError> {
    let mut n = from;
    while n < to {
        let end = (n + CHUNK).min(to);
        let txn = db.begin_write()?;
        {
            let mut records = txn.open_table(idem_redb::table::RECORDS)?;
            let mut expiry = txn.open_table(idem_redb::table::EXPIRY)?;
            for i in n..end {
                let r = filler(template, i);
                records.insert(r.id.as_bytes(), idem_core::codec::encode(&r).as_slice())?;
                expiry.insert((r.expires_at.0, *r.id.as_bytes()), ())?;
            }
        }
        txn.commit()?;
        n = end;
    }
    Ok(())
}

fn fill_sqlite(path: &std::path::Path, template: &Record, from: u64, to: u64) -> Result<(), BoxError> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    let response = idem_core::codec::encode_response(template.response.as_ref().ok_or("no response")?);
    let mut n = from;
    while n < to {
        let end = (n + CHUNK).min(to);
        let tx = conn.unchecked_transaction()?;
        {
            let mut insert = tx.prepare_cached(
                "INSERT INTO idem_records (id, principal, endpoint, key, fingerprint, state, token, created_at, \
                 started_at, lease_expires_at, expires_at, response) VALUES (?1, ?2, ?3, ?4, ?5, 'completed', ?6, ?7, \
                 ?7, ?7, ?8, ?9)",
            )?;
            for i in n..end {
                let r = filler(template, i);
                insert.execute(rusqlite::params![
                    r.id.as_bytes().as_slice(),
                    "scale-fill",
                    "POST /x",
                    format!("fill-{i}"),
                    r.fingerprint.as_bytes().as_slice(),
                    r.token.0 as i64,
                    r.created_at.0,
                    r.expires_at.0,
                    response.as_slice(),
                ])?;
            }
        }
        tx.commit()?;
        n = end;
    }
    Ok(())
}

async fn fill_postgres(
    store: &idem_postgres::PostgresStore,
    schema: &str,
    template: &Record,
    from: u64,
    to: u64,
) -> Result<(), BoxError> {
    use idem_postgres::sqlx;
    let response = idem_core::codec::encode_response(template.response.as_ref().ok_or("no response")?);
    let sql = format!(
        "INSERT INTO {schema}.records (id, principal, endpoint, key, fingerprint, state, token, response, created_at, \
         started_at, lease_expires_at, expires_at, claim_txid) \
         SELECT decode(md5('scale-' || i) || md5('fill-' || i), 'hex'), 'scale-fill'::bytea, 'POST /x'::bytea, \
         'fill-' || i, $1, 'completed', $2, $3, $4, $4, $4, $5, 0 FROM generate_series($6::bigint, $7::bigint) AS i"
    );
    let mut n = from;
    while n < to {
        let end = (n + 10 * CHUNK).min(to);
        let (first, last) = (n as i64, end as i64 - 1);
        sqlx::query(&sql)
            .bind(template.fingerprint.as_bytes().as_slice())
            .bind(template.token.0 as i64)
            .bind(response.as_slice())
            .bind(template.created_at.0)
            .bind(template.expires_at.0)
            .bind(first)
            .bind(last)
            .execute(store.pool())
            .await?;
        n = end;
    }
    sqlx::raw_sql(&format!("ANALYZE {schema}.records")).execute(store.pool()).await?;
    Ok(())
}

/// Runs the sizes and prints a row per size.
pub(crate) async fn run(args: ScaleArgs) -> Result<(), BoxError> {
    if args.interleave {
        return run_mysql_interleaved(args).await;
    }
    let run = crate::run_id();
    let dir = crate::bench_dir()?;
    let work = Arc::new(Workload::new(&run, 256));
    let template = template(&work);
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    let schema = format!("idem_scale_{run}").replace('-', "_");
    let mut my = None;
    let (store, redb_db, sqlite_path, pg): (Arc<dyn Store>, _, _, _) = match args.backend {
        ScaleBackend::Redb => {
            let store = idem_redb::RedbStore::open(dir.path().join("scale.redb"), idem_redb::Config::default())?;
            let db = store.database()?;
            (Arc::new(store), Some(db), None, None)
        }
        ScaleBackend::Sqlite => {
            let path = dir.path().join("scale.sqlite3");
            let open = path.clone();
            let store = tokio::task::spawn_blocking(move || {
                idem_sqlite::SqliteStore::open(open, idem_sqlite::Config::default())
            })
            .await??;
            (Arc::new(store), None, Some(path), None)
        }
        ScaleBackend::Postgres => {
            let config = idem_postgres::Config::default()
                .with_schema(schema.clone())
                .with_max_connections(args.endpoints.pg_pool);
            let store = idem_postgres::PostgresStore::connect(&args.endpoints.postgres_url, config).await?;
            (Arc::new(store.clone()), None, None, Some(store))
        }
        ScaleBackend::Mysql => {
            // Tables of their own (`<schema>_records`, ...), dropped after the run.
            let config = idem_mysql::Config::default()
                .with_table_prefix(schema.clone())
                .with_max_connections(args.endpoints.mysql_pool);
            let store = idem_mysql::MySqlStore::connect(&args.endpoints.mysql_url, config).await?;
            my = Some(store.clone());
            (Arc::new(store), None, None, None)
        }
    };
    let cycle = {
        let (store, work) = (Arc::clone(&store), Arc::clone(&work));
        Arc::new(move |i: u64| {
            let (store, work) = (Arc::clone(&store), Arc::clone(&work));
            async move {
                let ClaimOutcome::Claimed(r) = store.claim(work.request("lib", i)).await? else {
                    return Err::<(), BoxError>("fresh key not claimed".into());
                };
                store.complete(r.id, r.token, work.response()).await?;
                Ok(())
            }
        })
    };
    println!(
        "{:<9} {:>12} {:>8} {:>10} {:>9} {:>9} {:>11} {:>9}",
        "backend", "live", "cycles", "cycles/s", "p50 ms", "p99 ms", "p50 / first", "fill s"
    );
    let (mut filled, mut next, mut first_p50) = (0u64, 0u64, None);
    let backend = match args.backend {
        ScaleBackend::Redb => "redb",
        ScaleBackend::Sqlite => "sqlite",
        ScaleBackend::Postgres => "postgres",
        ScaleBackend::Mysql => "mysql",
    };
    let result = async {
        for &size in &sizes {
            let started = Instant::now();
            // Live records so far: the fill plus the cycles measured at smaller sizes.
            let target = size.saturating_sub(next);
            if target > filled {
                match (&redb_db, &sqlite_path, &pg) {
                    _ if my.is_some() => {
                        let store = my.as_ref().expect("checked");
                        fill_mysql(store, &schema, &template, filled, target).await?;
                    }
                    (Some(db), _, _) => {
                        let (db, t) = (Arc::clone(db), template.clone());
                        tokio::task::spawn_blocking(move || fill_redb(&db, &t, filled, target)).await??;
                    }
                    (_, Some(path), _) => {
                        let (path, t) = (path.clone(), template.clone());
                        tokio::task::spawn_blocking(move || fill_sqlite(&path, &t, filled, target)).await??;
                    }
                    (_, _, Some(store)) => fill_postgres(store, &schema, &template, filled, target).await?,
                    _ => unreachable!("one backend"),
                }
                filled = target;
            }
            let fill_s = started.elapsed().as_secs_f64();
            // A short warm-up on the grown table, then the measured cycles.
            drive(Arc::clone(&cycle), args.concurrency, next, 200).await?;
            next += 200;
            let before = match &my {
                Some(store) => Some(InnoDb::read(store.pool()).await?),
                None => None,
            };
            let summary = drive(Arc::clone(&cycle), args.concurrency, next, args.count).await?;
            next += args.count;
            let innodb = match (&my, before) {
                (Some(store), Some(before)) => {
                    Some(InnoDb::read(store.pool()).await?.since(before, summary.cycles, store, &schema).await?)
                }
                _ => None,
            };
            let p50 = summary.quantile_ms(0.5);
            let first = *first_p50.get_or_insert(p50);
            println!(
                "{:<9} {:>12} {:>8} {:>10.0} {:>9.3} {:>9.3} {:>10.2}x {:>9.1}",
                backend,
                filled + next,
                summary.cycles,
                summary.rate(),
                p50,
                summary.quantile_ms(0.99),
                p50 / first,
                fill_s
            );
            if let Some(line) = innodb {
                println!("          {line}");
            }
        }
        Ok::<(), BoxError>(())
    }
    .await;
    if let Some(store) = &pg {
        let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
        idem_postgres::sqlx::raw_sql(&drop).execute(store.pool()).await?;
    }
    if let Some(store) = &my {
        let drop = format!("DROP TABLE IF EXISTS `{schema}_journal`, `{schema}_records`, `{schema}_schema_migrations`");
        idem_mysql::sqlx::raw_sql(&drop).execute(store.pool()).await?;
    }
    result?;
    println!("(one cycle = claim + complete of a fresh key; live = completed, unexpired records in the store)");
    Ok(())
}

/// InnoDB's counters (`SHOW GLOBAL STATUS`), read around the measured cycles of a MySQL
/// size: what one cycle costs the server in page reads from disk, pages written and
/// fsyncs. Global, so anything else the server runs meanwhile is counted too.
#[derive(Clone, Copy, Debug, Default)]
struct InnoDb {
    /// `Innodb_buffer_pool_read_requests`: page reads (logical).
    page_reads: u64,
    /// `Innodb_buffer_pool_reads`: page reads the buffer pool missed (from disk).
    disk_reads: u64,
    /// `Innodb_buffer_pool_pages_flushed`: pages written back.
    pages_flushed: u64,
    /// `Innodb_data_fsyncs`.
    fsyncs: u64,
}

impl InnoDb {
    async fn read(pool: &idem_mysql::sqlx::MySqlPool) -> Result<Self, BoxError> {
        use idem_mysql::sqlx::{self, Row as _};
        let rows = sqlx::raw_sql(
            "SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_buffer_pool_read_requests', \
             'Innodb_buffer_pool_reads', 'Innodb_buffer_pool_pages_flushed', 'Innodb_data_fsyncs')",
        )
        .fetch_all(pool)
        .await?;
        let mut out = Self::default();
        for row in rows {
            let (name, value): (String, String) = (row.try_get(0)?, row.try_get(1)?);
            let value: u64 = value.parse()?;
            match name.to_ascii_lowercase().as_str() {
                "innodb_buffer_pool_read_requests" => out.page_reads = value,
                "innodb_buffer_pool_reads" => out.disk_reads = value,
                "innodb_buffer_pool_pages_flushed" => out.pages_flushed = value,
                "innodb_data_fsyncs" => out.fsyncs = value,
                _ => {}
            }
        }
        Ok(out)
    }

    /// The counters per cycle since `before`, with the records table's size and the
    /// buffer pool's.
    async fn since(
        self,
        before: Self,
        cycles: u64,
        store: &idem_mysql::MySqlStore,
        prefix: &str,
    ) -> Result<String, BoxError> {
        let c = cycles.max(1) as f64;
        let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / c;
        let table: i64 = idem_mysql::sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(data_length + index_length), 0) AS SIGNED) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(format!("{prefix}_records"))
        .fetch_one(store.pool())
        .await?;
        let pool: i64 = idem_mysql::sqlx::query_scalar("SELECT CAST(@@innodb_buffer_pool_size AS SIGNED)")
            .fetch_one(store.pool())
            .await?;
        Ok(format!(
            "per cycle: {:.1} page reads, {:.2} from disk, {:.2} pages flushed, {:.2} fsyncs; table {} MiB, buffer pool {} MiB",
            per(self.page_reads, before.page_reads),
            per(self.disk_reads, before.disk_reads),
            per(self.pages_flushed, before.pages_flushed),
            per(self.fsyncs, before.fsyncs),
            table >> 20,
            pool >> 20
        ))
    }
}

/// `--interleave` (MySQL only): a store per size on tables of its own, each filled to its
/// size, then `--count` cycles per size measured in `--rounds` alternating slices; the
/// tables are dropped at the end.
async fn run_mysql_interleaved(args: ScaleArgs) -> Result<(), BoxError> {
    if args.backend != ScaleBackend::Mysql {
        return Err("--interleave goes with --backend mysql".into());
    }
    let run = crate::run_id();
    let work = Arc::new(Workload::new(&run, 256));
    let template = template(&work);
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let mut stores = Vec::new();
    let result = async {
        for (n, &size) in sizes.iter().enumerate() {
            let prefix = format!("idem_scale_{run}_{n}");
            let config = idem_mysql::Config::default()
                .with_table_prefix(prefix.clone())
                .with_max_connections(args.endpoints.mysql_pool);
            let store = idem_mysql::MySqlStore::connect(&args.endpoints.mysql_url, config).await?;
            stores.push((store.clone(), prefix.clone()));
            let started = Instant::now();
            fill_mysql(&store, &prefix, &template, 0, size).await?;
            println!("filled {size} records into `{prefix}_records` in {:.1} s", started.elapsed().as_secs_f64());
        }
        let cycles: Vec<_> = stores
            .iter()
            .map(|(store, _)| {
                let (store, work) = (Arc::new(store.clone()), Arc::clone(&work));
                Arc::new(move |i: u64| {
                    let (store, work) = (Arc::clone(&store), Arc::clone(&work));
                    async move {
                        let ClaimOutcome::Claimed(r) = store.claim(work.request("lib", i)).await? else {
                            return Err::<(), BoxError>("fresh key not claimed".into());
                        };
                        store.complete(r.id, r.token, work.response()).await?;
                        Ok(())
                    }
                })
            })
            .collect();
        for cycle in &cycles {
            drive(Arc::clone(cycle), args.concurrency, 0, 200).await?;
        }
        let rounds = args.rounds.max(1);
        let slice = (args.count / rounds).max(1);
        let mut sums: Vec<Summary> = vec![Summary::default(); cycles.len()];
        for r in 0..rounds {
            let first = 200 + r * slice;
            let order: Vec<usize> =
                if r % 2 == 0 { (0..cycles.len()).collect() } else { (0..cycles.len()).rev().collect() };
            for k in order {
                sums[k].merge(drive(Arc::clone(&cycles[k]), args.concurrency, first, slice).await?);
            }
        }
        println!(
            "{:<9} {:>12} {:>8} {:>10} {:>9} {:>9} {:>11}",
            "backend", "live", "cycles", "cycles/s", "p50 ms", "p99 ms", "p50 / first"
        );
        let first = sums[0].quantile_ms(0.5);
        for (size, sum) in sizes.iter().zip(&sums) {
            let p50 = sum.quantile_ms(0.5);
            println!(
                "{:<9} {:>12} {:>8} {:>10.0} {:>9.3} {:>9.3} {:>10.2}x",
                "mysql",
                size + 200 + sum.cycles,
                sum.cycles,
                sum.rate(),
                p50,
                sum.quantile_ms(0.99),
                p50 / first
            );
        }
        Ok::<(), BoxError>(())
    }
    .await;
    for (store, prefix) in &stores {
        let drop = format!("DROP TABLE IF EXISTS `{prefix}_journal`, `{prefix}_records`, `{prefix}_schema_migrations`");
        idem_mysql::sqlx::raw_sql(&drop).execute(store.pool()).await?;
    }
    result?;
    println!(
        "(one cycle = claim + complete of a fresh key; sizes measured in {} alternating slices each; live = at the end)",
        args.rounds.max(1)
    );
    Ok(())
}
