//! [`SqliteStore`]: the writer thread with group commit, the reader pool, and the
//! [`Store`] implementation.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, FencingToken, JournalWrite, ReclaimOutcome, ReclaimRequest,
    Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome, SystemClock, transition,
};
use rusqlite::{Connection, OpenFlags, TransactionBehavior};
use tokio::sync::{mpsc, oneshot};

use crate::error::Error;
use crate::schema;

/// `PRAGMA synchronous` for the writer: what a commit waits for before the caller hears
/// "done". Both keep the database consistent after any crash; they differ in whether the
/// newest commits survive a power loss or an operating-system crash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Synchronous {
    /// `synchronous = FULL` (default): every commit fsyncs the write-ahead log before the
    /// callers of its batch get their outcomes. An acknowledged claim or completion
    /// survives power loss. Costs one fsync per group commit, which group commit shares
    /// among every operation of the batch.
    #[default]
    Full,
    /// `synchronous = NORMAL`: in WAL mode the log is fsynced only at checkpoints. Commits
    /// survive a crash of the process, but a power loss or OS crash can roll back the
    /// last commits (never corrupt the file). For idempotency that means an acknowledged
    /// claim can vanish, so a retry after the outage runs the handler a second time, and
    /// a stored response can vanish, so its retry runs again instead of replaying. Choose
    /// it only when handlers' side effects are themselves idempotent (derived sub-keys).
    Normal,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// Settings for [`SqliteStore`]; start from [`SqliteStore::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct SqliteStoreBuilder {
    path: PathBuf,
    clock: Arc<dyn Clock>,
    synchronous: Synchronous,
    busy_timeout: Duration,
    max_batch: usize,
    queue: usize,
    max_readers: usize,
}

impl SqliteStoreBuilder {
    /// The clock every `now` is read from (default [`SystemClock`]); tests pass a
    /// [`idem_core::ManualClock`].
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Durability of each commit (default [`Synchronous::Full`]).
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a connection waits for a lock another process holds before giving up with
    /// a retryable `SQLITE_BUSY` (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Most operations applied in one group-commit transaction (default 256, at least 1).
    /// Larger batches share one fsync among more callers but make each caller of a batch
    /// wait for the whole batch.
    pub fn max_batch(mut self, n: usize) -> Self {
        self.max_batch = n.max(1);
        self
    }

    /// Operations that may wait for the writer (default 4096, at least 1); beyond that,
    /// callers wait to enqueue (back-pressure instead of unbounded memory).
    pub fn queue_capacity(mut self, n: usize) -> Self {
        self.queue = n.max(1);
        self
    }

    /// Read connections kept open for [`Store::get`] (default 4). More concurrent reads
    /// open short-lived extra connections.
    pub fn max_readers(mut self, n: usize) -> Self {
        self.max_readers = n;
        self
    }

    /// Opens (creating if needed) the database file, switches it to WAL, runs the
    /// migrations and starts the writer thread.
    ///
    /// This blocks on file I/O (and on another process's write lock, up to the busy
    /// timeout): call it before the async runtime starts or inside
    /// `tokio::task::spawn_blocking`.
    ///
    /// # Errors
    /// [`Error::Open`] when the file cannot be opened or configured, [`Error::NotWal`] when
    /// it cannot use WAL (e.g. `:memory:`), [`Error::Migration`] / [`Error::SchemaTooNew`]
    /// for schema problems, [`Error::Spawn`] when the writer thread cannot start.
    pub fn open(self) -> Result<SqliteStore, Error> {
        let conn = self.open_writer()?;
        let (tx, rx) = mpsc::channel(self.queue);
        let writer = Writer { conn, clock: Arc::clone(&self.clock), max_batch: self.max_batch };
        std::thread::Builder::new()
            .name("idem-sqlite-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(Error::Spawn)?;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                path: self.path,
                clock: self.clock,
                busy_timeout: self.busy_timeout,
                max_readers: self.max_readers,
                readers: Mutex::new(Vec::new()),
                writer: tx,
            }),
        })
    }
}

