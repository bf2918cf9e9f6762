//! Group commit: the one thread that owns write transactions.
//!
//! Callers send an [`Op`] with a oneshot reply. The writer takes the first waiting
//! operation, everything else already queued (up to `max_batch`), optionally lingers for
//! more, applies them in arrival order inside one write transaction, commits once and
//! only then answers each caller. Each operation is a read-compute-write through the pure
//! rules in [`idem_core::transition`], so later operations in a batch see the effects of
//! earlier ones exactly as if they had committed separately: two claims of one id in one
//! batch give `Claimed` then `Existing`.
//!
//! Two kinds of failure: an operation's own outcome (`LeaseLost`, `Corrupt`, a value over
//! redb's size limit, all detected before that operation writes anything) goes to that
//! caller only and the batch goes on; a failure of the transaction itself (begin, a table
//! write half-way through an operation, commit) aborts the whole batch and every caller in
//! it gets the same error, so a caller is never told "done" for a write that was rolled
//! back.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_core::codec;
use idem_core::store::JournalWrite;
use idem_core::transition;
use idem_core::{
    ClaimOutcome, ClaimRequest, Clock, FencingToken, ReclaimOutcome, ReclaimRequest, Record, RecordId, StoreError,
    StoredResponse, SweepOutcome, UnixMillis,
};
use redb::{Database, ReadableTable, WriteTransaction};
use tokio::sync::oneshot;

use crate::error::RedbStoreError;
use crate::queue::{Next, Queue};
use crate::store::{Counters, Durability, EXPIRY, JOURNAL, Linger, RECORDS, RedbConfig};

/// Where a caller waits for its outcome.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// One write operation and its caller.
pub(crate) enum Op {
    Claim {
        req: ClaimRequest,
        reply: Reply<ClaimOutcome>,
    },
    Reclaim {
        req: ReclaimRequest,
        reply: Reply<ReclaimOutcome>,
    },
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

/// A caller to answer with an error.
enum Caller {
    Claim(Reply<ClaimOutcome>),
    Reclaim(Reply<ReclaimOutcome>),
    Record(Reply<Record>),
    Sweep(Reply<SweepOutcome>),
    Journal(Reply<JournalWrite>),
}

impl Caller {
    fn send_err(self, e: StoreError) {
        // A caller that stopped waiting (its future was dropped) needs no answer.
        let _ = match self {
            Caller::Claim(r) => r.send(Err(e)).map_err(drop),
            Caller::Reclaim(r) => r.send(Err(e)).map_err(drop),
            Caller::Record(r) => r.send(Err(e)).map_err(drop),
            Caller::Sweep(r) => r.send(Err(e)).map_err(drop),
            Caller::Journal(r) => r.send(Err(e)).map_err(drop),
        };
    }
}

/// An applied operation, answered once the batch commits.
enum Done {
    Claim(Reply<ClaimOutcome>, Result<ClaimOutcome, StoreError>),
    Reclaim(Reply<ReclaimOutcome>, Result<ReclaimOutcome, StoreError>),
    Record(Reply<Record>, Result<Record, StoreError>),
    Sweep(Reply<SweepOutcome>, Result<SweepOutcome, StoreError>),
    Journal(Reply<JournalWrite>, Result<JournalWrite, StoreError>),
}

impl Done {
    fn deliver(self) {
        let _ = match self {
            Done::Claim(r, v) => r.send(v).map_err(drop),
            Done::Reclaim(r, v) => r.send(v).map_err(drop),
            Done::Record(r, v) => r.send(v).map_err(drop),
            Done::Sweep(r, v) => r.send(v).map_err(drop),
            Done::Journal(r, v) => r.send(v).map_err(drop),
        };
    }

    fn into_caller(self) -> Caller {
        match self {
            Done::Claim(r, _) => Caller::Claim(r),
            Done::Reclaim(r, _) => Caller::Reclaim(r),
            Done::Record(r, _) => Caller::Record(r),
            Done::Sweep(r, _) => Caller::Sweep(r),
            Done::Journal(r, _) => Caller::Journal(r),
        }
    }
}

impl Op {
    fn into_caller(self) -> Caller {
        match self {
            Op::Claim { reply, .. } => Caller::Claim(reply),
            Op::Reclaim { reply, .. } => Caller::Reclaim(reply),
            Op::Complete { reply, .. } | Op::Fail { reply, .. } => Caller::Record(reply),
            Op::Sweep { reply, .. } => Caller::Sweep(reply),
            Op::JournalPut { reply, .. } => Caller::Journal(reply),
        }
    }

