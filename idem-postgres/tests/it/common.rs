//! Shared by the Postgres test binaries: the server URL, fresh schemas that drop
//! themselves, stores reached directly or through PgBouncer, and the one message a
//! developer without a running server sees.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::sync::{Arc, Once};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use idem_conformance::{Forward, Forwarding};
use idem_core::{ManualClock, Store};
use idem_postgres::sqlx::{self, Connection as _, PgConnection};
use idem_postgres::{Config, PostgresStore};

/// Used when `IDEM_POSTGRES_URL` is not set.
pub(crate) const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Every schema a test creates starts with this, followed by the creation time in Unix
/// seconds and a random suffix: leftovers of a crashed run are easy to find, and are
/// dropped by the next run once they are an hour old.
pub(crate) const SCHEMA_PREFIX: &str = "idem_test_";

/// The server the tests use.
pub(crate) fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// Fails the test with the one message that says how to get a server.
pub(crate) fn unreachable(err: &dyn std::error::Error) -> ! {
    let mut chain = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        chain.push_str(": ");
        chain.push_str(&c.to_string());
        cause = c.source();
    }
    panic!(
        "\n\nPostgreSQL is not reachable at {} ({chain}).\n\
         These tests need a running server; they fail rather than skip. Start it with:\n\
         \n    pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n\
         \nor point IDEM_POSTGRES_URL at another server (database must exist, trust or URL auth).\n",
        url()
    );
}

/// A connection of the test's own (for its own SQL).
pub(crate) async fn raw() -> PgConnection {
    PgConnection::connect(&url()).await.unwrap_or_else(|e| unreachable(&e))
}

/// Runs `sql` (one or more statements, simple protocol) on `conn`.
pub(crate) async fn execute(conn: &mut PgConnection, sql: &str) {
    sqlx::Executor::execute(conn, sqlx::raw_sql(sql)).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A schema that exists for as long as this guard (shared by every handle on it) lives;
/// dropping the last handle drops the schema with everything in it.
#[derive(Debug)]
pub(crate) struct SchemaGuard {
    pub(crate) name: String,
}

impl SchemaGuard {
    /// A fresh, unused schema name (nothing is created yet: building a store migrates it).
    pub(crate) async fn fresh() -> Arc<Self> {
        static CLEANUP: Once = Once::new();
        let mut first = false;
        CLEANUP.call_once(|| first = true);
        if first {
            drop_stale_schemas().await;
        }
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
        let rand = uuid::Uuid::new_v4().simple().to_string();
        Arc::new(Self { name: format!("{SCHEMA_PREFIX}{secs}_{}", &rand[..12]) })
    }
}

/// Runs `sql` on a new connection, on a thread with its own small runtime, and says
/// whether it succeeded: for `Drop`, which runs synchronously, perhaps on a runtime thread
/// or while the test's runtime shuts down.
pub(crate) fn execute_on_a_thread_of_its_own(sql: String) -> bool {
    let url = url();
    let done = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
        rt.block_on(async move {
            let mut conn = PgConnection::connect(&url).await.ok()?;
            let res = sqlx::Executor::execute(&mut conn, sqlx::raw_sql(&sql)).await.ok();
            let _ = conn.close().await;
            res.map(drop)
        })
    })
    .join();
    matches!(done, Ok(Some(())))
}

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        // A bounded lock wait: a session left holding a lock on the schema must cost a
        // warning, never a hung test run.
        let sql = format!("SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name);
        if !execute_on_a_thread_of_its_own(sql) {
            eprintln!("warning: could not drop test schema {}; it will be removed by a later run", self.name);
        }
    }
}

/// Drops `idem_test_*` schemas created more than an hour ago (crashed runs). Boxed: a
/// future that reuses `&mut PgConnection` across awaits is not provably `Send` for every
/// lifetime, which `async_trait` callers (the conformance `Backend`) need.
fn drop_stale_schemas() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async {
        let mut conn = raw().await;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
        let names: Vec<String> =
            sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)")
                .bind(SCHEMA_PREFIX)
                .fetch_all(&mut conn)
                .await
                .unwrap_or_default();
        for name in names {
            let created = name[SCHEMA_PREFIX.len()..].split('_').next().and_then(|s| s.parse::<u64>().ok());
            if created.is_some_and(|t| t + 3600 < now) {
                let sql = format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE");
                let _ = sqlx::Executor::execute(&mut conn, sqlx::raw_sql(&sql)).await;
            }
        }
    })
}

