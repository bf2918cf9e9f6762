//! [`RedbStore`]: the [`Store`] on one redb file, its configuration and its tables.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::codec;
use idem_core::store::JournalWrite;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, FencingToken, ReclaimOutcome, ReclaimRequest, Record, RecordId,
    Store, StoreError, StoredResponse, SweepOutcome, SystemClock,
};
use redb::{Database, ReadTransaction, ReadableDatabase, TableDefinition};
use tokio::sync::oneshot;

use crate::error::RedbStoreError;
use crate::queue::Queue;
use crate::writer::{Op, Writer};

/// Records: record id (32 bytes) -> [`idem_core::codec::encode`]d record (one
/// format-version byte, then postcard).
pub const RECORDS: TableDefinition<'static, &'static [u8; 32], &'static [u8]> = TableDefinition::new("idem_records");

/// The expiry index: (`expires_at` in ms since the epoch, record id) -> `()`. redb orders
/// `i64` keys numerically and tuples field by field, so a range scan up to `(now, max id)`
/// visits exactly the expired records, oldest first, without reading the records table.
/// Every write that changes a record's `expires_at` moves its entry in the same write
/// transaction, so the index holds exactly one entry per record.
pub const EXPIRY: TableDefinition<'static, (i64, [u8; 32]), ()> = TableDefinition::new("idem_expiry");

/// The journal of resumable handlers (steps, intents): (record id, entry name) -> value
/// bytes. Entries live and die with their record: the sweep that removes a record and the
/// claim that replaces an expired one remove its entries in the same write transaction.
pub const JOURNAL: TableDefinition<'static, (&'static [u8; 32], &'static str), &'static [u8]> =
    TableDefinition::new("idem_journal");

/// How commits reach the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// Every batch commits with redb's `Durability::Immediate`: when a caller gets its
    /// outcome, the write is on disk (fsync'd). The default, and what the idempotency
    /// guarantee needs: a claim or a completed response that a crash can take back lets
    /// a retry run the handler a second time.
    #[default]
    Immediate,
    /// Batches commit with redb's `Durability::None` (no fsync) and a durable commit is
    /// made at least every `max_unflushed` (and when the writer stops).
    ///
    /// Risk: a process crash or power loss loses up to `max_unflushed` of acknowledged
    /// writes. A lost completion makes the next retry run the handler again (a duplicate
    /// side effect unless the handler uses sub-keys); a lost claim lets a retry run while
    /// the first attempt is still running (two concurrent executions); a lost reclaim
    /// rewinds the fencing token, so an owner that was fenced out can complete again.
    /// Use it only where the handler's effects are themselves idempotent downstream.
    Eventual {
        /// Upper bound on the age of the oldest write that is not yet durable.
        max_unflushed: Duration,
    },
}

/// How long the writer waits for more operations before it applies a batch.
///
/// Batching happens without any wait: every operation that arrives while a commit is in
/// progress joins the next batch. A short wait only helps when callers answer a batch's
/// replies with new operations a few microseconds apart (32 callers doing claim then
/// complete): without it, the first caller back starts a small batch and the rest wait
/// for the one after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Linger {
    /// Never wait: a batch is whatever is queued when the writer is ready.
    None,
    /// Wait at most `max` for the batch to grow to the size of the previous batch (the
    /// recent concurrency), never past [`RedbConfig::max_batch`]. A lone caller (previous
    /// batch of one) never waits; under load, batches fill up instead of splitting.
    Adaptive {
        /// Longest wait per batch.
        max: Duration,
    },
    /// Wait up to this long after the first operation for the batch to reach
    /// [`RedbConfig::max_batch`]: every batch that does not fill adds this much latency.
    Fixed(Duration),
}