impl SqliteStoreBuilder {
    /// The writer's connection: WAL, busy timeout, `synchronous`, migrated schema.
    fn open_writer(&self) -> Result<Connection, Error> {
        let open_err = |step| {
            let path = self.path.clone();
            move |source| Error::Open { path, step, source }
        };
        let mut conn = Connection::open(&self.path).map_err(open_err("open"))?;
        conn.busy_timeout(self.busy_timeout).map_err(open_err("set busy_timeout"))?;
        let mode = enable_wal(&conn, self.busy_timeout).map_err(open_err("set journal_mode = WAL"))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::NotWal { path: self.path.clone(), mode });
        }
        conn.pragma_update(None, "synchronous", self.synchronous.pragma()).map_err(open_err("set synchronous"))?;
        schema::migrate(&mut conn)?;
        conn.set_prepared_statement_cache_capacity(16);
        Ok(conn)
    }
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

/// An idempotency [`Store`] in one SQLite file.
///
/// Cheap to clone: clones share the writer thread and the reader pool. Writes (claim,
/// reclaim, complete, fail, sweep) go to the one writer thread, which applies whatever is
/// queued in one transaction (group commit); reads ([`Store::get`]) run on
/// `spawn_blocking` with pooled read connections. When the last clone is dropped the writer
/// finishes the queued operations and closes its connection.
///
/// Open one per process and clone it. A second `SqliteStore` on the same file is correct
/// (it is how several processes share one file), but its writes wait on the other's lock
/// through SQLite's busy handler instead of joining the same group commits.
///
/// Dropping a call's future does not always cancel it: a completion or fail already queued
/// is still applied. A claim or reclaim whose caller is gone by the time its batch runs is
/// skipped; one applied just before the caller went away stays, and its lease frees it.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    clock: Arc<dyn Clock>,
    busy_timeout: Duration,
    max_readers: usize,
    readers: Mutex<Vec<Connection>>,
    writer: mpsc::Sender<Op>,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .field("clock", &self.inner.clock)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens `path` with the defaults: system clock, `synchronous = FULL`, 5 s busy
    /// timeout. Blocking; see [`SqliteStoreBuilder::open`].
    ///
    /// # Errors
    /// As [`SqliteStoreBuilder::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::builder(path).open()
    }

    /// Settings for a store on `path`.
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            path: path.as_ref().to_path_buf(),
            clock: Arc::new(SystemClock),
            synchronous: Synchronous::default(),
            busy_timeout: Duration::from_secs(5),
            max_batch: 256,
            queue: 4096,
            max_readers: 4,
        }
    }

    /// The database file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Spawns a task that sweeps this store every `period`: each round calls
    /// [`Store::sweep`] with `batch` (at least 1) until it reports no `more`, so a backlog
    /// drains in bounded transactions that other writes interleave with. The first round
    /// runs at once. A failed sweep is logged (`tracing` warning) and tried again next
    /// period. The task runs until the handle is aborted; it keeps the store open.
    ///
    /// Must be called inside a Tokio runtime.
    pub fn spawn_sweeper(&self, period: Duration, batch: usize) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        let batch = batch.max(1);
        let mut tick = tokio::time::interval(period.max(Duration::from_millis(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::spawn(async move {
            loop {
                tick.tick().await;
                loop {
                    match store.sweep(batch).await {
                        Ok(SweepOutcome { more: true, .. }) => continue,
                        Ok(_) => break,
                        Err(error) => {
                            tracing::warn!(%error, "idem-sqlite sweep failed; trying again next period");
                            break;
                        }
                    }
                }
            }
        })
    }

    async fn submit<T>(&self, make: impl FnOnce(Reply<T>) -> Op) -> Result<T, StoreError> {
        let (reply, outcome) = oneshot::channel();
        self.inner.writer.send(make(reply)).await.map_err(|_| StoreError::from(Error::WriterStopped))?;
        outcome.await.map_err(|_| StoreError::from(Error::WriterStopped))?
    }
}

impl Inner {
    fn open_reader(&self) -> Result<Connection, Error> {
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

    /// Runs `f` on a pooled read connection (opening one if none is free) with the
    /// store's `now`.
    fn with_reader<T>(
        &self,
        f: impl FnOnce(&Connection, idem_core::UnixMillis) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let pooled = self.readers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
        let conn = match pooled {
            Some(conn) => conn,
            None => self.open_reader()?,
        };
        let result = f(&conn, self.clock.now());
        let mut pool = self.readers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if pool.len() < self.max_readers {
            pool.push(conn);
        }
        result
    }

    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.with_reader(|conn, now| Ok(schema::select(conn, id)?.filter(|r| !r.is_expired(now))))
    }

    fn read_journal(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.with_reader(|conn, now| schema::journal_lookup(conn, id, name, now))
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.submit(|reply| Op::Claim(req, reply)).await
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.submit(|reply| Op::Reclaim(req, reply)).await
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        self.submit(|reply| Op::Complete { id, token, response, reply }).await
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        self.submit(|reply| Op::Fail { id, token, reply }).await
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || inner.read(id))
            .await
            .map_err(|join| StoreError::unavailable(crate::error::BACKEND, "read task failed", false, join))?
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.submit(|reply| Op::Sweep { limit, reply }).await
    }

    fn capabilities(&self) -> Capabilities {
        // Several processes may open the same file: BEGIN IMMEDIATE serialises them.
        Capabilities::new().with_shared(true).with_journal(true)
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
        self.submit(|reply| Op::JournalPut { id, token, name, value, overwrite, reply }).await
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let inner = Arc::clone(&self.inner);
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || inner.read_journal(id, &name))
            .await
            .map_err(|join| StoreError::unavailable(crate::error::BACKEND, "read task failed", false, join))?
    }
}

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// A write waiting for the writer thread.
enum Op {
    Claim(ClaimRequest, Reply<ClaimOutcome>),
    Reclaim(ReclaimRequest, Reply<ReclaimOutcome>),
    Complete {
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
        reply: Reply<Record>,
    },
    Fail {
        id: RecordId,
        token: FencingToken,
        reply: Reply<Record>,
    },
    Sweep {
        limit: usize,
        reply: Reply<SweepOutcome>,
    },
    JournalPut {
        id: RecordId,
        token: FencingToken,
        name: String,
        value: Vec<u8>,
        overwrite: bool,
        reply: Reply<JournalWrite>,
    },
}

