//! The stores the lease scenarios run on, and the wrapper that keeps the test's paused
//! tokio clock still while a store works.
//!
//! Each scenario runs on a current-thread runtime with paused time: tokio's clock moves
//! only when the scenario advances it (together with the store's [`ManualClock`]), so
//! renewal timers fire at exactly the simulated moments. A paused runtime also moves its
//! clock on its own whenever it has nothing to do but wait for a timer ("auto-advance"),
//! which would let renewal timers run ahead of the store clock while a store call waits
//! for a disk or a socket. [`Frozen`] prevents that: every store call runs inside
//! `spawn_blocking` (tokio does not auto-advance while a blocking task runs), on a
//! separate real-time runtime ([`io`]) where the store's own I/O, pools and timeouts live.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, ManualClock, MemoryStore, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome,
};

use crate::common::T0;

/// The real-time runtime every store lives on, for the whole test binary (never dropped:
/// dropping a runtime inside a test's async context panics, and pools opened on it must
/// outlive every scenario that uses them).
pub(crate) fn io() -> &'static tokio::runtime::Runtime {
    static IO: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    IO.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("lease-test-io")
            .build()
            .expect("io runtime")
    })
}

/// Runs `work` on the [`io`] runtime without letting the caller's paused clock move.
pub(crate) async fn on_io<T: Send + 'static>(work: impl Future<Output = T> + Send + 'static) -> T {
    tokio::task::spawn_blocking(move || io().block_on(work)).await.expect("store work panicked")
}

/// A store the scenarios use: the backend's store behind [`Frozen`], its clock, and what
/// cleans up after it.
pub(crate) struct Backend {
    pub(crate) name: &'static str,
    pub(crate) clock: ManualClock,
    pub(crate) store: Arc<Frozen>,
    /// The backend's own store, for tests that write to it behind the `Store` trait's back.
    #[allow(dead_code, reason = "the lease scenarios go through the Store trait only")]
    pub(crate) raw: Raw,
    /// Keeps a temporary directory (or a server namespace) for as long as the store.
    _keep: Box<dyn Send + Sync>,
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend").field("name", &self.name).finish_non_exhaustive()
    }
}

impl Backend {
    fn new(name: &'static str, clock: ManualClock, raw: Raw, keep: Box<dyn Send + Sync>) -> Self {
        let store: Arc<dyn Store> = match &raw {
            Raw::Memory(s) => Arc::new(s.clone()),
            Raw::Redb(s) => Arc::new(s.clone()),
            Raw::Sqlite(s) => Arc::new(s.clone()),
            Raw::Redis(s) => Arc::new(s.clone()),
            Raw::Postgres(s, _) => Arc::new(s.clone()),
        };
        Self { name, clock, store: Arc::new(Frozen::new(store)), raw, _keep: keep }
    }

    pub(crate) fn dyn_store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }
}

/// A backend's own store type.
#[allow(dead_code, reason = "each test binary reaches into some backends only")]
pub(crate) enum Raw {
    Memory(MemoryStore),
    Redb(idem_redb::RedbStore),
    Sqlite(idem_sqlite::SqliteStore),
    Redis(idem_redis::RedisStore),
    /// The store and its schema.
    Postgres(idem_postgres::PostgresStore, String),
}

/// Opens one backend for one scenario (called on the scenario's runtime).
pub(crate) type Factory = fn() -> BoxFuture<'static, Backend>;

/// The in-process table.
pub(crate) fn memory() -> BoxFuture<'static, Backend> {
    Box::pin(async {
        let clock = ManualClock::new(T0);
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        Backend::new("memory", clock, Raw::Memory(store), Box::new(()))
    })
}

/// A redb file in a temporary directory.
pub(crate) fn redb() -> BoxFuture<'static, Backend> {
    Box::pin(async {
        let clock = ManualClock::new(T0);
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("idem.redb");
        let config = idem_redb::Config::default().with_clock(Arc::new(clock.clone()));
        let store = on_io(async move { idem_redb::RedbStore::open(path, config) }).await.expect("open redb");
        Backend::new("redb", clock, Raw::Redb(store), Box::new(dir))
    })
}

/// A SQLite file in a temporary directory.
pub(crate) fn sqlite() -> BoxFuture<'static, Backend> {
    Box::pin(async {
        let clock = ManualClock::new(T0);
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("idem.sqlite3");
        let config = idem_sqlite::Config::default().with_clock(Arc::new(clock.clone()));
        let store = on_io(async move { idem_sqlite::SqliteStore::open(path, config) }).await.expect("open sqlite");
        Backend::new("sqlite", clock, Raw::Sqlite(store), Box::new(dir))
    })
}

/// The real Redis at `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`), on a fresh key
/// prefix whose keys are deleted when the backend goes. The clock starts at the wall
/// clock, so native expiry of anything left behind still happens.
pub(crate) fn redis() -> BoxFuture<'static, Backend> {
    Box::pin(async {
        let clock = ManualClock::starting_now();
        let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let prefix = format!("idem-test:lease:{}:", uuid::Uuid::new_v4().simple());
        let config = idem_redis::Config::default()
            .with_prefix(prefix.clone())
            .with_clock(Arc::new(clock.clone()))
            // The test clock runs ahead of the server's: keys must outlive its view.
            .with_expiry_grace(Duration::from_secs(3_600));
        let u = url.clone();
        let store = on_io(async move { idem_redis::RedisStore::connect(&u, config).await })
            .await
            .unwrap_or_else(|e| panic!("Redis is not reachable at {url}: {e}; these tests need a real Redis"));
        Backend::new("redis", clock, Raw::Redis(store), Box::new(RedisPrefix { url, prefix }))
    })
}