/// How a [`RedbStore`] batches and commits, and which clock it reads.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RedbConfig {
    /// Most operations applied in one write transaction (default 256). A larger batch
    /// amortises one commit (one fsync, about 0.4 ms on a typical disk) over more callers
    /// but makes the commit, and so every caller in it, wait for more work. Zero counts as 1.
    pub max_batch: usize,
    /// Whether and how long the writer waits for more operations once it has taken what
    /// is queued (default [`Linger::Adaptive`] with 200 µs).
    pub linger: Linger,
    /// Commit durability (default [`Durability::Immediate`]).
    pub durability: Durability,
    /// Whether a claim first looks its record up in a read transaction and, when it finds
    /// a live (unexpired) record, answers [`ClaimOutcome::Existing`] from it without
    /// entering the writer (default `true`). Such a claim would write nothing, so it takes
    /// effect at that read; every acknowledged write is visible to it, because the writer
    /// answers a caller only after the commit that holds its write. Only claims that find
    /// no record, or an expired one, queue for a batch, so replays stop waiting for and
    /// diluting group commits. With `false`, every claim is applied by the writer in the
    /// order it was handed over (the batch semantics that `tests/batch_model.rs` pins).
    pub claim_reads: bool,
    /// The clock every `now` is read from (default [`SystemClock`]); tests pass an
    /// [`idem_core::ManualClock`].
    pub clock: Arc<dyn Clock>,
}

impl Default for RedbConfig {
    fn default() -> Self {
        Self {
            max_batch: 256,
            linger: Linger::Adaptive { max: Duration::from_micros(200) },
            durability: Durability::Immediate,
            claim_reads: true,
            clock: Arc::new(SystemClock),
        }
    }
}

impl RedbConfig {
    /// Sets [`RedbConfig::max_batch`].
    #[must_use]
    pub fn with_max_batch(mut self, ops: usize) -> Self {
        self.max_batch = ops;
        self
    }

    /// Sets [`RedbConfig::linger`].
    #[must_use]
    pub fn with_linger(mut self, linger: Linger) -> Self {
        self.linger = linger;
        self
    }

    /// Sets [`RedbConfig::durability`].
    #[must_use]
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Sets [`RedbConfig::claim_reads`].
    #[must_use]
    pub fn with_claim_reads(mut self, on: bool) -> Self {
        self.claim_reads = on;
        self
    }

    /// Sets [`RedbConfig::clock`].
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }
}

/// Counters of the writer thread, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Write transactions the writer attempted (one per batch).
    pub batches: u64,
    /// Operations it received.
    pub operations: u64,
    /// Batches that failed as a whole (a transaction that would not begin, a write or a
    /// commit that failed, a panic); every caller in them got an error.
    pub failed_batches: u64,
    /// Batches that changed nothing (every operation found a live record or lost its
    /// lease), aborted instead of committed: no fsync. Counted in `batches` too.
    pub read_only_batches: u64,
    /// Claims answered [`ClaimOutcome::Existing`] from a read transaction, without the
    /// writer ([`RedbConfig::claim_reads`]); not counted in `operations`.
    pub claims_read: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) batches: AtomicU64,
    pub(crate) operations: AtomicU64,
    pub(crate) failed_batches: AtomicU64,
    pub(crate) read_only_batches: AtomicU64,
    pub(crate) claims_read: AtomicU64,
}

/// The [`Store`] on one redb file, with group commit.
///
/// One writer thread owns all write transactions. A `claim` that finds a live record
/// answers `Existing` from a read transaction ([`RedbConfig::claim_reads`]); every other
/// `claim`, and `reclaim`, `complete`, `fail`, `sweep` and `journal_put`, hand their
/// operation to the writer through a queue and wait for its reply; the
/// writer applies up to [`RedbConfig::max_batch`] waiting operations in one write
/// transaction (each sees the effects of the ones before it, through the shared
/// [`idem_core::transition`] rules), commits once, and then answers each caller with its
/// own outcome (a batch that wrote nothing is aborted instead: there is nothing to make
/// durable). If the commit fails, nothing in the batch was applied and every caller in
/// it gets the error. `get` runs a read transaction on tokio's blocking pool, so the store
/// is used from inside a tokio runtime.
///
/// An operation is applied even if its caller stops waiting (drops the future) after
/// handing it over; a claim made that way is held until its lease expires, as if the
/// caller had crashed.
///
/// Clones share the writer. When the last clone is dropped the writer answers the
/// operations already queued and stops, and the drop waits for it, so the file can be
/// opened again right after (unless the application still holds the [`Database`] from
/// [`RedbStore::database`]).
#[derive(Clone)]
pub struct RedbStore {
    inner: Arc<Inner>,
}