/// An applied operation whose outcome is held back until its batch commits. Called with
/// `Some(error)` when the batch failed: the caller gets that error instead.
type Settle = Box<dyn FnOnce(Option<StoreError>) + Send>;

fn settle<T: Send + 'static>(reply: Reply<T>, outcome: Result<T, StoreError>) -> Settle {
    Box::new(move |failed| {
        // A caller that gave up (dropped its future) no longer wants the outcome.
        let _ = reply.send(match failed {
            Some(err) => Err(err),
            None => outcome,
        });
    })
}

/// The one connection that writes, on its own thread.
struct Writer {
    conn: Connection,
    clock: Arc<dyn Clock>,
    max_batch: usize,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<Op>) {
        let mut batch = Vec::with_capacity(self.max_batch);
        // Group commit: block for the first operation, then take whatever else queued up
        // while the previous commit was fsyncing, up to `max_batch`.
        while let Some(first) = rx.blocking_recv() {
            batch.push(first);
            while batch.len() < self.max_batch {
                match rx.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            self.commit_batch(&mut batch);
        }
        tracing::debug!("idem-sqlite writer stopped: every store handle was dropped");
    }

    /// Applies `batch` in one `BEGIN IMMEDIATE` transaction. Each operation reads its row,
    /// runs the pure transition from `idem_core::transition` and writes the result, so it
    /// sees the operations before it. Outcomes go out only after the commit succeeded; if
    /// the transaction cannot begin or commit, or SQLite rolls it back, every caller gets
    /// the error and nothing was written.
    fn commit_batch(&mut self, batch: &mut Vec<Op>) {
        let size = batch.len();
        let batch_failed = |stage, source: rusqlite::Error, settled: Vec<Settle>, rest: &mut Vec<Op>| {
            let source = Arc::new(source);
            let error = || StoreError::from(Error::Batch { batch: size, stage, source: Arc::clone(&source) });
            tracing::warn!(batch = size, stage, error = %source, "idem-sqlite group commit failed");
            for s in settled {
                s(Some(error()));
            }
            for op in rest.drain(..) {
                op.reject(error());
            }
        };
        let tx = match self.conn.transaction_with_behavior(TransactionBehavior::Immediate) {
            Ok(tx) => tx,
            Err(source) => return batch_failed("begin", source, Vec::new(), batch),
        };
        let mut settled = Vec::with_capacity(size);
        let mut ops = batch.drain(..);
        while let Some(op) = ops.next() {
            if op.abandoned() {
                continue;
            }
            settled.push(op.apply(&tx, self.clock.now()));
            // Some errors (disk full, I/O error) make SQLite roll the whole transaction
            // back; then the outcomes computed so far describe writes that are gone.
            if tx.is_autocommit() {
                let mut rest: Vec<Op> = ops.collect();
                let source = rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
                    Some("SQLite rolled the group-commit transaction back after a failed statement".into()),
                );
                return batch_failed("statement", source, settled, &mut rest);
            }
        }
        drop(ops);
        match tx.commit() {
            Ok(()) => settled.into_iter().for_each(|s| s(None)),
            Err(source) => batch_failed("commit", source, settled, &mut Vec::new()),
        }
    }
}

