//! Group commit (feature `group-commit`): one writer thread that applies every waiting
//! write of an embedded store in one transaction and commits once, and [`Embedded`], the
//! [`crate::Store`] of every store built on it.
//!
//! A durable commit costs one fsync (about 0.4 ms on a typical disk), so a store that
//! commits each claim and each completion on its own tops out near a thousand writes per
//! second. [`GroupCommit`] takes the first waiting operation, everything else already
//! queued (up to [`BatchConfig::with_max_batch`]), lingers briefly for more
//! ([`BatchConfig::with_linger`]), applies them in arrival order through [`crate::engine`] inside one
//! transaction of the store's [`Engine`], commits once, and only then answers each caller
//! with its own outcome, of its own type. Later operations in a batch see the earlier ones
//! exactly as if each had committed on its own: two claims of one id in one batch give
//! `Claimed` then `Existing`.
//!
//! This is the one piece of `idem-core` that owns a thread; the rules it applies stay the
//! pure ones. redb and SQLite are [`Embedded`] stores over it, and so can any embedded
//! engine with transactions be: it supplies an [`Engine`] (write transactions) and read
//! views, and gets the whole [`crate::Store`].
//!
//! # Behaviour (the same for every store on it)
//! - **Own outcomes stay own.** An operation refused before it changed anything
//!   (`LeaseLost`, a corrupt record, a value the engine will not take) fails only its caller;
//!   the batch goes on.
//! - **A failed transaction fails exactly its batch.** If the transaction cannot begin or
//!   commit, if an operation fails after it changed something, or if the table reports
//!   itself poisoned, nothing of the batch is committed and every caller in it gets the
//!   same [`StoreError::Unavailable`] ("group commit of N operations failed at STAGE"),
//!   retryable when the cause is. The next batch starts afresh.
//! - **A panic is a failed batch.** A panic while applying a batch (a bug, an engine
//!   assertion on a damaged file) drops its transaction uncommitted; its callers get an
//!   error and the writer goes on with the next batch.
//! - **Nothing to write, nothing to commit.** A batch that changed nothing (claims that
//!   found live records, lost leases) is aborted instead of committed: no fsync.
//! - **Abandoned claims are skipped.** A claim or reclaim whose caller stopped waiting
//!   before its batch ran is not applied: nobody would run the handler, and the claim would
//!   only lock the key for a lease. Completions, fails, journal writes and sweeps are
//!   applied even when nobody waits for them.
//! - **Claims of live records need no writer.** An [`Embedded`] store answers a claim that
//!   finds a live record from a read view, so replays never wait for, or dilute, a group
//!   commit.

mod embedded;
mod job;
mod queue;

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

pub use embedded::Embedded;
pub(crate) use job::Unawaited;
use job::{Applied, Caller, Job, Op};
use queue::{Next, Queue};

use crate::record::Record;
use crate::settle::Settlements;
use crate::store::StoreError;
use crate::table::{Expired, RecordRead, RecordTable};
use crate::time::{Clock, UnixMillis};
use crate::transition::{ClaimOutcome, ClaimRequest};

/// Where a transaction failed as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// The transaction would not begin.
    Begin,
    /// An operation failed after it changed something, or the table was poisoned.
    Apply,
    /// The commit failed.
    Commit,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Begin => "begin",
            Stage::Apply => "apply",
            Stage::Commit => "commit",
        })
    }
}

/// A transaction that failed as a whole.
#[derive(Debug)]
pub struct TransactionFailed {
    /// Where.
    pub stage: Stage,
    /// Why.
    pub error: StoreError,
}

/// A store's transactions, as the writer thread drives them.
pub trait Engine: Send + 'static {
    /// The backend's name in errors, e.g. `redb`.
    fn backend(&self) -> &'static str;

    /// Runs one write transaction: begins it, hands its table to `apply`, then commits
    /// durably (the commit is on disk when this returns) when `apply` returns `true` and
    /// aborts (rolls back) when it returns `false`.
    ///
    /// # Errors
    /// [`TransactionFailed`] at [`Stage::Begin`] or [`Stage::Commit`]; nothing of the
    /// transaction may be visible afterwards.
    fn transaction(&mut self, apply: &mut dyn FnMut(&mut dyn RecordTable) -> bool) -> Result<(), TransactionFailed>;
}

