//! Shared by the test modules: the server URL, fresh table prefixes whose tables drop
//! themselves, and the one message a developer without a running server sees.

#![allow(dead_code, reason = "each module uses a different subset")]

use std::sync::{Arc, Once, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use idem_conformance::{Forward, Forwarding};
use idem_core::{ManualClock, Store};
use idem_mysql::sqlx::{self, Connection as _, MySqlConnection};
use idem_mysql::{Config, MySqlStore};

/// Used when `IDEM_MYSQL_URL` is not set.
pub(crate) const DEFAULT_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// Every table prefix a test uses starts with this, followed by the creation time in Unix
/// seconds and a random suffix: leftovers of a crashed run are easy to find, and are
/// dropped by the next run once they are an hour old.
pub(crate) const TEST_PREFIX: &str = "idem_test_";

/// The server the tests use.
pub(crate) fn url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
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
        "\n\nMySQL/MariaDB is not reachable at {} ({chain}).\n\
         These tests need a running server; they fail rather than skip. Start it with:\n\
         \n    scripts/services   (or: service mariadb start)\n\
         \nor point IDEM_MYSQL_URL at another server (the database must exist).\n",
        url()
    );
}

/// Fails the test at once when the server cannot be reached: asked once per test process
/// (on a thread with its own runtime, so any caller may ask), so a suite run without a
/// server fails every test in moments instead of waiting out a pool timeout in each, and
/// in each case the model-based test shrinks.
pub(crate) fn ensure_reachable() {
    static PROBE: OnceLock<Option<String>> = OnceLock::new();
    let failure = PROBE.get_or_init(|| {
        let url = url();
        let probe = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
            rt.block_on(async move {
                let connect = tokio::time::timeout(Duration::from_secs(10), MySqlConnection::connect(&url));
                match connect.await {
                    Ok(Ok(conn)) => {
                        let _ = conn.close().await;
                        Ok(())
                    }
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("no answer within 10 s".to_owned()),
                }
            })
        });
        match probe.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some("the probe thread panicked".to_owned()),
        }
    });
    if let Some(e) = failure {
        unreachable(&std::io::Error::other(e.clone()));
    }
}

/// A connection of the test's own (for its own SQL).
pub(crate) async fn raw() -> MySqlConnection {
    ensure_reachable();
    MySqlConnection::connect(&url()).await.unwrap_or_else(|e| unreachable(&e))
}

/// Runs `sql` (one statement, text protocol) on `conn`.
pub(crate) async fn execute(conn: &mut MySqlConnection, sql: &str) {
    sqlx::Executor::execute(conn, sqlx::raw_sql(sql)).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A table prefix whose tables exist for as long as this guard (shared by every handle on
/// it) lives; dropping the last handle drops the tables.
#[derive(Debug)]
pub(crate) struct PrefixGuard {
    pub(crate) name: String,
}

impl PrefixGuard {
    /// A fresh, unused prefix (nothing is created yet: building a store migrates it).
    pub(crate) async fn fresh() -> Arc<Self> {
        ensure_reachable();
        static CLEANUP: Once = Once::new();
        let mut first = false;
        CLEANUP.call_once(|| first = true);
        if first {
            drop_stale_tables().await;
        }
        Arc::new(Self { name: fresh_name() })
    }
}

/// A fresh prefix name, created nowhere.
pub(crate) fn fresh_name() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
    let rand = uuid::Uuid::new_v4().simple().to_string();
    format!("{TEST_PREFIX}{secs}_{}", &rand[..12])
}

/// The statement that drops every table of `prefix`.
pub(crate) fn drop_tables_sql(prefix: &str) -> String {
    format!("DROP TABLE IF EXISTS `{prefix}_journal`, `{prefix}_records`, `{prefix}_schema_migrations`")
}

/// Runs `sql` on a new connection, on a thread with its own small runtime, and says
/// whether it succeeded: for `Drop`, which runs synchronously, perhaps on a runtime thread
/// or while the test's runtime shuts down.
pub(crate) fn execute_on_a_thread_of_its_own(sql: String) -> bool {
    let url = url();
    let done = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
        rt.block_on(async move {
            let mut conn = MySqlConnection::connect(&url).await.ok()?;
            // A bounded lock wait: a session left holding a lock must cost a warning, never
            // a hung test run.
            let _ = sqlx::Executor::execute(&mut conn, sqlx::raw_sql("SET SESSION lock_wait_timeout = 10")).await;
            let res = sqlx::Executor::execute(&mut conn, sqlx::raw_sql(&sql)).await.ok();
            let _ = conn.close().await;
            res.map(drop)
        })
    })
    .join();
    matches!(done, Ok(Some(())))
}