impl Op {
    /// A claim or reclaim whose caller already gave up (its future was dropped: the client
    /// disconnected, a timeout fired). Skipping it is safe and better than applying it:
    /// nobody would run the handler, and the claim would only block retries until its
    /// lease ran out. Completions and fails are applied regardless: a stored outcome is
    /// worth keeping even when nobody waits for the acknowledgement.
    fn abandoned(&self) -> bool {
        match self {
            Op::Claim(_, reply) => reply.is_closed(),
            Op::Reclaim(_, reply) => reply.is_closed(),
            _ => false,
        }
    }

    fn apply(self, conn: &Connection, now: idem_core::UnixMillis) -> Settle {
        match self {
            Op::Claim(req, reply) => {
                let outcome = schema::select(conn, req.id).and_then(|current| {
                    let (write, outcome) = transition::claim(current.as_ref(), &req, now);
                    if let Some(r) = write {
                        if current.is_some() {
                            // Replacing an expired record: its journal is not this claim's.
                            schema::delete_journal(conn, r.id)?;
                        }
                        schema::upsert(conn, &r)?;
                    }
                    Ok(outcome)
                });
                settle(reply, outcome)
            }
            Op::Reclaim(req, reply) => {
                let outcome = schema::select(conn, req.id).and_then(|current| {
                    let (write, outcome) = transition::reclaim(current.as_ref(), &req, now);
                    write.map_or(Ok(()), |r| schema::upsert(conn, &r))?;
                    Ok(outcome)
                });
                settle(reply, outcome)
            }
            Op::Complete { id, token, response, reply } => {
                let outcome = schema::select(conn, id).and_then(|current| {
                    let next = transition::complete(current.as_ref(), id, token, response, now)
                        .map_err(|lost| StoreError::lease_lost(id, lost))?;
                    schema::upsert(conn, &next)?;
                    Ok(next)
                });
                settle(reply, outcome)
            }
            Op::Fail { id, token, reply } => {
                let outcome = schema::select(conn, id).and_then(|current| {
                    let next = transition::fail(current.as_ref(), id, token, now)
                        .map_err(|lost| StoreError::lease_lost(id, lost))?;
                    schema::upsert(conn, &next)?;
                    Ok(next)
                });
                settle(reply, outcome)
            }
            Op::Sweep { limit, reply } => {
                let outcome = schema::sweep(conn, now, limit).map(|(removed, more)| SweepOutcome { removed, more });
                settle(reply, outcome)
            }
            Op::JournalPut { id, token, name, value, overwrite, reply } => {
                let outcome = schema::select(conn, id).and_then(|current| {
                    transition::check_journal_owner(current.as_ref(), id, token, now)
                        .map_err(|lost| StoreError::lease_lost(id, lost))?;
                    if !overwrite && let Some(stored) = schema::journal_entry(conn, id, &name)? {
                        return Ok(JournalWrite::Exists(stored));
                    }
                    schema::put_journal_entry(conn, id, &name, &value)?;
                    Ok(JournalWrite::Written)
                });
                settle(reply, outcome)
            }
        }
    }