struct Inner {
    db: Arc<Database>,
    clock: Arc<dyn Clock>,
    config: RedbConfig,
    counters: Arc<Counters>,
    queue: Arc<Queue<Op>>,
    writer: Option<JoinHandle<()>>,
}

impl fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedbStore")
            .field("config", &self.inner.config)
            .field("stats", &self.batch_stats())
            .finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the queue is the writer's signal to stop once it has answered every
        // operation already queued.
        self.queue.close();
        if let Some(writer) = self.writer.take() {
            // A panicked writer has already failed its callers (their replies were
            // dropped); there is nothing more to report from a destructor.
            let _ = writer.join();
        }
    }
}

impl RedbStore {
    /// Opens (or creates) the redb file at `path` and starts the writer.
    ///
    /// Blocks (file I/O, a repair after a crash, one commit): call it at start-up, or from
    /// `tokio::task::spawn_blocking`.
    ///
    /// # Errors
    /// [`RedbStoreError::Open`] when redb cannot open the file (for example it is already
    /// open, in this process or another); table and transaction errors from creating the
    /// store's tables; [`RedbStoreError::Spawn`] when the writer thread cannot start.
    pub fn open(path: impl AsRef<Path>, config: RedbConfig) -> Result<Self, RedbStoreError> {
        let db = Database::create(path)?;
        Self::open_with(Arc::new(db), config)
    }

    /// Runs the store on a database the application already opened, so the application
    /// can keep its own tables in the same file. The store only touches [`RECORDS`] and
    /// [`EXPIRY`]. The application's own write transactions serialise with the writer's
    /// batches (redb allows one write transaction at a time); keep them short.
    ///
    /// # Errors
    /// As [`RedbStore::open`], minus opening the file.
    pub fn open_with(db: Arc<Database>, config: RedbConfig) -> Result<Self, RedbStoreError> {
        // Create both tables up front so that readers never meet a missing table.
        let txn = db.begin_write()?;
        txn.open_table(RECORDS).map_err(|source| RedbStoreError::Table { table: "idem_records", source })?;
        txn.open_table(EXPIRY).map_err(|source| RedbStoreError::Table { table: "idem_expiry", source })?;
        txn.open_table(JOURNAL).map_err(|source| RedbStoreError::Table { table: "idem_journal", source })?;
        txn.commit()?;

        let counters = Arc::new(Counters::default());
        let queue = Arc::new(Queue::new());
        let writer =
            Writer::new(Arc::clone(&db), Arc::clone(&config.clock), &config, Arc::clone(&counters), Arc::clone(&queue));
        let handle = std::thread::Builder::new()
            .name("idem-redb-writer".into())
            .spawn(move || writer.run())
            .map_err(RedbStoreError::Spawn)?;
        Ok(Self {
            inner: Arc::new(Inner {
                db,
                clock: Arc::clone(&config.clock),
                config,
                counters,
                queue,
                writer: Some(handle),
            }),
        })
    }

    /// The underlying database, for the application's own tables.
    #[must_use]
    pub fn database(&self) -> Arc<Database> {
        Arc::clone(&self.inner.db)
    }

    /// The configuration the store runs with.
    #[must_use]
    pub fn config(&self) -> &RedbConfig {
        &self.inner.config
    }

    /// What the writer has done so far.
    #[must_use]
    pub fn batch_stats(&self) -> BatchStats {
        let c = &self.inner.counters;
        BatchStats {
            batches: c.batches.load(Ordering::Relaxed),
            operations: c.operations.load(Ordering::Relaxed),
            failed_batches: c.failed_batches.load(Ordering::Relaxed),
            read_only_batches: c.read_only_batches.load(Ordering::Relaxed),
            claims_read: c.claims_read.load(Ordering::Relaxed),
        }
    }

