//! [`SqliteStore`]: the store in one SQLite file, an [`Embedded`] store of `idem-core`:
//! the writer connection as a group-commit [`Engine`], and the pool of read connections.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::group_commit::{BatchStats, Embedded, Engine, GroupCommit, Stage, TransactionFailed};
use idem_core::{Capabilities, Clock, RecordRead, RecordTable, StoreError};
use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use crate::config::Config;
use crate::error::{BACKEND, Error};
use crate::sql;
use crate::table::{SqliteTable, SqliteView};

/// An idempotency [`Store`](idem_core::Store) in one SQLite file: an [`Embedded`] store,
/// whose `Store` methods `idem-core` writes once for every embedded engine.
///
/// Cheap to clone: clones share the writer thread and the reader pool. Writes go to one
/// writer thread that applies whatever is queued in one `BEGIN IMMEDIATE` transaction
/// ([`idem_core::group_commit`]); reads, and a claim that finds a live record, run on
/// pooled read connections. When the last clone is dropped the writer answers the queued
/// operations and closes its connection.
///
/// Open one per process and clone it. A second `SqliteStore` on the same file is correct
/// (it is how several processes share one file), but its writes wait on the other's lock
/// through SQLite's busy handler instead of joining the same group commits.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    commit: GroupCommit,
    readers: Readers,
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .field("clock", &self.inner.clock)
            .field("stats", &self.inner.commit.stats())
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database file at `path`, switches it to WAL, applies
    /// the missing migrations (or only checks the schema version, see
    /// [`Config::with_auto_migrate`]), opens the pooled read connections and starts the
    /// writer thread.
    ///
    /// This blocks on file I/O (and on another process's write lock, up to the busy
    /// timeout): call it before the async runtime starts or inside
    /// `tokio::task::spawn_blocking`.
    ///
    /// # Errors
    /// [`Error::Open`] when the file cannot be opened or configured, [`Error::NotWal`] when
    /// it cannot use WAL (e.g. `:memory:`), [`Error::Migration`] / [`Error::SchemaTooNew`] /
    /// [`Error::SchemaOutdated`] for schema problems, [`Error::ClockBehind`] when the
    /// file's newest claim lies further ahead of this clock than
    /// [`Config::with_max_clock_skew`] allows, [`Error::Spawn`] when the writer thread
    /// cannot start.
    pub fn open(path: impl AsRef<Path>, config: Config) -> Result<Self, Error> {
        let path = path.as_ref().to_path_buf();
        let mut conn = open_writer(&path, &config)?;
        if config.auto_migrate {
            sql::migrate(&mut conn)?;
        } else {
            sql::check(&conn)?;
        }
        let clock_skew_ms = check_clock(&conn, &*config.clock, config.max_clock_skew)?;
        conn.set_prepared_statement_cache_capacity(16);
        let readers = Readers::open(&path, config.busy_timeout, config.max_readers)?;
        let writer = Writer {
            conn,
            #[cfg(test)]
            panic_on_key: config.panic_on_key.clone(),
        };
        // The settings this store runs on (docs/observability.md).
        tracing::info!(
            backend = "sqlite",
            path = %path.display(),
            journal_mode = "wal",
            synchronous = "FULL",
            schema_version = crate::SCHEMA_VERSION,
            auto_migrate = config.auto_migrate,
            batch = ?config.batch,
            clock_skew_ms,
            "idem-sqlite: store settings"
        );
        let clock = Arc::clone(&config.clock);
        let commit = GroupCommit::start(writer, config.clock, config.batch).map_err(Error::Spawn)?;
        Ok(Self { inner: Arc::new(Inner { path, commit, readers, clock }) })
    }

    /// Applies the migrations the file at `path` is missing (creating the file if needed)
    /// and returns how many ran: 0 when it already is at [`crate::SCHEMA_VERSION`]. Safe to
    /// run from several processes at once (each migration runs exactly once). Stores opened
    /// with [`Config::with_auto_migrate`]`(false)` need it first. Blocking, like
    /// [`SqliteStore::open`]; of `config` only the busy timeout applies.
    ///
    /// # Errors
    /// [`Error::Open`] / [`Error::NotWal`] as for [`SqliteStore::open`];
    /// [`Error::Migration`] when a migration fails (its transaction is rolled back, so the
    /// file keeps its previous version); [`Error::SchemaTooNew`].
    pub fn migrate(path: impl AsRef<Path>, config: &Config) -> Result<usize, Error> {
        sql::migrate(&mut open_writer(path.as_ref(), config)?)
    }

    /// The database file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// What the writer has done so far: batches, operations, failed and read-only batches,
    /// claims answered by a read connection, abandoned claims skipped.
    #[must_use]
    pub fn batch_stats(&self) -> BatchStats {
        self.inner.commit.stats()
    }
}