    fn reject(self, error: StoreError) {
        match self {
            Op::Claim(_, reply) => settle(reply, Err(error))(None),
            Op::Reclaim(_, reply) => settle(reply, Err(error))(None),
            Op::Complete { reply, .. } | Op::Fail { reply, .. } => settle(reply, Err(error))(None),
            Op::Sweep { reply, .. } => settle(reply, Err(error))(None),
            Op::JournalPut { reply, .. } => settle(reply, Err(error))(None),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The group commit, driven one batch at a time without the thread.

    use idem_core::{ClaimOutcome, Endpoint, Fingerprint, IdempotencyKey, ManualClock, RecordState, Scope, UnixMillis};
    use tokio::sync::oneshot::error::TryRecvError;

    use super::*;

    struct Fixture {
        writer: Writer,
        _dir: tempfile::TempDir,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("temp dir");
        let conn = SqliteStore::builder(dir.path().join("batch.sqlite3")).open_writer().expect("writer");
        let clock = Arc::new(ManualClock::new(UnixMillis(1_000_000)));
        Fixture { writer: Writer { conn, clock, max_batch: 64 }, _dir: dir }
    }

    fn req(key: &str) -> ClaimRequest {
        let scope = Scope::new("p", Endpoint::new("POST", "/e")).expect("scope");
        let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
        ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"b"), Duration::from_secs(5), Duration::from_secs(60))
    }

    fn claim(key: &str) -> (Op, oneshot::Receiver<Result<ClaimOutcome, StoreError>>) {
        let (tx, rx) = oneshot::channel();
        (Op::Claim(req(key), tx), rx)
    }

    fn outcome<T>(rx: &mut oneshot::Receiver<Result<T, StoreError>>) -> Result<T, StoreError> {
        match rx.try_recv() {
            Ok(result) => result,
            Err(TryRecvError::Empty) => panic!("the batch did not settle this operation"),
            Err(TryRecvError::Closed) => panic!("the batch dropped this operation's reply"),
        }
    }

    fn stored(f: &Fixture, key: &str) -> Option<Record> {
        schema::select(&f.writer.conn, req(key).id).expect("select")
    }

    #[test]
    fn operations_later_in_a_batch_see_earlier_ones() {
        let mut f = fixture();
        let (first, mut first_rx) = claim("k");
        let (second, mut second_rx) = claim("k");
        let (complete_tx, mut complete_rx) = oneshot::channel();
        let (fail_tx, mut fail_rx) = oneshot::channel();
        let response = StoredResponse::new(201, vec![], b"{}".to_vec());
        let id = req("k").id;
        let mut batch = vec![
            first,
            second,
            Op::Complete { id, token: FencingToken(1), response: response.clone(), reply: complete_tx },
            // The completion above already ended the claim: a late fail is fenced.
            Op::Fail { id, token: FencingToken(1), reply: fail_tx },
        ];
        f.writer.commit_batch(&mut batch);

        assert!(matches!(outcome(&mut first_rx), Ok(ClaimOutcome::Claimed(r)) if r.token == FencingToken(1)));
        assert!(
            matches!(outcome(&mut second_rx), Ok(ClaimOutcome::Existing { record, .. }) if record.state == RecordState::InFlight)
        );
        assert_eq!(outcome(&mut complete_rx).expect("complete").response, Some(response));
        assert!(outcome(&mut fail_rx).expect_err("fenced").is_lease_lost());
        assert_eq!(stored(&f, "k").map(|r| r.state), Some(RecordState::Completed));
    }

