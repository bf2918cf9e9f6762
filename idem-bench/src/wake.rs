//! `idem-bench wake`: how long after the first attempt's completion a duplicate waiting for
//! it (`IdempotencyLayer::with_in_flight_wait`) has its replay, polling against waking.
//!
//! One store of the backend; two layers on it, each through a probe that notes when the
//! first attempt's `complete` returned, one of them hiding the store's wake-ups
//! (`Store::settlements` is `None`: its waiters poll, as before the feature). Each round
//! sends a first request whose handler holds until released, then `--waiters` duplicates
//! of it, which wait; after a hold of 200 to 700 ms (an LCG, so the completion lands at a
//! different point of the polling schedule each round) the handler is released, and each
//! duplicate's latency is the time from the completion's return to its answer (zero when
//! it was woken before the completing request heard back). Rounds alternate between the
//! sides (polling, waking, waking, polling, ...); the row reports p50 and p99 of each.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::post;
use idem_conformance::{Forward, Forwarding};
use idem_core::{
    BoxError, FencingToken, MemoryStore, Receipt, RecordId, Settlements, Store, StoreError, StoredResponse,
};
use idem_http::{IdempotencyLayer, Policy};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::ServiceExt;

use crate::{Backend, Endpoints};

/// Settings of one `wake` row.
#[derive(Debug, clap::Args)]
pub(crate) struct WakeArgs {
    /// The store (mysql has no wake-ups: its waiters always poll).
    #[arg(long, value_enum, default_value = "memory")]
    backend: Backend,
    /// Duplicates waiting in each round.
    #[arg(long, default_value_t = 8)]
    waiters: usize,
    /// Rounds per side, interleaved.
    #[arg(long, default_value_t = 30)]
    rounds: usize,
    #[command(flatten)]
    endpoints: Endpoints,
}

/// The store as one side sees it: wake-ups shown or hidden, and when the last `complete`
/// returned.
#[derive(Debug)]
struct Probe {
    inner: Arc<dyn Store>,
    wakes: bool,
    completed: Mutex<Option<Instant>>,
}

#[async_trait]
impl Forward for Probe {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    async fn complete(&self, id: RecordId, token: FencingToken, r: StoredResponse) -> Result<Receipt, StoreError> {
        let out = self.inner.complete(id, token, r).await;
        *self.completed.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        out
    }

    fn settlements(&self) -> Option<&Settlements> {
        if self.wakes { self.inner.settlements() } else { None }
    }
}

/// One side: its probe, the handler's gate (started, released) and its app.
struct Side {
    probe: Arc<Forwarding<Probe>>,
    started: Arc<Semaphore>,
    release: Arc<Semaphore>,
    app: Router,
}

impl Side {
    fn new(store: &Arc<dyn Store>, wakes: bool) -> Self {
        let probe = Arc::new(Forwarding(Probe { inner: Arc::clone(store), wakes, completed: Mutex::new(None) }));
        let (started, release) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        let mut policy = Policy::default();
        // Redis expires the bench's records natively within minutes.
        policy.retention = Duration::from_secs(120);
        let layer = IdempotencyLayer::new(Arc::clone(&probe) as Arc<dyn Store>)
            .with_policy(policy)
            .with_in_flight_wait(Some(Duration::from_secs(10)));
        let (s, r) = (Arc::clone(&started), Arc::clone(&release));
        let handler = move || {
            let (s, r) = (Arc::clone(&s), Arc::clone(&r));
            async move {
                s.add_permits(1);
                if let Ok(permit) = r.acquire().await {
                    permit.forget();
                }
                (StatusCode::CREATED, [("location", "/v1/workers/7")], "{\"id\":7}")
            }
        };
        let app = Router::new().route("/v1/workers", post(handler)).layer(layer).with_state(());
        Self { probe, started, release, app }
    }

    /// One round on `key`: the latency of each duplicate after the completion.
    async fn round(&self, key: &str, waiters: usize, hold: Duration, out: &mut Vec<Duration>) -> Result<(), BoxError> {
        let first = tokio::spawn(send(self.app.clone(), key.to_owned()));
        self.started.acquire().await?.forget();
        let duplicates: Vec<_> = (0..waiters)
            .map(|_| {
                let (app, key) = (self.app.clone(), key.to_owned());
                tokio::spawn(async move {
                    let replayed = send(app, key).await?;
                    Ok::<_, BoxError>((replayed, Instant::now()))
                })
            })
            .collect();
        tokio::time::sleep(hold).await;
        self.release.add_permits(1);
        if first.await?? {
            return Err("the first request was answered as a replay".into());
        }
        let done = self.probe.completed.lock().unwrap_or_else(PoisonError::into_inner).take();
        let done = done.ok_or("the first request completed nothing")?;
        for duplicate in duplicates {
            let (replayed, at) = duplicate.await??;
            if !replayed {
                return Err("a duplicate was not answered with the replay".into());
            }
            out.push(at.saturating_duration_since(done));
        }
        Ok(())
    }
}