/// How a [`GroupCommit`] batches.
///
/// Batching happens without any wait: every operation that arrives while a commit is in
/// progress joins the next batch. After taking what is queued, the writer lingers a little
/// (default 200 µs) for the batch to grow to the size of the previous batch (the recent
/// concurrency), never past the maximum: when callers answer a batch's replies with new
/// operations a few microseconds apart (32 callers doing claim then complete), the first
/// caller back would otherwise start a small batch and the rest wait for the one after. A
/// lone caller (previous batch of one) never waits.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct BatchConfig {
    max_batch: usize,
    linger: Duration,
    /// Linger until the batch is full rather than as large as the last one.
    fill: bool,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self { max_batch: 256, linger: Duration::from_micros(200), fill: false }
    }
}

impl BatchConfig {
    crate::setters! {
        /// Most operations applied in one transaction (default 256; zero counts as 1). A larger
        /// batch shares one commit (one fsync) among more callers but makes each of them wait
        /// for the whole batch.
        pub fn with_max_batch(ops: usize) => max_batch = ops.max(1);

        /// Longest wait for a batch to grow to the previous batch's size (default 200 µs; zero
        /// never waits).
        pub fn with_linger(linger: Duration) => linger = linger;
    }

    /// Feature `test-util`: every batch waits up to `wait` to fill to the maximum, so a test
    /// can put exactly the operations it sends into one batch.
    #[cfg(feature = "test-util")]
    pub fn with_full_batches(mut self, wait: Duration) -> Self {
        self.linger = wait;
        self.fill = true;
        self
    }
}

/// What the writer has done so far (for tests, benchmarks and metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchStats {
    /// Transactions attempted (one per batch).
    pub batches: u64,
    /// Operations received by the writer.
    pub operations: u64,
    /// Batches that failed as a whole (begin, apply, commit, a panic); every caller in them
    /// got an error.
    pub failed_batches: u64,
    /// Batches that changed nothing and were aborted instead of committed (no fsync).
    /// Counted in `batches` too.
    pub read_only_batches: u64,
    /// Claims answered from a read view without the writer; not counted in `operations`.
    pub claims_read: u64,
    /// Claims and reclaims skipped because their caller had stopped waiting.
    pub abandoned_claims: u64,
}

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    operations: AtomicU64,
    failed_batches: AtomicU64,
    read_only_batches: AtomicU64,
    claims_read: AtomicU64,
    abandoned_claims: AtomicU64,
}

/// The writer an [`Embedded`] store holds: it queues the store's operations and reports
/// statistics. Clones share the writer; when the last clone is dropped the writer answers
/// what is queued and stops, and the drop waits for it (so the file can be opened again
/// right after).
#[derive(Clone)]
pub struct GroupCommit {
    shared: Arc<Shared>,
}

struct Shared {
    backend: &'static str,
    clock: Arc<dyn Clock>,
    queue: Arc<Queue<Box<dyn Job>>>,
    counters: Arc<Counters>,
    writer: Mutex<Option<JoinHandle<()>>>,
    settlements: Settlements,
}

impl fmt::Debug for GroupCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupCommit").field("backend", &self.shared.backend).field("stats", &self.stats()).finish()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Closing the queue is the writer's signal to stop once it has answered every
        // operation already queued.
        self.queue.close();
        let writer = self.writer.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(writer) = writer {
            // A panic that escaped the writer already failed its callers (their replies
            // were dropped); there is nothing more to report from a destructor.
            let _ = writer.join();
        }
    }
}