    /// Applies the operation inside the batch's transaction. `Err` is a transaction
    /// failure: the batch must be aborted.
    fn apply(self, t: &mut Tables<'_>, now: UnixMillis) -> Result<Done, (Caller, RedbStoreError)> {
        match self {
            Op::Claim { req, reply } => match t.claim(&req, now) {
                Ok(v) => Ok(Done::Claim(reply, v)),
                Err(e) => Err((Caller::Claim(reply), e)),
            },
            Op::Reclaim { req, reply } => match t.reclaim(&req, now) {
                Ok(v) => Ok(Done::Reclaim(reply, v)),
                Err(e) => Err((Caller::Reclaim(reply), e)),
            },
            Op::Complete { id, token, response, reply } => match t.complete(id, token, response, now) {
                Ok(v) => Ok(Done::Record(reply, v)),
                Err(e) => Err((Caller::Record(reply), e)),
            },
            Op::Fail { id, token, reply } => match t.fail(id, token, now) {
                Ok(v) => Ok(Done::Record(reply, v)),
                Err(e) => Err((Caller::Record(reply), e)),
            },
            Op::Sweep { limit, reply } => match t.sweep(limit, now) {
                Ok(v) => Ok(Done::Sweep(reply, Ok(v))),
                Err(e) => Err((Caller::Sweep(reply), e)),
            },
            Op::JournalPut { id, token, name, value, overwrite, reply } => {
                match t.journal_put(id, token, &name, &value, overwrite, now) {
                    Ok(v) => Ok(Done::Journal(reply, v)),
                    Err(e) => Err((Caller::Journal(reply), e)),
                }
            }
        }
    }
}

/// Outer `Err`: the transaction failed. Inner `Err`: this operation's own outcome.
type Applied<T> = Result<Result<T, StoreError>, RedbStoreError>;

/// The store's tables, open in one write transaction.
struct Tables<'txn> {
    records: redb::Table<'txn, &'static [u8; 32], &'static [u8]>,
    expiry: redb::Table<'txn, (i64, [u8; 32]), ()>,
    journal: redb::Table<'txn, (&'static [u8; 32], &'static str), &'static [u8]>,
    /// Whether any operation of the batch changed a table. A batch that changed nothing
    /// (claims that found a live record, lost leases) is aborted instead of committed, so
    /// it does not pay for a durable commit that would write nothing.
    wrote: bool,
}

impl<'txn> Tables<'txn> {
    fn open(txn: &'txn WriteTransaction) -> Result<Self, RedbStoreError> {
        let records =
            txn.open_table(RECORDS).map_err(|source| RedbStoreError::Table { table: "idem_records", source })?;
        let expiry = txn.open_table(EXPIRY).map_err(|source| RedbStoreError::Table { table: "idem_expiry", source })?;
        let journal =
            txn.open_table(JOURNAL).map_err(|source| RedbStoreError::Table { table: "idem_journal", source })?;
        Ok(Self { records, expiry, journal, wrote: false })
    }

    fn read(&self, id: RecordId) -> Applied<Option<Record>> {
        let Some(value) = self.records.get(&id.0)? else {
            return Ok(Ok(None));
        };
        Ok(codec::decode(value.value()).map(Some).map_err(|source| StoreError::Corrupt { id: Some(id), source }))
    }

    /// Writes `new` over `old` and moves its expiry index entry if `expires_at` changed.
    fn write(&mut self, old: Option<&Record>, new: &Record) -> Applied<()> {
        let bytes = codec::encode(new);
        // Set before the insert: a table write that fails half-way aborts the batch anyway.
        self.wrote = true;
        // The record insert is the operation's first change: if redb refuses the value
        // (over its 3 GiB limit) nothing was written and only this caller fails.
        match self.records.insert(&new.id.0, bytes.as_slice()) {
            Ok(_) => {}
            Err(e @ redb::StorageError::ValueTooLarge(_)) => return Ok(Err(RedbStoreError::Storage(e).into())),
            Err(e) => return Err(e.into()),
        }
        let old_expiry = old.map(|o| o.expires_at);
        if old_expiry != Some(new.expires_at) {
            if let Some(o) = old {
                self.expiry.remove((o.expires_at.0, o.id.0))?;
            }
            self.expiry.insert((new.expires_at.0, new.id.0), ())?;
        }
        Ok(Ok(()))
    }

