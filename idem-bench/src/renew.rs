//! `idem-bench renew`: what lease renewal costs a store. N concurrent long handlers behind
//! `idem_http::IdempotencyLayer` (its default renewal, every lease / 3), each holding its
//! claim for a fixed time, on one backend.
//!
//! The requests go through the real layer (`tower::ServiceExt::oneshot`, no sockets), so
//! the renewals are the layer's own: the same schedule, timeouts and retries as in a
//! server. A metering wrapper around the store counts every call the layer makes and
//! checks each renewal against the lease it renews.
//!
//! The handlers start spread evenly over one renewal interval, as handlers of a busy
//! server do, so their renewals do not all fall on the same instant. The sustained rate is
//! measured while all N hold their claims: from the last claim to the first completion.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::Extension;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idem_core::{
    BoxError, Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, MemoryStore, Policy,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};
use idem_http::{BearerToken, IdempotencyContext, IdempotencyLayer, LeaseRenewal};
use idem_postgres::PostgresStore;
use idem_redb::RedbStore;
use idem_redis::RedisStore;
use tower::ServiceExt as _;

use crate::workload::RETENTION;
use crate::{Backend, Endpoints};

/// Settings of one `renew` row.
#[derive(Debug, clap::Args)]
pub(crate) struct RenewArgs {
    /// The backend.
    #[arg(long, value_enum)]
    backend: Backend,
    /// Concurrent long handlers, each under its own claim.
    #[arg(long, default_value_t = 1000)]
    handlers: u64,
    /// Lease TTL, ms. The layer renews every lease / 3 (its default).
    #[arg(long, default_value_t = 2_000)]
    lease_ms: u64,
    /// How long each handler runs, ms (at least 3 renewal intervals, so that all handlers
    /// hold their claims at once for a while).
    #[arg(long, default_value_t = 20_000)]
    hold_ms: u64,
    /// Append the row to this CSV file (with the 1-minute load average at its end).
    #[arg(long)]
    csv: Option<PathBuf>,
    #[command(flatten)]
    endpoints: Endpoints,
}

/// Latencies of one kind of store call.
#[derive(Debug, Default)]
struct Latencies(Mutex<Vec<Duration>>);

impl Latencies {
    fn push(&self, d: Duration) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(d);
    }

    /// The `q` quantile (0..=1), ms; 0 when nothing was recorded.
    fn quantile_ms(&self, q: f64) -> f64 {
        let mut v = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if v.is_empty() {
            return 0.0;
        }
        v.sort_unstable();
        let idx = ((v.len() as f64 - 1.0) * q).round() as usize;
        v[idx.min(v.len() - 1)].as_secs_f64() * 1e3
    }
}

/// The store under test, counting the calls the layer makes and checking every renewal
/// against the lease it renews (on the store's own clock).
#[derive(Debug)]
struct Metered {
    inner: Arc<dyn Store>,
    lease_ttl_ms: i64,
    claims: AtomicU64,
    completes: AtomicU64,
    /// `fail` and `reclaim` calls: none in a healthy run.
    others: AtomicU64,
    renewals: AtomicU64,
    /// Renewals the store refused or failed.
    renewal_errors: AtomicU64,
    /// Renewals the layer gave up waiting for (its timeout: the lease would have run out
    /// first) and dropped before the store answered.
    abandoned: AtomicU64,
    /// Records whose handler has returned: a renewal of theirs still in flight is dropped
    /// because the handler ended, not because it timed out.
    finished: Mutex<HashSet<RecordId>>,
    /// Renewals the store applied after the lease they renew had already run out.
    late: AtomicU64,
    /// Smallest lease left when a renewal reached the store, ms (negative: late).
    least_left_ms: AtomicI64,
    /// Lease end per record as of its claim or last renewal.
    lease_ends: Mutex<HashMap<RecordId, UnixMillis>>,
    claim_latency: Latencies,
    complete_latency: Latencies,
    renewal_latency: Latencies,
}