impl GroupCommit {
    /// Starts the writer thread on `engine`; every operation reads `now` from `clock` when
    /// it is applied, so `now` never runs backwards within a batch.
    ///
    /// # Errors
    /// The operating system's error when the thread cannot start.
    pub fn start<E: Engine>(engine: E, clock: Arc<dyn Clock>, config: BatchConfig) -> std::io::Result<Self> {
        let backend = engine.backend();
        let queue = Arc::new(Queue::new());
        let counters = Arc::new(Counters::default());
        let writer = Writer {
            engine,
            clock: Arc::clone(&clock),
            last_batch: 1,
            config: config.clone(),
            counters: Arc::clone(&counters),
            queue: Arc::clone(&queue),
        };
        let handle = std::thread::Builder::new().name(format!("idem-{backend}-writer")).spawn(move || writer.run())?;
        let writer = Mutex::new(Some(handle));
        Ok(Self {
            shared: Arc::new(Shared { backend, clock, queue, counters, writer, settlements: Default::default() }),
        })
    }

    /// Hands `apply` to the writer and waits for its outcome, which arrives only after the
    /// commit that holds it (or with the batch's error).
    ///
    /// # Errors
    /// The operation's own refusal, its batch's failure, or an error when the writer has
    /// stopped.
    pub(crate) async fn submit<R, F>(&self, unawaited: Unawaited, apply: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut dyn RecordTable, UnixMillis) -> Result<R, StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        if self.shared.queue.push(Box::new(Op::new(apply, reply, unawaited))).is_err() {
            return Err(self.stopped());
        }
        // A dropped reply means its batch panicked, or the writer is gone.
        answer.await.map_err(|_| self.dropped())?
    }

    /// The outcome of a claim of `req` if `view` shows a live record (the claim would write
    /// nothing, so it takes effect at this read); `None` when the claim must go to the
    /// writer: no record, an expired one, or a read error (the writer looks again inside
    /// its transaction and is the authority).
    pub(crate) fn claim_from_view(&self, view: &dyn RecordRead, req: &ClaimRequest) -> Option<ClaimOutcome> {
        let record = view.read(req.id()).ok()??;
        // `now` is read after the read: a record live now was live when it was read.
        let now = self.shared.clock.now();
        if record.is_expired(now) {
            return None;
        }
        self.shared.counters.claims_read.fetch_add(1, Ordering::Relaxed);
        Some(ClaimOutcome::Existing { record, now })
    }

    /// The clock every `now` of this store is read from.
    pub(crate) fn clock(&self) -> &dyn Clock {
        &*self.shared.clock
    }

    /// The waiters of this writer's records: one writer per open store, so the completions
    /// of its handle and clones.
    pub(crate) fn settlements(&self) -> &Settlements {
        &self.shared.settlements
    }

    /// The backend's name, for errors.
    pub(crate) fn backend(&self) -> &'static str {
        self.shared.backend
    }

    /// What the writer has done so far.
    #[must_use]
    pub fn stats(&self) -> BatchStats {
        let c = &self.shared.counters;
        BatchStats {
            batches: c.batches.load(Ordering::Relaxed),
            operations: c.operations.load(Ordering::Relaxed),
            failed_batches: c.failed_batches.load(Ordering::Relaxed),
            read_only_batches: c.read_only_batches.load(Ordering::Relaxed),
            claims_read: c.claims_read.load(Ordering::Relaxed),
            abandoned_claims: c.abandoned_claims.load(Ordering::Relaxed),
        }
    }

    fn stopped(&self) -> StoreError {
        StoreError::unavailable(self.shared.backend, "the group-commit writer has stopped", false, "writer stopped")
    }

    fn dropped(&self) -> StoreError {
        StoreError::unavailable(
            self.shared.backend,
            "the group-commit writer dropped this operation (its batch panicked; nothing in it was applied)",
            false,
            "operation dropped",
        )
    }
}

/// The same batch failure, as each caller of the batch receives it.
fn batch_error(backend: &'static str, size: usize, stage: Stage, cause: &Arc<StoreError>) -> StoreError {
    StoreError::unavailable(
        backend,
        format!("group commit of {size} operations failed at {stage}"),
        cause.is_retryable(),
        Arc::clone(cause),
    )
}