impl Embedded for SqliteStore {
    // Several processes may open the same file: BEGIN IMMEDIATE serialises them.
    const CAPABILITIES: Capabilities =
        Capabilities { backend: "sqlite", shared: true, journal: true, list: true, ..Capabilities::NONE };

    fn writer(&self) -> &GroupCommit {
        &self.inner.commit
    }

    /// A free pooled reader, never a new connection: a WAL point read does not wait.
    fn try_view<T>(&self, read: impl FnOnce(&dyn RecordRead) -> T) -> Option<T> {
        self.inner.readers.try_with(|conn| read(&SqliteView::new(conn)))
    }

    /// A pooled reader (or a short-lived one when all are busy), inside one read
    /// transaction: a record's liveness and its journal entry come from the same snapshot.
    fn view<T>(&self, read: impl FnOnce(&dyn RecordRead) -> Result<T, StoreError>) -> Result<T, StoreError> {
        self.inner.readers.with(|conn| {
            let snapshot = conn.unchecked_transaction().map_err(Error::sqlite("begin read"))?;
            read(&SqliteView::new(&snapshot))
        })
    }
}

/// Measures how far the newest claim in the file lies ahead of `clock` (ms, 0 when none
/// does) and refuses over `limit`. Looks at the in-flight claims (their partial index) and
/// the 1 000 newest rows, so opening a large file stays cheap.
fn check_clock(conn: &Connection, clock: &dyn Clock, limit: Duration) -> Result<u64, Error> {
    let newest: Option<i64> = conn
        .query_row(
            "SELECT max(m) FROM (
                 SELECT max(started_at) AS m FROM idem_records WHERE state = 'in_flight'
                 UNION ALL
                 SELECT max(started_at) FROM (SELECT started_at FROM idem_records ORDER BY rowid DESC LIMIT 1000)
             )",
            [],
            |row| row.get(0),
        )
        .map_err(Error::sqlite("read the newest claim time"))?;
    let now = clock.now().0;
    let ahead_ms = newest.map_or(0, |t| u64::try_from(t.saturating_sub(now)).unwrap_or(0));
    if ahead_ms == 0 {
        return Ok(0);
    }
    let limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
    if ahead_ms > limit_ms {
        return Err(Error::ClockBehind { ahead_ms, limit_ms });
    }
    tracing::warn!(
        ahead_ms,
        "the newest claim in the SQLite file lies ahead of this process's clock: another process sharing the \
         file runs a faster clock, and leases are off by that much"
    );
    Ok(ahead_ms)
}

/// The writer's connection: WAL, busy timeout, `synchronous`; not yet migrated.
fn open_writer(path: &Path, config: &Config) -> Result<Connection, Error> {
    let open_err = |step| move |source| Error::Open { path: path.to_path_buf(), step, source };
    let conn = Connection::open(path).map_err(open_err("open"))?;
    conn.busy_timeout(config.busy_timeout).map_err(open_err("set busy_timeout"))?;
    let mode = enable_wal(&conn, config.busy_timeout).map_err(open_err("set journal_mode = WAL"))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(Error::NotWal { path: path.to_path_buf(), mode });
    }
    conn.pragma_update(None, "synchronous", "FULL").map_err(open_err("set synchronous"))?;
    Ok(conn)
}

/// Switches the file to WAL (a persistent property of the file) and returns the journal
/// mode SQLite reports.
///
/// Switching needs an exclusive lock, and SQLite answers `SQLITE_BUSY` at once, without
/// the busy handler, when another process holds any lock at that moment: several
/// processes opening a fresh file together would fail. So this retries until `timeout`,
/// and skips the switch when the file already is in WAL mode (the usual case).
fn enable_wal(conn: &Connection, timeout: Duration) -> rusqlite::Result<String> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let attempt = conn.pragma_query_value(None, "journal_mode", |row| row.get::<_, String>(0)).and_then(|mode| {
            if mode.eq_ignore_ascii_case("wal") {
                Ok(mode)
            } else {
                conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))
            }
        });
        match attempt {
            Err(e)
                if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy)
                    && std::time::Instant::now() < deadline =>
            {
                // Open is documented as blocking; this back-off only runs while another
                // process holds the lock during its own open.
                std::thread::sleep(Duration::from_millis(2));
            }
            other => return other,
        }
    }
}

/// Read connections, opened with the store and shared by its clones.
struct Readers {
    path: PathBuf,
    busy_timeout: Duration,
    max: usize,
    pool: Mutex<Vec<Connection>>,
}

impl Readers {
    fn open(path: &Path, busy_timeout: Duration, max: usize) -> Result<Self, Error> {
        let mut readers = Self { path: path.to_path_buf(), busy_timeout, max, pool: Mutex::new(Vec::new()) };
        let pool = (0..max).map(|_| readers.connect()).collect::<Result<_, _>>()?;
        readers.pool = Mutex::new(pool);
        Ok(readers)
    }

