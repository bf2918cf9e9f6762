//! [`Config`]: how [`crate::SqliteStore::open`] opens and runs the file.

use std::sync::Arc;
use std::time::Duration;

use idem_core::group_commit::BatchConfig;
use idem_core::{Clock, SystemClock};

/// The default [`Config::with_max_clock_skew`]: well inside NTP's usual accuracy on a
/// healthy host (milliseconds), far below any sensible lease (seconds).
const DEFAULT_MAX_CLOCK_SKEW: Duration = Duration::from_secs(1);

/// Settings of a [`crate::SqliteStore`]: `Config::default().with_*(..)`.
///
/// Every commit fsyncs the write-ahead log (`PRAGMA synchronous = FULL`) before its
/// callers hear of it. There is no setting that trades this away: `NORMAL` can roll back
/// the newest commits on a power loss or an OS crash, and a claim or completion taken back
/// lets a retry run the handler a second time.
///
/// ```
/// use std::time::Duration;
/// use idem_sqlite::Config;
///
/// let config = Config::default()
///     .with_busy_timeout(Duration::from_secs(2))
///     .with_max_readers(8);
/// # let _ = config;
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Config {
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) busy_timeout: Duration,
    pub(crate) batch: BatchConfig,
    pub(crate) max_readers: usize,
    pub(crate) auto_migrate: bool,
    pub(crate) max_clock_skew: Duration,
    /// A claim whose idempotency key is this panics inside the writer's batch (the panic
    /// recovery test).
    #[cfg(test)]
    pub(crate) panic_on_key: Option<String>,
}

impl Default for Config {
    /// System clock, 5 s busy timeout, the executor's batching
    /// defaults ([`BatchConfig::default`]), 4 pooled readers, claims of live records
    /// answered by a reader, migrations applied on open, 1 s clock skew limit.
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
            busy_timeout: Duration::from_secs(5),
            batch: BatchConfig::default(),
            max_readers: 4,
            auto_migrate: true,
            max_clock_skew: DEFAULT_MAX_CLOCK_SKEW,
            #[cfg(test)]
            panic_on_key: None,
        }
    }
}

impl Config {
    idem_core::setters! {
        /// The clock every `now` is read from (default [`SystemClock`]); tests pass an
        /// [`idem_core::ManualClock`].
        pub fn with_clock(clock: Arc<dyn Clock>) => clock = clock;

        /// How long a connection waits for a lock another process holds before giving up with
        /// a retryable `SQLITE_BUSY` (default 5 s).
        pub fn with_busy_timeout(timeout: Duration) => busy_timeout = timeout;

        /// How the writer batches (default [`BatchConfig::default`]: up to 256 operations per
        /// `BEGIN IMMEDIATE` transaction, a 200 µs linger); see [`idem_core::group_commit`].
        pub fn with_batch(batch: BatchConfig) => batch = batch;

        /// Read connections opened with the store and kept for reads (default 4).
        /// [`Store::get`] and [`Store::journal_get`] open a short-lived extra connection when
        /// every pooled one is busy; a claim's read only takes a free pooled one and otherwise
        /// goes to the writer (so 0 sends every claim to the writer).
        ///
        /// [`Store::get`]: idem_core::Store::get
        /// [`Store::journal_get`]: idem_core::Store::journal_get
        pub fn with_max_readers(readers: usize) => max_readers = readers;

        /// Whether [`crate::SqliteStore::open`] applies missing migrations (default `true`).
        /// With `false` it only checks the file's schema version and fails with
        /// [`crate::Error::SchemaOutdated`] until [`crate::SqliteStore::migrate`] has run.
        pub fn with_auto_migrate(on: bool) => auto_migrate = on;

        /// How far the file's newest claim may lie ahead of this process's clock when the
        /// store opens (default 1 s): further, and [`crate::SqliteStore::open`] refuses with
        /// [`crate::Error::ClockBehind`]. `Duration::MAX` turns the refusal off (the skew is
        /// then only logged). The rule for processes sharing a file: `docs/contract.md#time`.
        pub fn with_max_clock_skew(limit: Duration) => max_clock_skew = limit;

        /// Makes a claim of `key` panic inside the writer's batch.
        #[cfg(test)]
        pub(crate) fn with_panic_on_key(key: &str) => panic_on_key = Some(key.to_owned());
    }
}
