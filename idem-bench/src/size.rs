//! `idem-bench size`: bytes per record, per backend, for three shapes of record: in flight
//! (a claim), completed with a 1 KiB body, completed with a 100 KiB body. Bodies are
//! pseudo-random bytes so compression does not flatter them.
//!
//! - redb: growth of the file's length, divided by the records written.
//! - SQLite: growth of `page_count * page_size` seen by a fresh connection (WAL included).
//! - Redis: mean `MEMORY USAGE key SAMPLES 0` over the records' keys.
//! - Postgres: growth of `pg_total_relation_size` (heap, TOAST, indices) of a fresh table,
//!   after `VACUUM`; a completion is an `UPDATE`, so this includes the claim's dead tuple
//!   where the page could not reuse it.

use std::sync::Arc;

use idem_core::{BoxError, ClaimOutcome, Store, StoredResponse};
use idem_postgres::PostgresStore;
use idem_redb::RedbStore;
use idem_redis::RedisStore;

use crate::workload::{Workload, drive, pseudo_random_bytes};
use crate::{Backend, Endpoints};

/// Settings of one `size` row.
#[derive(Debug, clap::Args)]
pub(crate) struct SizeArgs {
    /// The backend (redb, sqlite, redis or postgres).
    #[arg(long, value_enum)]
    backend: Backend,
    /// Records written for the in-flight and 1 KiB shapes (a tenth of it, at least 20,
    /// for the 100 KiB shape).
    #[arg(long, default_value_t = 2000)]
    records: u64,
    #[command(flatten)]
    endpoints: Endpoints,
}

#[derive(Clone, Copy, Debug)]
enum Shape {
    InFlight,
    Body(usize),
}

impl Shape {
    fn name(self) -> String {
        match self {
            Shape::InFlight => "in-flight".into(),
            Shape::Body(n) => format!("completed, {} KiB body", n / 1024),
        }
    }
}

/// Writes `n` records of `shape` into `store` from 32 callers; returns their record ids.
async fn fill(
    store: Arc<dyn Store>,
    work: Arc<Workload>,
    shape: Shape,
    n: u64,
) -> Result<Vec<idem_core::RecordId>, BoxError> {
    let body = match shape {
        Shape::InFlight => None,
        Shape::Body(len) => Some(StoredResponse::new(
            201,
            vec![("content-type".into(), b"application/octet-stream".to_vec())],
            pseudo_random_bytes(len, 11),
        )),
    };
    let body = Arc::new(body);
    let ids: Vec<_> = (0..n).map(|i| work.request("size", i).id()).collect();
    let cycle = Arc::new(move |i: u64| {
        let (store, work, body) = (Arc::clone(&store), Arc::clone(&work), Arc::clone(&body));
        async move {
            let ClaimOutcome::Claimed(r) = store.claim(work.request("size", i)).await? else {
                return Err::<(), BoxError>("fresh key not claimed".into());
            };
            if let Some(resp) = &*body {
                store.complete(r.id, r.token, resp.clone()).await?;
            }
            Ok(())
        }
    });
    drive(cycle, 32, 0, n).await?;
    Ok(ids)
}

fn sqlite_bytes(path: &std::path::Path) -> Result<u64, BoxError> {
    let conn = rusqlite::Connection::open(path)?;
    let pages: i64 = conn.pragma_query_value(None, "page_count", |r| r.get(0))?;
    let size: i64 = conn.pragma_query_value(None, "page_size", |r| r.get(0))?;
    Ok(u64::try_from(pages * size)?)
}

/// Runs the three shapes for one backend and prints a row each.
pub(crate) async fn run(args: SizeArgs) -> Result<(), BoxError> {
    println!("{:<9} {:<26} {:>8} {:>14}  method", "backend", "record", "records", "bytes/record");
    for shape in [Shape::InFlight, Shape::Body(1024), Shape::Body(100 * 1024)] {
        let n = match shape {
            Shape::Body(len) if len > 10_000 => (args.records / 10).max(20),
            _ => args.records,
        };
        let run = crate::run_id();
        let work = Arc::new(Workload::new(&run, 0));
        let dir = crate::bench_dir()?;
        let (bytes, method) = match args.backend {
            Backend::Memory | Backend::Mysql => {
                return Err("size is measured for redb, sqlite, redis and postgres".into());
            }
            Backend::Redb => {
                let path = dir.path().join("size.redb");
                let store = RedbStore::open(&path, idem_redb::Config::default())?;
                let before = std::fs::metadata(&path)?.len();
                fill(Arc::new(store.clone()), work, shape, n).await?;
                drop(store);
                let after = std::fs::metadata(&path)?.len();
                (after.saturating_sub(before) as f64 / n as f64, "file length growth")
            }
            Backend::Sqlite => {
                let path = dir.path().join("size.sqlite3");
                let p = path.clone();
                let store = tokio::task::spawn_blocking(move || {
                    idem_sqlite::SqliteStore::open(p, idem_sqlite::Config::default())
                })
                .await??;
                let before = sqlite_bytes(&path)?;
                fill(Arc::new(store.clone()), work, shape, n).await?;
                let after = sqlite_bytes(&path)?;
                (after.saturating_sub(before) as f64 / n as f64, "page_count * page_size growth")
            }
            Backend::Redis => {
                let config = idem_redis::Config::default().with_prefix(format!("idem-bench:{run}:size:"));
                let store = RedisStore::connect(&args.endpoints.redis_url, config).await?;
                let ids = fill(Arc::new(store.clone()), work, shape, n).await?;
                let mut conn = store.connection();
                let mut total = 0u64;
                for id in &ids {
                    let used: Option<u64> = redis::cmd("MEMORY")
                        .arg("USAGE")
                        .arg(store.record_key(*id))
                        .arg("SAMPLES")
                        .arg(0)
                        .query_async(&mut conn)
                        .await?;
                    total += used.ok_or("record key missing")?;
                    let _: () = redis::cmd("DEL").arg(store.record_key(*id)).query_async(&mut conn).await?;
                }
                (total as f64 / n as f64, "MEMORY USAGE (mean)")
            }
            Backend::Postgres => {
                let schema = format!("idem_bench_size_{run}");
                let store = PostgresStore::connect(
                    &args.endpoints.postgres_url,
                    idem_postgres::Config::default().with_schema(schema.clone()),
                )
                .await?;
                use idem_postgres::sqlx;
                let pool = store.pool();
                let size_sql = format!("SELECT pg_total_relation_size('{schema}.records')::bigint");
                let before: i64 = sqlx::query_scalar(&size_sql).fetch_one(pool).await?;
                fill(Arc::new(store.clone()), work, shape, n).await?;
                sqlx::raw_sql(&format!("VACUUM {schema}.records")).execute(pool).await?;
                let after: i64 = sqlx::query_scalar(&size_sql).fetch_one(pool).await?;
                sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE")).execute(pool).await?;
                ((after - before).max(0) as f64 / n as f64, "pg_total_relation_size growth")
            }
        };
        println!("{:<9} {:<26} {:>8} {:>14.0}  {method}", args.backend.name(), shape.name(), n, bytes);
    }
    Ok(())
}