    fn connect(&self) -> Result<Connection, Error> {
        let open_err = |step| move |source| Error::Open { path: self.path.clone(), step, source };
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI,
        )
        .map_err(open_err("open reader"))?;
        conn.busy_timeout(self.busy_timeout).map_err(open_err("set busy_timeout"))?;
        conn.pragma_update(None, "query_only", true).map_err(open_err("set query_only"))?;
        Ok(conn)
    }

    fn take(&self) -> Option<Connection> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner).pop()
    }

    fn give_back(&self, conn: Connection) {
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < self.max {
            pool.push(conn);
        }
    }

    /// Runs `f` on a pooled connection, opening a short-lived one when all are in use.
    /// Blocking: for `spawn_blocking`.
    fn with<T>(&self, f: impl FnOnce(&Connection) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let conn = self.take().map_or_else(|| self.connect(), Ok)?;
        let result = f(&conn);
        self.give_back(conn);
        result
    }

    /// Runs `f` on a pooled connection if one is free; never opens one. For the claim
    /// path, which runs on the caller's (async) thread: a WAL point read does not wait.
    fn try_with<T>(&self, f: impl FnOnce(&Connection) -> T) -> Option<T> {
        let conn = self.take()?;
        let result = f(&conn);
        self.give_back(conn);
        Some(result)
    }
}

/// The one connection that writes, driven by the group-commit writer thread.
struct Writer {
    conn: Connection,
    #[cfg(test)]
    panic_on_key: Option<String>,
}

fn transaction_failed(stage: Stage, operation: &'static str) -> impl FnOnce(rusqlite::Error) -> TransactionFailed {
    move |source| TransactionFailed { stage, error: Error::Sqlite { operation, source }.into() }
}

impl Engine for Writer {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// `BEGIN IMMEDIATE` takes the file's write lock before the first read, so nothing
    /// another connection or process writes can come between a read and the write it
    /// decides (`docs/contract.md#sqlite`).
    fn transaction(&mut self, apply: &mut dyn FnMut(&mut dyn RecordTable) -> bool) -> Result<(), TransactionFailed> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(transaction_failed(Stage::Begin, "begin group commit"))?;
        let mut table = SqliteTable::new(&tx);
        #[cfg(test)]
        {
            table.panic_on_key = self.panic_on_key.as_deref();
        }
        if apply(&mut table) {
            // A failed COMMIT leaves the transaction open; dropping it rolls it back.
            return tx.commit().map_err(transaction_failed(Stage::Commit, "commit group commit"));
        }
        // Nothing to keep (a read-only batch, or one the executor gave up): roll back,
        // unless SQLite already did.
        if let Err(error) = tx.finish() {
            tracing::warn!(%error, "idem-sqlite could not roll back an aborted group commit");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The writer's panic recovery, through a test-only setting; the other batch tests are
    //! in `tests/it/batch.rs`.

    use idem_core::group_commit::BatchConfig;
    use idem_core::{
        ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ManualClock, Scope, Store, UnixMillis,
    };

    use super::*;

    fn req(key: &str) -> ClaimRequest {
        let scope = Scope::new("p", Endpoint::new("POST", "/e")).expect("scope");
        let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
        ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"b"), Duration::from_secs(5), Duration::from_secs(60))
    }

    fn claimed(outcome: &Result<ClaimOutcome, StoreError>) -> bool {
        matches!(outcome, Ok(ClaimOutcome::Claimed(_)))
    }

    #[tokio::test]
    async fn a_panic_in_a_batch_fails_its_callers_and_the_next_batch_commits() {
        //! A panic in the writer (a bug, an assertion on a damaged file) used to stop the
        //! store until the process restarted.
        let dir = tempfile::tempdir().expect("temp dir");
        let config = Config::default()
            .with_clock(Arc::new(ManualClock::new(UnixMillis(1_000_000))))
            .with_batch(BatchConfig::default().with_max_batch(2).with_full_batches(Duration::from_secs(5)))
            .with_panic_on_key("boom");
        let store = SqliteStore::open(dir.path().join("batch.sqlite3"), config).expect("open");
        let (a, boom) = futures::join!(store.claim(req("a")), store.claim(req("boom")));
        assert!(a.is_err() && boom.is_err(), "{a:?} {boom:?}");
        assert!(store.get(req("a").id()).await.expect("get").is_none(), "nothing of the panicked batch was committed");
        let (a, b) = futures::join!(store.claim(req("a")), store.claim(req("b")));
        assert!(claimed(&a) && claimed(&b), "{a:?} {b:?}");
        assert_eq!(store.batch_stats().failed_batches, 1);
    }
}