/// Deletes every key under a test's prefix when dropped.
struct RedisPrefix {
    url: String,
    prefix: String,
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let (url, pattern) = (self.url.clone(), format!("{}*", self.prefix));
        // Drop runs on the scenario's runtime thread: do the I/O on a thread of its own.
        let done = std::thread::spawn(move || -> redis::RedisResult<()> {
            let mut conn = redis::Client::open(url.as_str())?.get_connection()?;
            let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(&mut conn)?;
            if !keys.is_empty() {
                redis::cmd("DEL").arg(keys).query::<()>(&mut conn)?;
            }
            Ok(())
        })
        .join();
        if !matches!(done, Ok(Ok(()))) {
            eprintln!("warning: could not delete the test keys {}*; native expiry removes them", self.prefix);
        }
    }
}

/// The real PostgreSQL at `IDEM_POSTGRES_URL` (default
/// `postgres://postgres@127.0.0.1:5432/test`), in a fresh `idem_test_*` schema that is
/// dropped when the backend goes.
pub(crate) fn postgres() -> BoxFuture<'static, Backend> {
    Box::pin(async {
        let clock = ManualClock::new(T0);
        let url =
            std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        let schema = format!("idem_test_{secs}_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let config = idem_postgres::Config::default()
            .with_schema(schema.clone())
            .with_clock(Arc::new(clock.clone()))
            .with_max_connections(4);
        let u = url.clone();
        let store = on_io(async move { idem_postgres::PostgresStore::connect(&u, config).await })
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL is not reachable at {url}: {e}; these tests need a real server"));
        let pool = store.pool().clone();
        let raw = Raw::Postgres(store, schema.clone());
        Backend::new("postgres", clock, raw, Box::new(PostgresSchema { pool: Some(pool), schema }))
    })
}

/// Drops a test's schema when dropped.
struct PostgresSchema {
    pool: Option<idem_postgres::sqlx::PgPool>,
    schema: String,
}

impl Drop for PostgresSchema {
    fn drop(&mut self) {
        let (Some(pool), schema) = (self.pool.take(), self.schema.clone()) else { return };
        let sql = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
        let done = std::thread::spawn(move || {
            io().block_on(async move { idem_postgres::sqlx::raw_sql(&sql).execute(&pool).await.ok().map(drop) })
        })
        .join();
        if !matches!(done, Ok(Some(()))) {
            eprintln!("warning: could not drop the test schema {}", self.schema);
        }
    }
}

/// A store whose every call runs through [`on_io`], counting calls and failing renewals
/// on demand.
pub(crate) struct Frozen {
    inner: Arc<dyn Store>,
    /// Store calls under way: the scenario waits for zero before it moves time again.
    pending: AtomicUsize,
    /// `extend` calls that reached the store.
    pub(crate) extends: AtomicUsize,
    /// The next this many `extend` calls fail with a retryable `Unavailable` (and write
    /// nothing).
    pub(crate) failing_extends: AtomicUsize,
    /// Whether the injected `extend` failures are non-retryable (a full disk) instead.
    pub(crate) failing_for_good: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for Frozen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frozen").field("inner", &self.inner).finish_non_exhaustive()
    }
}

/// Decrements the pending count when a call ends, also when its future is dropped.
struct Pending<'a>(&'a AtomicUsize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Frozen {
    fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            pending: AtomicUsize::new(0),
            extends: AtomicUsize::new(0),
            failing_extends: AtomicUsize::new(0),
            failing_for_good: false.into(),
        }
    }

    /// Store calls under way.
    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    pub(crate) fn extends(&self) -> usize {
        self.extends.load(Ordering::SeqCst)
    }

    /// Reads a record directly (for the scenario's own checks).
    pub(crate) async fn record(&self, id: RecordId) -> Option<Record> {
        self.get(id).await.expect("get")
    }

    async fn run<T, F>(&self, call: impl FnOnce(Arc<dyn Store>) -> F + Send + 'static) -> T
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let _done = Pending(&self.pending);
        let inner = Arc::clone(&self.inner);
        on_io(async move { call(inner).await }).await
    }
}

#[async_trait]
impl Store for Frozen {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.run(|s| async move { s.claim(req).await }).await
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.run(|s| async move { s.reclaim(req).await }).await
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<idem_core::Receipt, StoreError> {
        self.run(move |s| async move { s.complete(id, token, response).await }).await
    }
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<idem_core::Receipt, StoreError> {
        self.run(move |s| async move { s.fail(id, token).await }).await
    }
    async fn extend(
        &self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
    ) -> Result<idem_core::Receipt, StoreError> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        let injected = self.failing_extends.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if injected.is_ok() {
            let retryable = !self.failing_for_good.load(Ordering::SeqCst);
            return Err(StoreError::unavailable("frozen", "extend", retryable, std::io::Error::other("injected blip")));
        }
        self.run(move |s| async move { s.extend(id, token, lease_ttl).await }).await
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.run(move |s| async move { s.get(id).await }).await
    }
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.run(move |s| async move { s.sweep(limit).await }).await
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
        let name = name.to_owned();
        self.run(move |s| async move { s.journal_put(id, token, &name, value, overwrite).await }).await
    }
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let name = name.to_owned();
        self.run(move |s| async move { s.journal_get(id, &name).await }).await
    }
}