impl Metered {
    fn new(inner: Arc<dyn Store>, lease_ttl: Duration) -> Self {
        Self {
            inner,
            lease_ttl_ms: i64::try_from(lease_ttl.as_millis()).unwrap_or(i64::MAX),
            claims: AtomicU64::new(0),
            completes: AtomicU64::new(0),
            others: AtomicU64::new(0),
            renewals: AtomicU64::new(0),
            renewal_errors: AtomicU64::new(0),
            abandoned: AtomicU64::new(0),
            finished: Mutex::new(HashSet::new()),
            late: AtomicU64::new(0),
            least_left_ms: AtomicI64::new(i64::MAX),
            lease_ends: Mutex::new(HashMap::new()),
            claim_latency: Latencies::default(),
            complete_latency: Latencies::default(),
            renewal_latency: Latencies::default(),
        }
    }

    fn lease_ends(&self) -> std::sync::MutexGuard<'_, HashMap<RecordId, UnixMillis>> {
        self.lease_ends.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Called by the handler of record `id` as it returns.
    fn handler_returned(&self, id: RecordId) {
        self.finished.lock().unwrap_or_else(PoisonError::into_inner).insert(id);
    }

    fn has_returned(&self, id: RecordId) -> bool {
        self.finished.lock().unwrap_or_else(PoisonError::into_inner).contains(&id)
    }
}

/// A renewal on its way to the store. If the layer drops it first while the handler still
/// runs, the layer's timeout fired: it counts as abandoned, and since the store may or may
/// not have applied it, the record's lease end is no longer known (its next renewal is not
/// judged late or on time). A renewal dropped because its handler returned is neither.
struct Pending<'a> {
    meter: &'a Metered,
    id: RecordId,
    answered: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.answered && !self.meter.has_returned(self.id) {
            self.meter.abandoned.fetch_add(1, Ordering::Relaxed);
            self.meter.lease_ends().remove(&self.id);
        }
    }
}