    #[test]
    fn a_claim_whose_caller_gave_up_is_not_written() {
        //! A claim nobody waits for anymore must not block the client's retry for a lease.
        let mut f = fixture();
        let (gone, gone_rx) = claim("gone");
        drop(gone_rx);
        let (kept, mut kept_rx) = claim("kept");
        f.writer.commit_batch(&mut vec![gone, kept]);
        assert!(stored(&f, "gone").is_none());
        assert!(matches!(outcome(&mut kept_rx), Ok(ClaimOutcome::Claimed(_))));
    }

    #[test]
    fn a_failed_statement_fails_only_its_caller() {
        //! A statement error SQLite undoes by itself (constraint, RAISE(ABORT)) must not
        //! take the other callers of the batch down with it.
        let mut f = fixture();
        f.writer
            .conn
            .execute_batch(
                "CREATE TRIGGER poison BEFORE INSERT ON idem_records WHEN NEW.key = 'poison' \
                 BEGIN SELECT RAISE(ABORT, 'poisoned'); END;",
            )
            .expect("trigger");
        let (a, mut a_rx) = claim("a");
        let (p, mut p_rx) = claim("poison");
        let (b, mut b_rx) = claim("b");
        f.writer.commit_batch(&mut vec![a, p, b]);
        assert!(matches!(outcome(&mut a_rx), Ok(ClaimOutcome::Claimed(_))));
        assert!(!outcome(&mut p_rx).expect_err("poisoned").is_retryable());
        assert!(matches!(outcome(&mut b_rx), Ok(ClaimOutcome::Claimed(_))));
        assert!(stored(&f, "a").is_some() && stored(&f, "b").is_some());
        assert!(stored(&f, "poison").is_none());
    }

    #[test]
    fn a_rolled_back_transaction_fails_every_caller_and_writes_nothing() {
        //! When SQLite rolls the whole transaction back mid-batch, outcomes already
        //! computed describe writes that are gone: nobody may hear "claimed".
        let mut f = fixture();
        f.writer
            .conn
            .execute_batch(
                "CREATE TRIGGER poison BEFORE INSERT ON idem_records WHEN NEW.key = 'poison' \
                 BEGIN SELECT RAISE(ROLLBACK, 'poisoned'); END;",
            )
            .expect("trigger");
        let (a, mut a_rx) = claim("a");
        let (p, mut p_rx) = claim("poison");
        let (b, mut b_rx) = claim("b");
        f.writer.commit_batch(&mut vec![a, p, b]);
        for rx in [&mut a_rx, &mut p_rx, &mut b_rx] {
            let err = outcome(rx).expect_err("whole batch failed");
            assert!(err.to_string().contains("group commit of 3 operations failed"), "{err}");
        }
        assert!(stored(&f, "a").is_none() && stored(&f, "b").is_none());
        // The connection is usable again: the next batch commits.
        let (a, mut a_rx) = claim("a");
        f.writer.commit_batch(&mut vec![a]);
        assert!(matches!(outcome(&mut a_rx), Ok(ClaimOutcome::Claimed(_))));
    }

    #[test]
    fn a_failed_commit_fails_every_caller_and_writes_nothing() {
        //! A COMMIT that fails (here a deferred foreign key) must reach every caller of
        //! the batch as an error, and leave none of the batch behind.
        let mut f = fixture();
        f.writer
            .conn
            .execute_batch(
                "PRAGMA foreign_keys = ON;
                 CREATE TABLE parent (x INTEGER PRIMARY KEY);
                 CREATE TABLE child (x INTEGER REFERENCES parent (x) DEFERRABLE INITIALLY DEFERRED);
                 CREATE TRIGGER dangling AFTER INSERT ON idem_records WHEN NEW.key = 'dangling'
                 BEGIN INSERT INTO child VALUES (42); END;",
            )
            .expect("schema");
        let (a, mut a_rx) = claim("a");
        let (d, mut d_rx) = claim("dangling");
        f.writer.commit_batch(&mut vec![a, d]);
        for rx in [&mut a_rx, &mut d_rx] {
            let err = outcome(rx).expect_err("commit failed");
            assert!(err.to_string().contains("failed at commit"), "{err}");
        }
        assert!(stored(&f, "a").is_none() && stored(&f, "dangling").is_none());
    }
}