/// Closes the queue when dropped, however the writer loop ends.
struct CloseOnExit(Arc<Queue<Box<dyn Job>>>);

impl Drop for CloseOnExit {
    fn drop(&mut self) {
        drop(self.0.close_and_take());
    }
}

/// Counts the writes of one operation, so the executor knows whether a failing operation
/// left anything behind and whether a batch wrote at all. A write that fails without
/// poisoning the table changed nothing (the table's contract), so it does not count: a
/// value the engine refuses fails only its own caller.
struct Tracked<'t> {
    table: &'t mut dyn RecordTable,
    wrote: bool,
}

impl Tracked<'_> {
    fn count<T>(&mut self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        self.wrote |= result.is_ok();
        result
    }
}

impl RecordRead for Tracked<'_> {
    fn read(&self, id: crate::RecordId) -> Result<Option<Record>, StoreError> {
        self.table.read(id)
    }
    fn journal_read(&self, id: crate::RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.table.journal_read(id, name)
    }
}

impl RecordTable for Tracked<'_> {
    fn write(&mut self, old: Option<&Record>, new: &Record) -> Result<(), StoreError> {
        let result = self.table.write(old, new);
        self.count(result)
    }
    // Forwarded, not left to the default (which writes a borrowed record): the owned
    // record reaches the table, and a table that keeps records as values takes it without
    // a copy.
    fn write_owned(&mut self, old: Option<&Record>, new: Record) -> Result<(), StoreError> {
        let result = self.table.write_owned(old, new);
        self.count(result)
    }
    fn create(&mut self, new: &Record) -> Result<Option<Record>, StoreError> {
        // Finding a stored record writes nothing, whatever the table did to find it.
        let result = self.table.create(new);
        self.wrote |= matches!(result, Ok(None));
        result
    }
    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<Expired>, StoreError> {
        self.table.expired(now, limit)
    }
    fn remove(&mut self, expired: Expired) -> Result<(), StoreError> {
        let result = self.table.remove(expired);
        self.count(result)
    }
    fn journal_write(&mut self, id: crate::RecordId, name: &str, value: &[u8]) -> Result<(), StoreError> {
        let result = self.table.journal_write(id, name, value);
        self.count(result)
    }
    fn journal_clear(&mut self, id: crate::RecordId) -> Result<(), StoreError> {
        // Clearing may find nothing to remove; counting it as a write only costs a commit
        // in the rare case of a claim replacing an expired record without entries.
        let result = self.table.journal_clear(id);
        self.count(result)
    }
    fn is_poisoned(&self) -> bool {
        self.table.is_poisoned()
    }
}

struct Writer<E> {
    engine: E,
    clock: Arc<dyn Clock>,
    config: BatchConfig,
    /// Size of the last batch, the adaptive linger's target.
    last_batch: usize,
    counters: Arc<Counters>,
    queue: Arc<Queue<Box<dyn Job>>>,
}