/// Sends the bench's request with `key`; whether it was answered as a replay.
async fn send(app: Router, key: String) -> Result<bool, BoxError> {
    let req = axum::http::Request::post("/v1/workers")
        .header("authorization", "Bearer bench-token")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(r#"{"gpus":8}"#))?;
    let res = app.oneshot(req).await?;
    if res.status() != StatusCode::CREATED {
        return Err(format!("answered {}", res.status()).into());
    }
    let replayed = res.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let _ = http_body_util::BodyExt::collect(res.into_body()).await?;
    Ok(replayed)
}

/// The `q` quantile of sorted `xs`, ms.
fn quantile_ms(xs: &[Duration], q: f64) -> f64 {
    let i = ((xs.len() as f64 * q) as usize).min(xs.len() - 1);
    xs[i].as_secs_f64() * 1_000.0
}

/// Runs one row and prints it.
pub(crate) async fn run(args: WakeArgs) -> Result<(), BoxError> {
    let run = crate::run_id();
    let dir = crate::bench_dir()?;
    let mut schema = None;
    let store: Arc<dyn Store> = match args.backend {
        Backend::Memory => Arc::new(MemoryStore::new()),
        Backend::Redb => {
            Arc::new(idem_redb::RedbStore::open(dir.path().join("wake.redb"), idem_redb::Config::default())?)
        }
        Backend::Sqlite => {
            let path = dir.path().join("wake.sqlite3");
            let open = move || idem_sqlite::SqliteStore::open(path, idem_sqlite::Config::default());
            Arc::new(tokio::task::spawn_blocking(open).await??)
        }
        Backend::Redis => {
            let config = idem_redis::Config::default().with_prefix(format!("idem-bench:{run}:wake:"));
            Arc::new(idem_redis::RedisStore::connect(&args.endpoints.redis_url, config).await?)
        }
        Backend::Postgres => {
            let name = format!("idem_bench_wake_{run}");
            let config = idem_postgres::Config::default()
                .with_schema(&name)
                .with_max_connections(args.endpoints.pg_pool)
                .with_listen(true);
            schema = Some(name);
            Arc::new(idem_postgres::PostgresStore::connect(&args.endpoints.postgres_url, config).await?)
        }
        Backend::Mysql => {
            let config = idem_mysql::Config::default().with_table_prefix(format!("{}_{run}", crate::MYSQL_PREFIX));
            Arc::new(idem_mysql::MySqlStore::connect(&args.endpoints.mysql_url, config).await?)
        }
    };
    let (polling, waking) = (Side::new(&store, false), Side::new(&store, true));
    let (mut p, mut w) = (Vec::new(), Vec::new());
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for r in 0..args.rounds.max(1) * 2 {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let hold = Duration::from_millis(200 + (x >> 33) % 500);
        let key = format!("{run}-{r}");
        if matches!(r % 4, 1 | 2) {
            waking.round(&key, args.waiters, hold, &mut w).await?;
        } else {
            polling.round(&key, args.waiters, hold, &mut p).await?;
        }
    }
    p.sort();
    w.sort();
    let woken = if store.settlements().is_some() { "yes" } else { "no (polls)" };
    println!(
        "{:<9} {:>7} {:>11} {:>11} {:>11} {:>11}  wake-ups",
        "store", "waiters", "poll p50", "poll p99", "wake p50", "wake p99"
    );
    println!(
        "{:<9} {:>7} {:>8.2} ms {:>8.2} ms {:>8.2} ms {:>8.2} ms  {woken}",
        args.backend.name(),
        args.waiters,
        quantile_ms(&p, 0.5),
        quantile_ms(&p, 0.99),
        quantile_ms(&w, 0.5),
        quantile_ms(&w, 0.99),
    );
    println!(
        "({} rounds per side, interleaved, {} duplicates each; from the completion's return to each duplicate's answer)",
        args.rounds.max(1),
        args.waiters
    );
    drop((polling, waking, store));
    if let Some(schema) = schema {
        let pool = idem_postgres::sqlx::PgPool::connect(&args.endpoints.postgres_url).await?;
        idem_postgres::sqlx::raw_sql(&format!("DROP SCHEMA \"{schema}\" CASCADE")).execute(&pool).await?;
    }
    Ok(())
}