impl Drop for PrefixGuard {
    fn drop(&mut self) {
        if !execute_on_a_thread_of_its_own(drop_tables_sql(&self.name)) {
            eprintln!("warning: could not drop test tables {}_*; a later run removes them", self.name);
        }
    }
}

/// Drops `idem_test_*` tables created more than an hour ago (crashed runs). Boxed so the
/// future is `Send` for `async_trait` callers.
fn drop_stale_tables() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async {
        let mut conn = raw().await;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables
             WHERE table_schema = DATABASE() AND table_name LIKE 'idem\\_test\\_%'
             ORDER BY table_name",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap_or_default();
        for name in names {
            let created = name[TEST_PREFIX.len()..].split('_').next().and_then(|s| s.parse::<u64>().ok());
            if created.is_some_and(|t| t + 3600 < now) {
                let _ =
                    sqlx::Executor::execute(&mut conn, sqlx::raw_sql(&format!("DROP TABLE IF EXISTS `{name}`"))).await;
            }
        }
    })
}

/// The configuration tests use: `prefix`, the pinned clock if any, `max_connections`.
pub(crate) fn config(prefix: &str, clock: Option<ManualClock>, max_connections: usize) -> Config {
    let config = Config::default().with_table_prefix(prefix).with_max_connections(max_connections);
    match clock {
        Some(clock) => config.with_clock(Arc::new(clock)),
        None => config,
    }
}

/// Connects with `config`, failing the test with the start hint when the server is down.
pub(crate) async fn connect_with(config: Config) -> MySqlStore {
    ensure_reachable();
    match MySqlStore::connect(&url(), config).await {
        Ok(s) => s,
        Err(e @ idem_mysql::Error::Connection { .. }) => unreachable(&e),
        Err(e) => panic!("connecting: {e:?}"),
    }
}

/// Connects a store on `prefix` (migrating it, the default).
pub(crate) async fn connect(prefix: &str, clock: Option<ManualClock>, max_connections: usize) -> MySqlStore {
    connect_with(config(prefix, clock, max_connections)).await
}

/// A store on fresh, migrated tables that are dropped when the last handle goes.
pub(crate) async fn fresh_store(clock: Option<ManualClock>, max_connections: usize) -> Forwarding<TestStore> {
    let guard = PrefixGuard::fresh().await;
    let store = connect(&guard.name, clock, max_connections).await;
    Forwarding(TestStore { inner: store, guard })
}

/// A store that keeps its tables alive.
#[derive(Clone, Debug)]
pub(crate) struct TestStore {
    pub(crate) inner: MySqlStore,
    pub(crate) guard: Arc<PrefixGuard>,
}

#[async_trait]
impl Forward for TestStore {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
}

/// An application's own pool, sessions at the server's default level unless
/// `read_committed`.
pub(crate) async fn pool(max: u32, read_committed: bool) -> sqlx::MySqlPool {
    ensure_reachable();
    let mut options =
        sqlx::mysql::MySqlPoolOptions::new().max_connections(max).acquire_timeout(Duration::from_secs(30));
    if read_committed {
        options = options.after_connect(|conn, _| Box::pin(idem_mysql::pin_read_committed(conn)));
    }
    match options.connect(&url()).await {
        Ok(pool) => pool,
        Err(e) => unreachable(&e),
    }
}

/// A store on `guard`'s tables, keeping them alive.
pub(crate) async fn open(guard: &Arc<PrefixGuard>, clock: Option<ManualClock>, max: usize) -> Arc<dyn Store> {
    let guard = Arc::clone(guard);
    Arc::new(Forwarding(TestStore { inner: connect(&guard.name, clock, max).await, guard }))
}
