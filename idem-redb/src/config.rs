//! [`Config`]: how a [`crate::RedbStore`] batches and commits, and which clock it reads.

use std::sync::Arc;
use std::time::Duration;

use idem_core::group_commit::BatchConfig;
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
    pub(crate) durability: Durability,
    pub(crate) claim_reads: bool,
    pub(crate) reopen: bool,
    pub(crate) clock: Arc<dyn Clock>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            batch: BatchConfig::default(),
            durability: Durability::Immediate,
            claim_reads: true,
            reopen: true,
            clock: Arc::new(SystemClock),
        }
    }
}

impl Config {
    /// How the writer batches (default [`BatchConfig::default`]: up to 256 operations, a
    /// 200 µs linger); see [`idem_core::group_commit`].
    pub fn with_batch(mut self, batch: BatchConfig) -> Self {
        self.batch = batch;
        self
    }

    /// Commit durability (default [`Durability::Immediate`]).
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Feature `test-util`: with `false`, every claim goes to the writer in the order it was
    /// handed over, instead of a claim that finds a live record being answered from a read
    /// transaction ([`idem_core::group_commit::GroupCommit::claim_from_view`]).
    #[cfg(feature = "test-util")]
    pub fn with_claim_reads(mut self, on: bool) -> Self {
        self.claim_reads = on;
        self
    }

    /// Feature `test-util`: with `false`, a store opened from a path does not reopen its file
    /// after redb latched an I/O failure (see [`crate::RedbStore::open`]).
    #[cfg(feature = "test-util")]
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

    /// The executor's settings, durability included.
    pub(crate) fn batch(&self) -> BatchConfig {
        self.batch.clone().with_flush_interval(self.durability.flush_interval())
    }
}