/// The configuration tests use: `schema`, the pinned clock if any, `max_connections`.
pub(crate) fn config(schema: &str, clock: Option<ManualClock>, max_connections: usize) -> Config {
    let config = Config::default().with_schema(schema).with_max_connections(max_connections).with_listen(true);
    match clock {
        Some(clock) => config.with_clock(Arc::new(clock)),
        None => config,
    }
}

/// Connects with `config`, failing the test with the start hint when the server is down.
pub(crate) async fn connect_with(config: Config) -> PostgresStore {
    match PostgresStore::connect(&url(), config).await {
        Ok(s) => s,
        Err(e @ idem_postgres::Error::Connection { .. }) => unreachable(&e),
        Err(e) => panic!("connecting: {e:?}"),
    }
}

/// Connects a store on `schema` (migrating it, the default).
pub(crate) async fn connect(schema: &str, clock: Option<ManualClock>, max_connections: usize) -> PostgresStore {
    connect_with(config(schema, clock, max_connections)).await
}

/// A store on a fresh, migrated schema that is dropped when the last handle goes.
pub(crate) async fn fresh_store(clock: Option<ManualClock>, max_connections: usize) -> Forwarding<TestStore> {
    let guard = SchemaGuard::fresh().await;
    let store = connect(&guard.name, clock, max_connections).await;
    Forwarding(TestStore { inner: store, guard })
}

/// A store that keeps its schema alive.
#[derive(Clone, Debug)]
pub(crate) struct TestStore {
    pub(crate) inner: PostgresStore,
    pub(crate) guard: Arc<SchemaGuard>,
}

#[async_trait]
impl Forward for TestStore {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
}

/// PgBouncer (transaction mode) in front of the test server, started by
/// `scripts/pgbouncer` (from `scripts/services`), or `IDEM_PGBOUNCER_URL`.
pub(crate) fn pgbouncer_url() -> String {
    std::env::var("IDEM_PGBOUNCER_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6401/test".to_owned())
}

/// How a test store reaches the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// Straight to PostgreSQL.
    Direct,
    /// Through PgBouncer in transaction mode: unnamed statements, no startup options, no
    /// `LISTEN`.
    PgBouncer,
}

impl Via {
    pub(crate) fn url(self) -> String {
        match self {
            Via::Direct => url(),
            Via::PgBouncer => pgbouncer_url(),
        }
    }

    pub(crate) fn config(self, config: Config) -> Config {
        match self {
            Via::Direct => config,
            // Under transaction pooling a LISTEN session's notifications reach other clients.
            Via::PgBouncer => config.with_prepared_statements(false).with_isolation_pin(false).with_listen(false),
        }
    }

    fn unreachable(self, err: &dyn std::error::Error) -> ! {
        match self {
            Via::Direct => unreachable(err),
            Via::PgBouncer => panic!(
                "\n\nPgBouncer is not reachable at {} ({err}).\nThese tests need it; they fail rather than skip. \
                 Start it with scripts/pgbouncer (scripts/services runs it), or set IDEM_PGBOUNCER_URL.\n",
                pgbouncer_url()
            ),
        }
    }
}

/// A store with a pool of its own (`connect`) on `schema`, reached `via`.
pub(crate) async fn store(via: Via, schema: &str, clock: Option<ManualClock>, max: usize) -> PostgresStore {
    match PostgresStore::connect(&via.url(), via.config(config(schema, clock, max))).await {
        Ok(s) => s,
        Err(e @ idem_postgres::Error::Connection { .. }) => via.unreachable(&e),
        Err(e) => panic!("connecting: {e:?}"),
    }
}

/// An application's own pool, reached `via`.
pub(crate) async fn pool(via: Via, max: usize) -> sqlx::PgPool {
    match sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(max).unwrap_or(u32::MAX))
        .acquire_timeout(Duration::from_secs(30))
        .connect(&via.url())
        .await
    {
        Ok(pool) => pool,
        Err(e) => via.unreachable(&e),
    }
}

/// A store reached `via` on `guard`'s schema, keeping the schema alive.
pub(crate) async fn open(via: Via, guard: &Arc<SchemaGuard>, clock: Option<ManualClock>, max: usize) -> Arc<dyn Store> {
    let guard = Arc::clone(guard);
    Arc::new(Forwarding(TestStore { inner: store(via, &guard.name, clock, max).await, guard }))
}
