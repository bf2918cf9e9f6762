//! Time as the record sees it: milliseconds since the Unix epoch, UTC.
//!
//! Every timestamp in a record uses this one unit. Mixing seconds and milliseconds in
//! expiry checks is a known way to break lease reclaim
//! (`docs/failures.md#seconds-and-milliseconds-mixed`), so there is exactly one type for
//! "a point in time" and durations are converted to milliseconds at the boundary.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A point in time: milliseconds since 1970-01-01T00:00:00Z.
///
/// Signed so that arithmetic near the epoch cannot wrap; stores keep it as a 64-bit integer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct UnixMillis(pub i64);

impl UnixMillis {
    /// The instant `d` after `self`, saturating at `i64::MAX` ms.
    #[must_use]
    pub fn saturating_add(self, d: Duration) -> UnixMillis {
        UnixMillis(self.0.saturating_add(duration_ms(d)))
    }

    /// Milliseconds from `self` until `later` (zero if `later` is not after `self`).
    #[must_use]
    pub fn millis_until(self, later: UnixMillis) -> u64 {
        u64::try_from(later.0.saturating_sub(self.0)).unwrap_or(0)
    }
}

impl fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// A duration in whole milliseconds, saturating at `i64::MAX`.
#[must_use]
pub fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The one clock a store reads. Core logic never calls it: `now` is always an argument
/// there. Stores without a server clock (redb, SQLite, memory) read one of these; stores
/// with one (Redis `TIME`, Postgres `clock_timestamp()`) use it only when a test pins time.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current time.
    fn now(&self) -> UnixMillis;
}

/// Wall-clock time from the operating system.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> UnixMillis {
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or(Duration::ZERO);
        UnixMillis(duration_ms(since))
    }
}

/// A clock that only moves when told to: the tests own time (expiry and lease staleness
/// are tested by moving this clock, never by sleeping). Clones share the same instant.
#[derive(Clone, Debug)]
pub struct ManualClock {
    now: Arc<AtomicI64>,
}

impl ManualClock {
    /// A clock stopped at `start`.
    #[must_use]
    pub fn new(start: UnixMillis) -> Self {
        Self { now: Arc::new(AtomicI64::new(start.0)) }
    }

    /// A clock stopped at the current wall-clock time, so that records written with it
    /// carry plausible timestamps (useful for server-side native expiry).
    #[must_use]
    pub fn starting_now() -> Self {
        Self::new(SystemClock.now())
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.now.fetch_add(duration_ms(d), Ordering::SeqCst);
    }

    /// Moves the clock by `ms` milliseconds (negative values move it back, for skew tests).
    pub fn advance_ms(&self, ms: i64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }

    /// The current reading in milliseconds (shorthand for `self.now().0`).
    #[must_use]
    pub fn now_ms(&self) -> i64 {
        self.now.load(Ordering::SeqCst)
    }

    /// Sets the clock to `t`.
    pub fn set(&self, t: UnixMillis) {
        self.now.store(t.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> UnixMillis {
        UnixMillis(self.now.load(Ordering::SeqCst))
    }
}
