//! [`Config`]: how a [`crate::RedbStore`] batches, and which clock it reads.

use std::sync::Arc;

use idem_core::group_commit::BatchConfig;
use idem_core::{Clock, SystemClock};

/// How a [`crate::RedbStore`] batches, and which clock it reads:
/// `Config::default().with_*(..)`. Every commit is durable (redb's
/// `Durability::Immediate`, an fsync) before its callers hear of it: there is no setting
/// that trades this away, because a claim or a completion a crash takes back lets a retry
/// run the handler a second time.
///
/// Batching itself (what a batch holds, the linger, what happens when a commit fails) is
/// the shared executor's: see [`idem_core::group_commit`].
#[derive(Clone, Debug)]
#[must_use]
pub struct Config {
    batch: BatchConfig,
    pub(crate) claim_reads: bool,
    pub(crate) reopen: bool,
    pub(crate) clock: Arc<dyn Clock>,
}

impl Default for Config {
    fn default() -> Self {
        Self { batch: BatchConfig::default(), claim_reads: true, reopen: true, clock: Arc::new(SystemClock) }
    }
}

impl Config {
    idem_core::setters! {
        /// How the writer batches (default [`BatchConfig::default`]: up to 256 operations, a
        /// 200 µs linger); see [`idem_core::group_commit`].
        pub fn with_batch(batch: BatchConfig) => batch = batch;

        /// Feature `test-util`: with `false`, every claim goes to the writer in the order it was
        /// handed over, instead of a claim that finds a live record being answered from a read
        /// transaction ([`idem_core::group_commit::Embedded::try_view`]).
        #[cfg(feature = "test-util")]
        pub fn with_claim_reads(on: bool) => claim_reads = on;

        /// Feature `test-util`: with `false`, a store opened from a path does not reopen its file
        /// after redb latched an I/O failure (see [`crate::RedbStore::open`]).
        #[cfg(feature = "test-util")]
        pub fn with_reopen(on: bool) => reopen = on;

        /// The clock every `now` is read from (default [`SystemClock`]); tests pass an
        /// [`idem_core::ManualClock`].
        pub fn with_clock(clock: Arc<dyn Clock>) => clock = clock;
    }

    /// The executor's settings.
    pub(crate) fn batch(&self) -> BatchConfig {
        self.batch.clone()
    }
}