    /// Hands one operation to the writer and waits for its outcome.
    async fn submit<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.inner.queue.push(make(reply)).map_err(|_| RedbStoreError::WriterStopped)?;
        // A dropped reply means the writer died (panicked) before answering.
        answer.await.map_err(|_| RedbStoreError::WriterStopped)?
    }
}

impl RedbStore {
    /// The claim's outcome if it finds a live record, read without the writer; `None`
    /// sends the claim to the writer (no record, an expired one, or any read error: the
    /// writer re-reads inside its transaction and is the authority).
    ///
    /// Runs on the caller's thread, before the first `.await`: a redb read transaction
    /// never waits for the writer (readers see the last commit), and a point lookup is a
    /// few B-tree pages, normally in redb's cache. Staying on the caller's thread also
    /// keeps hand-over order: a claim that goes on to the writer is queued in the order
    /// its future was first polled.
    fn claim_from_read(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        let txn = self.inner.db.begin_read().ok()?;
        let current = read_record(&txn, req.id).ok()??;
        // `now` is read after the snapshot: a record live now was live at the snapshot.
        let now = self.inner.clock.now();
        if current.is_expired(now) {
            return None;
        }
        let (write, outcome) = idem_core::transition::claim(Some(&current), req, now);
        if write.is_some() {
            return None;
        }
        self.inner.counters.claims_read.fetch_add(1, Ordering::Relaxed);
        Some(outcome)
    }
}

/// Reads and decodes one record (blocking).
fn read_record(txn: &ReadTransaction, id: RecordId) -> Result<Option<Record>, StoreError> {
    let table = txn.open_table(RECORDS).map_err(|source| RedbStoreError::Table { table: "idem_records", source })?;
    let Some(value) = table.get(&id.0).map_err(RedbStoreError::from)? else {
        return Ok(None);
    };
    codec::decode(value.value()).map(Some).map_err(|source| StoreError::Corrupt { id: Some(id), source })
}

/// Reads a journal entry and its record in one read transaction (blocking).
fn read_journal(
    txn: &ReadTransaction,
    id: RecordId,
    name: &str,
) -> Result<(Option<Record>, Option<Vec<u8>>), StoreError> {
    let record = read_record(txn, id)?;
    let table = txn.open_table(JOURNAL).map_err(|source| RedbStoreError::Table { table: "idem_journal", source })?;
    let value = table.get((&id.0, name)).map_err(RedbStoreError::from)?;
    Ok((record, value.map(|v| v.value().to_vec())))
}

#[async_trait]
impl Store for RedbStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        if self.inner.config.claim_reads
            && let Some(outcome) = self.claim_from_read(&req)
        {
            return Ok(outcome);
        }
        self.submit(|reply| Op::Claim { req, reply }).await
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.submit(|reply| Op::Reclaim { req, reply }).await
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
        let db = Arc::clone(&self.inner.db);
        let record =
            tokio::task::spawn_blocking(move || read_record(&db.begin_read().map_err(RedbStoreError::from)?, id))
                .await
                .map_err(RedbStoreError::Join)??;
        let now = self.inner.clock.now();
        Ok(record.filter(|r| !r.is_expired(now)))
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.submit(|reply| Op::Sweep { limit, reply }).await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new().with_journal(true)
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
        let db = Arc::clone(&self.inner.db);
        let name = name.to_owned();
        let (record, value) = tokio::task::spawn_blocking(move || {
            read_journal(&db.begin_read().map_err(RedbStoreError::from)?, id, &name)
        })
        .await
        .map_err(RedbStoreError::Join)??;
        // The entries of an expired (not yet swept) record are gone, as the record is.
        let now = self.inner.clock.now();
        Ok(value.filter(|_| record.is_some_and(|r| !r.is_expired(now))))
    }
}