    fn claim(&mut self, req: &ClaimRequest, now: UnixMillis) -> Applied<ClaimOutcome> {
        let current = match self.read(req.id)? {
            Ok(c) => c,
            Err(e) => return Ok(Err(e)),
        };
        let (write, outcome) = transition::claim(current.as_ref(), req, now);
        if let Some(new) = write {
            if let Err(e) = self.write(current.as_ref(), &new)? {
                return Ok(Err(e));
            }
            // A claim that replaces an expired record starts with an empty journal.
            if current.is_some() {
                self.drop_journal(new.id)?;
            }
        }
        Ok(Ok(outcome))
    }

    fn reclaim(&mut self, req: &ReclaimRequest, now: UnixMillis) -> Applied<ReclaimOutcome> {
        let current = match self.read(req.id)? {
            Ok(c) => c,
            Err(e) => return Ok(Err(e)),
        };
        let (write, outcome) = transition::reclaim(current.as_ref(), req, now);
        if let Some(new) = write
            && let Err(e) = self.write(current.as_ref(), &new)?
        {
            return Ok(Err(e));
        }
        Ok(Ok(outcome))
    }

    fn complete(
        &mut self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
        now: UnixMillis,
    ) -> Applied<Record> {
        let current = match self.read(id)? {
            Ok(c) => c,
            Err(e) => return Ok(Err(e)),
        };
        let new = match transition::complete(current.as_ref(), id, token, response, now) {
            Ok(new) => new,
            Err(lost) => return Ok(Err(StoreError::lease_lost(id, lost))),
        };
        Ok(self.write(current.as_ref(), &new)?.map(|()| new))
    }