impl<E: Engine> Writer<E> {
    /// Runs until the queue is closed and every queued operation is answered.
    fn run(mut self) {
        let _closer = CloseOnExit(Arc::clone(&self.queue));
        let mut batch = Vec::with_capacity(self.config.max_batch);
        while let Some(first) = self.next_first() {
            batch.push(first);
            self.fill(&mut batch);
            let jobs = std::mem::take(&mut batch);
            // A panic while applying a batch must not take the store down: the batch's
            // transaction is dropped uncommitted, its callers see their replies dropped,
            // and the next batch starts fresh.
            if std::panic::catch_unwind(AssertUnwindSafe(|| self.run_batch(jobs))).is_err() {
                self.counters.failed_batches.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    backend = self.engine.backend(),
                    "group-commit writer panicked while applying a batch; nothing in it was committed"
                );
            }
        }
    }

    /// Waits for the first operation of the next batch; `None` once the store is dropped.
    fn next_first(&mut self) -> Option<Box<dyn Job>> {
        loop {
            match self.queue.next(None) {
                Next::Item(job) => return Some(job),
                Next::Timeout => {}
                Next::Closed => return None,
            }
        }
    }

    /// Adds what is already queued, then lingers for more (see [`BatchConfig`]).
    fn fill(&mut self, batch: &mut Vec<Box<dyn Job>>) {
        let max = self.config.max_batch;
        self.queue.drain_into(batch, max);
        let wait = self.config.linger;
        let target = if self.config.fill { max } else { self.last_batch.min(max) };
        if batch.len() < target && !wait.is_zero() {
            let deadline = Instant::now() + wait;
            while batch.len() < target {
                match self.queue.next(Some(deadline)) {
                    Next::Item(job) => {
                        batch.push(job);
                        // Take whatever came with it in the same lock.
                        self.queue.drain_into(batch, target);
                    }
                    Next::Timeout | Next::Closed => break,
                }
            }
        }
        self.last_batch = batch.len();
    }

    fn run_batch(&mut self, jobs: Vec<Box<dyn Job>>) {
        let size = jobs.len();
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.operations.fetch_add(size as u64, Ordering::Relaxed);
        let backend = self.engine.backend();
        #[cfg(feature = "metrics")]
        metrics::histogram!("idem_group_commit_batch_size", "backend" => backend).record(size as f64);
        tracing::trace!(backend, batch = size, "group commit batch");
        let clock = Arc::clone(&self.clock);
        let counters = Arc::clone(&self.counters);
        let mut pending = jobs.into_iter();
        // Every outcome, refusals included, waits for the commit: a refusal decided on
        // writes of this batch is only true once they are committed.
        let mut done: Vec<Applied> = Vec::with_capacity(size);
        // The operation that broke the transaction, and why.
        let mut fault: Option<(Box<dyn Caller>, StoreError)> = None;
        let mut wrote = false;
        let result = self.engine.transaction(&mut |table| {
            for job in pending.by_ref() {
                if job.abandoned() {
                    counters.abandoned_claims.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let mut tracked = Tracked { table: &mut *table, wrote: false };
                let applied = job.apply(&mut tracked, clock.now());
                wrote |= tracked.wrote;
                let poisoned = tracked.is_poisoned();
                match applied {
                    // An operation that failed half-way, or an engine that undid the
                    // transaction: outcomes computed so far may describe writes that will
                    // not be committed, so nobody of this batch may hear "done".
                    Err(refused) if tracked.wrote || poisoned => {
                        fault = Some(refused);
                        return false;
                    }
                    Ok(answer) if poisoned => {
                        let error = StoreError::unavailable(
                            backend,
                            "the engine rolled the transaction back",
                            true,
                            "transaction rolled back",
                        );
                        fault = Some((answer as Box<dyn Caller>, error));
                        return false;
                    }
                    applied => done.push(applied),
                }
            }
            wrote
        });
        let (fault_caller, fault) = fault.map_or((None, None), |(caller, error)| (Some(caller), Some(error)));
        let failure = match (result, fault) {
            (Err(TransactionFailed { stage, error }), _) => Some((stage, error)),
            (Ok(()), Some(error)) => Some((Stage::Apply, error)),
            (Ok(()), None) => None,
        };
        match failure {
            Some((stage, error)) => {
                self.counters.failed_batches.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(backend, batch = size, %stage, %error, "group commit failed; nothing in it was committed");
                let cause = Arc::new(error);
                let applied = done.into_iter().map(|applied| match applied {
                    Ok(answer) => answer as Box<dyn Caller>,
                    Err((caller, _)) => caller,
                });
                let unapplied = pending.map(|job| job as Box<dyn Caller>);
                for caller in applied.chain(fault_caller).chain(unapplied) {
                    caller.fail(batch_error(backend, size, stage, &cause));
                }
            }
            None => {
                if !wrote {
                    self.counters.read_only_batches.fetch_add(1, Ordering::Relaxed);
                }
                for applied in done {
                    match applied {
                        Ok(answer) => answer.send(),
                        Err((caller, error)) => caller.fail(error),
                    }
                }
            }
        }
    }
}
