//! [`Config`]: how a [`crate::RedbStore`] batches and commits, and which clock it reads.

use std::sync::Arc;
use std::time::Duration;

use idem_core::group_commit::{BatchConfig, Linger};
use idem_core::{Clock, SystemClock};

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
    /// made at least every `max_unflushed` (and when the store is dropped).
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

impl Durability {
    /// The executor's flush interval: `None` makes every commit durable.
    fn flush_interval(self) -> Option<Duration> {
        match self {
            Durability::Immediate => None,
            Durability::Eventual { max_unflushed } => Some(max_unflushed),
        }
    }
}

/// How a [`crate::RedbStore`] batches and commits, and which clock it reads:
/// `Config::default().with_*(..)`.
///
/// Batching itself (what a batch holds, the linger, what happens when a commit fails) is
/// the shared executor's: see [`idem_core::group_commit`].
#[derive(Clone, Debug)]
#[must_use]
pub struct Config {
    batch: BatchConfig,
    durability: Durability,
    claim_reads: bool,
    reopen: bool,
    clock: Arc<dyn Clock>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            batch: BatchConfig::default().with_thread_name("idem-redb-writer"),
            durability: Durability::Immediate,
            claim_reads: true,
            reopen: true,
            clock: Arc::new(SystemClock),
        }
    }
}

impl Config {
    /// Most operations applied in one write transaction (default 256; zero counts as 1).
    /// A larger batch shares one commit (one fsync) among more callers but makes each of
    /// them wait for the whole batch. See [`BatchConfig::with_max_batch`].
    pub fn with_max_batch(mut self, ops: usize) -> Self {
        self.batch = self.batch.with_max_batch(ops);
        self
    }

    /// Whether and how long the writer waits for more operations once it has taken what
    /// is queued (default [`Linger::Adaptive`] with 200 µs).
    pub fn with_linger(mut self, linger: Linger) -> Self {
        self.batch = self.batch.with_linger(linger);
        self
    }

    /// Commit durability (default [`Durability::Immediate`]).
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Whether a claim first looks its record up in a read transaction and, when it finds
    /// a live record, answers [`idem_core::ClaimOutcome::Existing`] from it without the
    /// writer (default `true`; see [`idem_core::group_commit::GroupCommit::claim_from_view`]).
    /// A redb read transaction never waits for the writer, so replays neither wait for
    /// nor dilute group commits. With `false`, every claim is applied by the writer in the
    /// order it was handed over.
    pub fn with_claim_reads(mut self, on: bool) -> Self {
        self.claim_reads = on;
        self
    }

    /// Whether a store opened from a path ([`crate::RedbStore::open`]) closes and reopens
    /// its file after redb latched an I/O failure (default `true`). redb refuses every
    /// transaction of a `Database` after a commit failed with an I/O error (a full disk)
    /// until it is opened again; with `true` the store does that by itself, with a backoff
    /// of 10 ms doubling up to 1 s between failed opens, and answers unavailable (503)
    /// meanwhile. With `false` it keeps answering unavailable until the process opens a new
    /// store. A store on a caller's database ([`crate::RedbStore::from_database`]) never
    /// reopens.
    pub fn with_reopen(mut self, on: bool) -> Self {
        self.reopen = on;
        self
    }

    /// The clock every `now` is read from (default [`SystemClock`]); tests pass an
    /// [`idem_core::ManualClock`].
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Most operations per write transaction.
    #[must_use]
    pub fn max_batch(&self) -> usize {
        self.batch.max_batch()
    }

    /// The linger.
    #[must_use]
    pub fn linger(&self) -> Linger {
        self.batch.linger()
    }

    /// The commit durability.
    #[must_use]
    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// Whether claims of live records are answered from a read transaction.
    #[must_use]
    pub fn claim_reads(&self) -> bool {
        self.claim_reads
    }

    /// Whether a store opened from a path reopens its file after a latched I/O failure.
    #[must_use]
    pub fn reopen(&self) -> bool {
        self.reopen
    }

    /// The clock.
    #[must_use]
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The executor's settings, durability included.
    pub(crate) fn batch(&self) -> BatchConfig {
        self.batch.clone().with_flush_interval(self.durability.flush_interval())
    }
}