    fn fail(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Applied<Record> {
        let current = match self.read(id)? {
            Ok(c) => c,
            Err(e) => return Ok(Err(e)),
        };
        let new = match transition::fail(current.as_ref(), id, token, now) {
            Ok(new) => new,
            Err(lost) => return Ok(Err(StoreError::lease_lost(id, lost))),
        };
        Ok(self.write(current.as_ref(), &new)?.map(|()| new))
    }

    /// Removes every journal entry of record `id` (a range scan from `(id, "")`).
    fn drop_journal(&mut self, id: RecordId) -> Result<(), RedbStoreError> {
        let mut names = Vec::new();
        for entry in self.journal.range((&id.0, "")..)? {
            let (key, _) = entry?;
            let (of, name) = key.value();
            if of != &id.0 {
                break;
            }
            names.push(name.to_owned());
        }
        self.wrote |= !names.is_empty();
        for name in &names {
            self.journal.remove((&id.0, name.as_str()))?;
        }
        Ok(())
    }

    /// Writes a journal entry, fenced on the record's current in-flight claim.
    fn journal_put(
        &mut self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: &[u8],
        overwrite: bool,
        now: UnixMillis,
    ) -> Applied<JournalWrite> {
        let current = match self.read(id)? {
            Ok(c) => c,
            Err(e) => return Ok(Err(e)),
        };
        if let Err(lost) = transition::check_journal_owner(current.as_ref(), id, token, now) {
            return Ok(Err(StoreError::lease_lost(id, lost)));
        }
        if !overwrite && let Some(existing) = self.journal.get((&id.0, name))? {
            return Ok(Ok(JournalWrite::Exists(existing.value().to_vec())));
        }
        self.wrote = true;
        match self.journal.insert((&id.0, name), value) {
            Ok(_) => Ok(Ok(JournalWrite::Written)),
            // Refused before anything was written: only this caller fails.
            Err(e @ redb::StorageError::ValueTooLarge(_)) => Ok(Err(RedbStoreError::Storage(e).into())),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes up to `limit` records with `expires_at <= now`, found by a range scan of the
    /// expiry index (never a scan of the records). The index is the authority here: a
    /// record is not decoded before it is deleted, so a corrupt record still leaves once
    /// its retention has passed.
    fn sweep(&mut self, limit: usize, now: UnixMillis) -> Result<SweepOutcome, RedbStoreError> {
        let mut expired = Vec::new();
        for entry in self.expiry.range(..=(now.0, [u8::MAX; 32]))?.take(limit.saturating_add(1)) {
            let (key, _) = entry?;
            expired.push(key.value());
        }
        let more = expired.len() > limit;
        expired.truncate(limit);
        self.wrote |= !expired.is_empty();
        for (expires_at, id) in &expired {
            self.expiry.remove((*expires_at, *id))?;
            self.records.remove(id)?;
            self.drop_journal(RecordId(*id))?;
        }
        Ok(SweepOutcome { removed: expired.len() as u64, more })
    }
}

/// Closes the queue when dropped (see [`Writer::run`]).
struct CloseOnExit(Arc<Queue<Op>>);

impl Drop for CloseOnExit {
    fn drop(&mut self) {
        drop(self.0.close_and_take());
    }
}

/// The writer thread's state.
pub(crate) struct Writer {
    db: Arc<Database>,
    clock: Arc<dyn Clock>,
    max_batch: usize,
    linger: Linger,
    /// Size of the last batch, the adaptive linger's target.
    last_batch: usize,
    durability: Durability,
    counters: Arc<Counters>,
    queue: Arc<Queue<Op>>,
    /// When the oldest commit that is not yet durable was made (`Durability::Eventual`).
    dirty_since: Option<Instant>,
}

impl Writer {
    pub(crate) fn new(
        db: Arc<Database>,
        clock: Arc<dyn Clock>,
        config: &RedbConfig,
        counters: Arc<Counters>,
        queue: Arc<Queue<Op>>,
    ) -> Self {
        Self {
            db,
            clock,
            max_batch: config.max_batch.max(1),
            linger: config.linger,
            last_batch: 1,
            durability: config.durability,
            counters,
            queue,
            dirty_since: None,
        }
    }

    /// Runs until the queue is closed and every queued operation is answered.
    pub(crate) fn run(mut self) {
        // However the loop ends (even by a panic outside a batch), close the queue and drop
        // what is left in it: those callers see `WriterStopped` instead of waiting forever.
        let _closer = CloseOnExit(Arc::clone(&self.queue));
        let mut batch = Vec::with_capacity(self.max_batch);
        while let Some(first) = self.next_first() {
            batch.push(first);
            self.fill(&mut batch);
            let ops = std::mem::take(&mut batch);
            // A panic while applying a batch (a bug, or a redb assertion on a damaged file)
            // must not take the store down: the batch's transaction is dropped unapplied,
            // its callers see their replies dropped (`WriterStopped`), and the next batch
            // starts fresh.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_batch(ops))).is_err() {
                self.counters.failed_batches.fetch_add(1, Ordering::Relaxed);
                tracing::error!("idem-redb writer panicked while applying a batch; nothing in it was applied");
            }
        }
        if self.dirty_since.is_some() {
            self.flush();
        }
    }

    /// Waits for the first operation of the next batch; `None` once the store is dropped.
    /// With `Durability::Eventual`, makes pending commits durable when the wait would
    /// otherwise outlast `max_unflushed`.
    fn next_first(&mut self) -> Option<Op> {
        loop {
            let deadline = match (self.durability, self.dirty_since) {
                (Durability::Eventual { max_unflushed }, Some(since)) => Some(since + max_unflushed),
                _ => None,
            };
            match self.queue.next(deadline) {
                Next::Item(op) => return Some(op),
                Next::Timeout => self.flush(),
                Next::Closed => return None,
            }
        }
    }

    /// Adds what is already queued, then lingers for more as [`Linger`] says.
    fn fill(&mut self, batch: &mut Vec<Op>) {
        self.queue.drain_into(batch, self.max_batch);
        let (wait, target) = match self.linger {
            Linger::None => (Duration::ZERO, 0),
            Linger::Adaptive { max } => (max, self.last_batch.min(self.max_batch)),
            Linger::Fixed(wait) => (wait, self.max_batch),
        };
        if batch.len() < target && !wait.is_zero() {
            let deadline = Instant::now() + wait;
            while batch.len() < target {
                match self.queue.next(Some(deadline)) {
                    Next::Item(op) => {
                        batch.push(op);
                        // Take whatever came with it in the same lock.
                        self.queue.drain_into(batch, target);
                    }
                    Next::Timeout | Next::Closed => break,
                }
            }
        }
        self.last_batch = batch.len();
    }

    fn run_batch(&mut self, ops: Vec<Op>) {
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.operations.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let durable = match self.durability {
            Durability::Immediate => true,
            Durability::Eventual { max_unflushed } => self.dirty_since.is_some_and(|s| s.elapsed() >= max_unflushed),
        };
        match self.apply_and_commit(ops, durable) {
            Ok((done, committed)) => {
                if !committed {
                    self.counters.read_only_batches.fetch_add(1, Ordering::Relaxed);
                } else if durable {
                    self.dirty_since = None;
                } else if self.dirty_since.is_none() {
                    self.dirty_since = Some(Instant::now());
                }
                for d in done {
                    d.deliver();
                }
            }
            Err((callers, e)) => {
                self.counters.failed_batches.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, operations = callers.len(), "idem-redb batch failed; nothing in it was applied");
                for c in callers {
                    c.send_err(RedbStoreError::Batch(Arc::clone(&e)).into());
                }
            }
        }
    }

    /// `Ok` carries the outcomes and whether a commit was made (`false`: the batch wrote
    /// nothing and was aborted). `Err` carries every caller of the batch and the one error
    /// they all get.
    #[allow(clippy::type_complexity, reason = "a private helper's two outcomes, each used once")]
    fn apply_and_commit(
        &self,
        ops: Vec<Op>,
        durable: bool,
    ) -> Result<(Vec<Done>, bool), (Vec<Caller>, Arc<RedbStoreError>)> {
        let fail_all = |ops: Vec<Op>, e: RedbStoreError| (ops.into_iter().map(Op::into_caller).collect(), Arc::new(e));
        let mut txn = match self.db.begin_write() {
            Ok(t) => t,
            Err(e) => return Err(fail_all(ops, e.into())),
        };
        if !durable && let Err(e) = txn.set_durability(redb::Durability::None) {
            return Err(fail_all(ops, e.into()));
        }
        let mut done = Vec::with_capacity(ops.len());
        let mut wrote = false;
        let fault = match Tables::open(&txn) {
            Err(e) => Some(fail_all(ops, e)),
            Ok(mut tables) => {
                let mut ops = ops.into_iter();
                let mut fault = None;
                for op in ops.by_ref() {
                    // Each operation reads the clock when it is applied, so `now` never
                    // runs backwards within a batch.
                    match op.apply(&mut tables, self.clock.now()) {
                        Ok(d) => done.push(d),
                        Err(f) => {
                            fault = Some(f);
                            break;
                        }
                    }
                }
                wrote = tables.wrote;
                fault.map(|(caller, e)| {
                    let mut callers: Vec<Caller> = done.drain(..).map(Done::into_caller).collect();
                    callers.push(caller);
                    callers.extend(ops.map(Op::into_caller));
                    (callers, Arc::new(e))
                })
            }
        };
        if let Some(fault) = fault {
            // Dropping the transaction would abort it too; abort explicitly so nothing of
            // the batch can reach the file.
            let _ = txn.abort();
            return Err(fault);
        }
        if !wrote {
            // Every outcome was read from state that earlier commits already made visible
            // (and, under `Durability::Immediate`, durable): there is nothing to commit.
            let _ = txn.abort();
            return Ok((done, false));
        }
        match txn.commit() {
            Ok(()) => Ok((done, true)),
            Err(e) => Err((done.into_iter().map(Done::into_caller).collect(), Arc::new(e.into()))),
        }
    }

    /// Makes pending non-durable commits durable with an empty durable commit.
    fn flush(&mut self) {
        let result = self.db.begin_write().map_err(RedbStoreError::from).and_then(|txn| Ok(txn.commit()?));
        match result {
            Ok(()) => self.dirty_since = None,
            Err(e) => {
                tracing::warn!(error = %e, "idem-redb could not make pending commits durable; will retry");
                // Back off for one interval instead of retrying in a tight loop.
                self.dirty_since = Some(Instant::now());
            }
        }
    }
}
