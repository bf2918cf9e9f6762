//! `idem-bench cache`: replays per second behind the layer with and without
//! `idem_cache::CachedStore`, on Redis or PostgreSQL.
//!
//! Two layers, each over its own store of the backend (a key prefix, a schema), one of
//! them through the cache, in front of the same handler as `idem-bench seal` (201, a
//! `Location`, `--body` bytes). A pool of keys is completed on each side during the
//! warm-up (which also brings them into the cache); every measured request then replays
//! one of them. Runs alternate between the sides (plain, cached, cached, plain, ...);
//! the row reports the median of each side and their ratio. Then a churn run sends each
//! of `--churn` fresh keys twice (the run, then its replay, which the cache keeps) into a
//! cache of `--max-bytes`, and prints what the cache holds and the process's resident
//! memory before and after.

use std::sync::Arc;
use std::time::Duration;

use idem_cache::CachedStore;
use idem_core::{BoxError, Store};
use idem_http::{IdempotencyLayer, Policy};

use crate::Endpoints;
use crate::seal::{load, median, router};

/// Settings of one `cache` row.
#[derive(Debug, clap::Args)]
pub(crate) struct CacheArgs {
    /// The store behind both layers.
    #[arg(long, value_enum, default_value = "redis")]
    backend: CacheBackend,
    /// Response body, bytes.
    #[arg(long, default_value_t = 1024)]
    body: usize,
    /// Requests per run.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Runs per side (at least 5), interleaved.
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Keys in the replay pool.
    #[arg(long, default_value_t = 1000)]
    pool: usize,
    /// The cache's bound, bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_bytes: u64,
    /// Fresh keys in the churn run.
    #[arg(long, default_value_t = 20_000)]
    churn: usize,
    #[command(flatten)]
    endpoints: Endpoints,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum CacheBackend {
    Redis,
    Postgres,
}

/// A store of the backend on storage of its own (`side` names it), and how to remove it.
async fn open(args: &CacheArgs, side: &str) -> Result<(Arc<dyn Store>, Option<String>), BoxError> {
    let run = crate::run_id();
    Ok(match args.backend {
        CacheBackend::Redis => {
            let config = idem_redis::Config::default().with_prefix(format!("idem-bench:cache:{side}:{run}:"));
            (Arc::new(idem_redis::RedisStore::connect(&args.endpoints.redis_url, config).await?), None)
        }
        CacheBackend::Postgres => {
            let schema = format!("idem_bench_cache_{side}_{run}");
            let config =
                idem_postgres::Config::default().with_schema(&schema).with_max_connections(args.endpoints.pg_pool);
            (Arc::new(idem_postgres::PostgresStore::connect(&args.endpoints.postgres_url, config).await?), Some(schema))
        }
    })
}

/// Resident set size of this process, KiB (Linux `/proc/self/statm`, 4 KiB pages).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4)
}

/// Runs one row and prints it.
pub(crate) async fn run(args: CacheArgs) -> Result<(), BoxError> {
    let body = Arc::new(vec![b'x'; args.body]);
    // Short retention: Redis expires the bench's keys natively within a minute.
    let mut policy = Policy::default();
    policy.retention = Duration::from_secs(120);
    let (plain_store, plain_schema) = open(&args, "plain").await?;
    let (cached_inner, cached_schema) = open(&args, "cached").await?;
    let cached_store = Arc::new(CachedStore::new(cached_inner, args.max_bytes));
    let plain = router(body.clone(), IdempotencyLayer::new(plain_store).with_policy(policy.clone()));
    let cached =
        router(body.clone(), IdempotencyLayer::new(cached_store.clone() as Arc<dyn Store>).with_policy(policy));
    let run = crate::run_id();
    let pool: Vec<String> = (0..args.pool).map(|i| format!("{run}-pool-{i}")).collect();
    // Warm-up: the pool completed on each side, then replayed once (into the cache).
    for app in [&plain, &cached] {
        load(app, pool.iter().cloned(), args.concurrency).await?;
        load(app, pool.iter().cloned(), args.concurrency).await?;
    }
    let runs = args.runs.max(5);
    let (mut p, mut c) = (Vec::new(), Vec::new());
    for r in 0..runs * 2 {
        let cached_turn = matches!(r % 4, 1 | 2);
        let app = if cached_turn { &cached } else { &plain };
        let pool = pool.clone();
        let rate = load(app, (0..args.requests).map(move |i| pool[i % pool.len()].clone()), args.concurrency).await?;
        if cached_turn { c.push(rate) } else { p.push(rate) }
    }
    let (pm, cm) = (median(p.clone()), median(c.clone()));
    let backend = match args.backend {
        CacheBackend::Redis => "redis",
        CacheBackend::Postgres => "postgres",
    };
    println!("{:<9} {:>6} {:>16} {:>16} {:>7}", "store", "body", "plain replays/s", "cached replays/s", "ratio");
    println!("{backend:<9} {:>6} {pm:>16.0} {cm:>16.0} {:>6.2}x", args.body, cm / pm);
    println!(
        "(median of {runs} interleaved runs per side, {} replays of {} keys each, {} in flight; runs: plain {:?}, cached {:?})",
        args.requests,
        args.pool,
        args.concurrency,
        p.iter().map(|v| v.round() as u64).collect::<Vec<_>>(),
        c.iter().map(|v| v.round() as u64).collect::<Vec<_>>(),
    );
    // Churn: every key run once and replayed once, so each enters the cache.
    let rss_before = rss_kib();
    let churn: Vec<String> = (0..args.churn).map(|i| format!("{run}-churn-{i}")).collect();
    for chunk in churn.chunks(1000) {
        load(&cached, chunk.iter().cloned(), args.concurrency).await?;
        load(&cached, chunk.iter().cloned(), args.concurrency).await?;
    }
    let (records, bytes) = cached_store.usage();
    println!(
        "churn: {} fresh keys of {} B bodies through a cache of {} B: {records} records, {bytes} B held ({:.1}% of the bound); RSS {} KiB -> {} KiB",
        args.churn,
        args.body,
        args.max_bytes,
        bytes as f64 * 100.0 / args.max_bytes as f64,
        rss_before,
        rss_kib()
    );
    for schema in [plain_schema, cached_schema].into_iter().flatten() {
        let pool = idem_postgres::sqlx::PgPool::connect(&args.endpoints.postgres_url).await?;
        idem_postgres::sqlx::raw_sql(&format!("DROP SCHEMA \"{schema}\" CASCADE")).execute(&pool).await?;
    }
    Ok(())
}