#[async_trait]
impl Store for Metered {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let t = Instant::now();
        let out = self.inner.claim(req).await;
        self.claim_latency.push(t.elapsed());
        if let Ok(ClaimOutcome::Claimed(record)) = &out {
            self.lease_ends().insert(record.id, record.lease_expires_at);
        }
        self.claims.fetch_add(1, Ordering::Relaxed);
        out
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.others.fetch_add(1, Ordering::Relaxed);
        self.inner.reclaim(req).await
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<idem_core::Receipt, StoreError> {
        let t = Instant::now();
        let out = self.inner.complete(id, token, response).await;
        self.complete_latency.push(t.elapsed());
        self.completes.fetch_add(1, Ordering::Relaxed);
        out
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<idem_core::Receipt, StoreError> {
        self.others.fetch_add(1, Ordering::Relaxed);
        self.inner.fail(id, token).await
    }

    async fn extend(
        &self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
    ) -> Result<idem_core::Receipt, StoreError> {
        let mut pending = Pending { meter: self, id, answered: false };
        let t = Instant::now();
        let out = self.inner.extend(id, token, lease_ttl).await;
        pending.answered = true;
        self.renewal_latency.push(t.elapsed());
        self.renewals.fetch_add(1, Ordering::Relaxed);
        match &out {
            Ok(record) => {
                // The store sets lease_expires_at = max(old, now + ttl): when the lease
                // moved, its `now` was the new end minus the TTL.
                let previous = self.lease_ends().insert(id, record.lease_expires_at);
                if let Some(previous) = previous
                    && record.lease_expires_at > previous
                {
                    let left = previous.0 - (record.lease_expires_at.0 - self.lease_ttl_ms);
                    self.least_left_ms.fetch_min(left, Ordering::Relaxed);
                    // A lease is live while now < lease_expires_at.
                    if left <= 0 {
                        self.late.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Err(_) => {
                self.renewal_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        out
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.inner.sweep(limit).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.inner.journal_put(id, token, name, value, overwrite).await
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.journal_get(id, name).await
    }

    fn settlements(&self) -> Option<&idem_core::Settlements> {
        self.inner.settlements()
    }
}

/// The long handler: holds its claim for `hold`, or stops at once if its lease is lost.
async fn long_handler(
    State((hold, meter)): State<(Duration, Arc<Metered>)>,
    Extension(ctx): Extension<IdempotencyContext>,
) -> StatusCode {
    let status = tokio::select! {
        () = tokio::time::sleep(hold) => StatusCode::OK,
        () = ctx.lease_lost() => StatusCode::CONFLICT,
    };
    meter.handler_returned(ctx.record_id());
    status
}

/// Waits until `ready` holds, checking every 5 ms; returns when it turned true.
async fn when(ready: impl Fn() -> bool) -> Instant {
    while !ready() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Instant::now()
}

/// Runs one row and prints it.
pub(crate) async fn run(args: RenewArgs) -> Result<(), BoxError> {
    let run = crate::run_id();
    let dir = crate::bench_dir()?;
    let lease = Duration::from_millis(args.lease_ms);
    if lease.is_zero() {
        return Err("the lease must be longer than 0 ms".into());
    }
    // `LeaseRenewal::default()` renews every lease TTL / 3, at least every 10 ms.
    let renewal = LeaseRenewal::default();
    let interval = (lease / 3).max(LeaseRenewal::MIN_INTERVAL);
    let hold = Duration::from_millis(args.hold_ms);
    if hold < interval * 3 {
        return Err(format!("--hold-ms must be at least 3 renewal intervals ({} ms)", interval.as_millis() * 3).into());
    }
    let mut cleanup_pg = None;
    let inner: Arc<dyn Store> = match args.backend {
        Backend::Mysql => return Err("renew is measured for memory, redb, sqlite, redis and postgres".into()),
        Backend::Memory => Arc::new(MemoryStore::new()),
        Backend::Redb => Arc::new(RedbStore::open(dir.path().join("renew.redb"), idem_redb::Config::default())?),
        Backend::Sqlite => {
            let path = dir.path().join("renew.sqlite3");
            Arc::new(
                tokio::task::spawn_blocking(move || {
                    idem_sqlite::SqliteStore::open(path, idem_sqlite::Config::default())
                })
                .await??,
            )
        }
        Backend::Redis => {
            let config = idem_redis::Config::default().with_prefix(format!("idem-bench:{run}:renew:"));
            Arc::new(RedisStore::connect(&args.endpoints.redis_url, config).await?)
        }
        Backend::Postgres => {
            let config = idem_postgres::Config::default()
                .with_schema(crate::PG_SCHEMA)
                .with_max_connections(args.endpoints.pg_pool);
            let store = PostgresStore::connect(&args.endpoints.postgres_url, config).await?;
            cleanup_pg = Some(store.clone());
            Arc::new(store)
        }
    };
    let store = Arc::new(Metered::new(inner, lease));
    let mut policy = Policy::default();
    (policy.lease_ttl, policy.retention) = (lease, RETENTION);
    let app = Router::new()
        .route("/v1/workers/{id}/firmware", post(long_handler))
        .route_layer(
            IdempotencyLayer::new(Arc::clone(&store) as Arc<dyn Store>).with_policy(policy).with_lease_renewal(renewal),
        )
        .with_state((hold, Arc::clone(&store)));
    let token = format!("bench-{run}");

    let started = Instant::now();
    let handlers: Vec<_> = (0..args.handlers)
        .map(|i| {
            let (app, token) = (app.clone(), token.clone());
            // Starts spread evenly over one renewal interval.
            let start = started + interval.mul_f64(i as f64 / args.handlers as f64);
            tokio::spawn(async move {
                tokio::time::sleep_until(start.into()).await;
                let req = Request::post(format!("/v1/workers/w-{i}/firmware"))
                    .header("authorization", format!("Bearer {token}"))
                    .header("idempotency-key", format!("renew-{i}"))
                    .header("content-type", "application/json")
                    .body(Body::from(r#"{"image":"bmc-firmware","version":"2.4.1"}"#))?;
                let response = app.oneshot(req).await?;
                Ok::<_, BoxError>(response.status())
            })
        })
        .collect();

    // The window in which every handler holds its claim: from the last claim to the
    // first completion.
    let all_claimed = {
        let store = Arc::clone(&store);
        when(move || store.claims.load(Ordering::Relaxed) >= args.handlers).await
    };
    let renewals_at_start = store.renewals.load(Ordering::Relaxed);
    let first_done = {
        let store = Arc::clone(&store);
        when(move || store.completes.load(Ordering::Relaxed) > 0).await
    };
    let renewals_in_window = store.renewals.load(Ordering::Relaxed) - renewals_at_start;
    let window = first_done.duration_since(all_claimed).as_secs_f64();

    let mut lost = 0u64;
    for h in handlers {
        if h.await?? != StatusCode::OK {
            lost += 1;
        }
    }
    let elapsed = started.elapsed();
    if let Some(pg) = cleanup_pg {
        let sql = format!("DELETE FROM {}.records WHERE principal = $1", crate::PG_SCHEMA);
        let principal = BearerToken::principal_for(token.as_bytes());
        idem_postgres::sqlx::query(&sql).bind(principal.as_bytes()).execute(pg.pool()).await?;
    }

    let n = args.handlers;
    let (claims, completes) = (store.claims.load(Ordering::Relaxed), store.completes.load(Ordering::Relaxed));
    let renewals = store.renewals.load(Ordering::Relaxed);
    let demanded = n as f64 / interval.as_secs_f64();
    let sustained = if window > 0.0 { renewals_in_window as f64 / window } else { 0.0 };
    let late = store.late.load(Ordering::Relaxed);
    let errors = store.renewal_errors.load(Ordering::Relaxed);
    let abandoned = store.abandoned.load(Ordering::Relaxed);
    let least_left = store.least_left_ms.load(Ordering::Relaxed);
    // Every lease held: no renewal reached the store after its lease ran out, none failed
    // or timed out (after which the lease may have run out unnoticed), no handler lost it.
    let leases_held = late == 0 && errors == 0 && abandoned == 0 && lost == 0;
    // On schedule: the renewals kept their interval. Each one is scheduled an interval
    // after the previous one was sent, and the timer rounds sleeps up to the next
    // millisecond, so even a store that answers at once falls a few percent short of the
    // nominal demand at the shortest intervals; 90% leaves room for that.
    let on_schedule = sustained >= 0.9 * demanded;
    println!(
        "{:<9} {:>8} {:>8} {:>8} {:>10} {:>12} {:>9} {:>9} {:>9} {:>6} {:>6} {:>9} {:>11} {:>8} {:>10} {:>10}",
        "backend",
        "handlers",
        "lease ms",
        "every ms",
        "demand/s",
        "sustained/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "late",
        "failed",
        "timed out",
        "least left",
        "renew/h",
        "claim p50",
        "compl p50",
    );
    println!(
        "{:<9} {:>8} {:>8} {:>8} {:>10.0} {:>12.0} {:>9.3} {:>9.3} {:>9.3} {:>6} {:>6} {:>9} {:>11} {:>8.1} {:>10.3} {:>10.3}",
        args.backend.name(),
        n,
        args.lease_ms,
        interval.as_millis(),
        demanded,
        sustained,
        store.renewal_latency.quantile_ms(0.5),
        store.renewal_latency.quantile_ms(0.99),
        store.renewal_latency.quantile_ms(1.0),
        late,
        errors,
        abandoned,
        if least_left == i64::MAX { "-".to_string() } else { format!("{least_left} ms") },
        renewals as f64 / n as f64,
        store.claim_latency.quantile_ms(0.5),
        store.complete_latency.quantile_ms(0.5),
    );
    println!(
        "leases held: {}; on schedule: {}; renewals {renewals} ({:.1} per handler over {} ms) against claims \
         {claims} + completes {completes}: renewal adds {:.1}x the claim+complete writes; {} s in all, window of all \
         {n} handlers {window:.1} s",
        if leases_held { "yes" } else { "NO" },
        if on_schedule { "yes" } else { "NO" },
        renewals as f64 / n as f64,
        args.hold_ms,
        renewals as f64 / (claims + completes).max(1) as f64,
        elapsed.as_secs(),
    );
    // The machine is shared: say how busy it was.
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_default();
    println!("load average (1 min) at the end: {load}");
    if let Some(path) = args.csv {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        writeln!(
            f,
            "{},{n},{},{},{demanded:.0},{sustained:.0},{:.3},{:.3},{:.3},{late},{errors},{abandoned},{},{:.1},{:.3},{:.3},{:.2},{leases_held},{on_schedule},{load}",
            args.backend.name(),
            args.lease_ms,
            interval.as_millis(),
            store.renewal_latency.quantile_ms(0.5),
            store.renewal_latency.quantile_ms(0.99),
            store.renewal_latency.quantile_ms(1.0),
            if least_left == i64::MAX { String::new() } else { least_left.to_string() },
            renewals as f64 / n as f64,
            store.claim_latency.quantile_ms(0.5),
            store.complete_latency.quantile_ms(0.5),
            renewals as f64 / (claims + completes).max(1) as f64,
        )?;
    }
    let others = store.others.load(Ordering::Relaxed);
    if lost > 0 || others > 0 {
        println!("{lost} handlers lost their lease; {others} fail/reclaim calls");
    }
    Ok(())
}
