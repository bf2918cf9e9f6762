//! Store deadlines and completion retries: what the layer does when its store stalls or
//! blips.
//!
//! Every store call the layer makes (the claim and the calls that decide a request, the
//! `complete`/`fail` after the handler, lease renewals, the handler's journal steps) goes
//! through the wrappers the layer puts around the store it was given, composed once per
//! layer (`src/store/`: deadlines, completion retries, sealing, timing, one file each).
//! These settings decide two of them:
//!
//! 1. **A deadline per call** ([`StoreDeadlines`]). A call that has not answered by its
//!    deadline is abandoned and counts as a transient [`StoreError::Unavailable`]: a claim
//!    that misses its deadline is answered 503 with `Retry-After` (fail closed, or run
//!    unprotected under fail-open), instead of holding the client's request for as long as
//!    a black-holed connection, a writer stuck in `fsync` or a `SIGSTOP`ped server takes.
//! 2. **Completion retries** ([`CompletionRetry`]). A `complete` or `fail` that misses its
//!    deadline or meets any [`StoreError::Unavailable`] (a blip, and also an outage the
//!    backend reports as not retryable: SQLite's full disk, redb after a latched I/O
//!    failure) is sent again with backoff (25 ms, doubling, at most 1 s) for as long as the
//!    lease can last. Without this, the response goes out, the record stays in flight, and
//!    once the lease runs out a retry reclaims the record and runs the handler a second
//!    time.
//! 3. **Journal write retries** (same switch). A resumable step's outcome, or an intent's
//!    `pending`/`done`, that misses its deadline or meets any `Unavailable` is written
//!    again the same way for up to one lease TTL, while the handler's lease is being
//!    renewed. The step's side effect has already happened when its outcome is written;
//!    without the retry the request fails with nothing journalled and the next attempt
//!    runs the step again.
//!
//! # Ambiguous outcomes
//! A call abandoned at its deadline, or one that failed on a dropped connection, may still
//! have been applied by the store. For a claim this is safe: the client got 503, its retry
//! finds the orphan claim in flight (409 `in-flight`) and reclaims it once its lease ran out;
//! nothing ran. For a completion it matters: the resend finds the record completed, and the
//! store refuses it with `LeaseLost` (`complete` is a compare-and-set on an in-flight record,
//! and the record is no longer in flight). So after an ambiguous attempt a `LeaseLost` is
//! checked with a `get`: a record that carries this attempt's fencing token in the state
//! the call asked for (completed for `complete`, failed for `fail`) was written by this
//! attempt, and the call reads as done. Fencing tokens never repeat for a record id, so no
//! other attempt can have left that token behind.
//!
//! # A completion that never lands
//! When the store is still out as the retry window closes, `complete` returns its last
//! error and the layer sends the handler's response as the handler made it (status,
//! headers, body; not a problem answer: the operation did run, and an error answer would
//! invite the very retry that runs it again), marked `Idempotent-Stored: false`
//! ([`crate::IDEMPOTENT_STORED`]). It also logs "could not store the response" at error
//! level and counts the attempt as `not_stored` (`idem_outcomes_total`). The record stays
//! in flight under this attempt's token: a retry while its lease lasts is answered 409
//! `in-flight`, and a retry after the lease reclaims it and runs the handler again, which
//! the mark told the client to expect. Only an outage that outlasts the whole window gets
//! there.
//!
//! # Bounds
//! - A stalled store answers the first call within its deadline; a request makes a
//!   bounded number of calls (a claim, and at most a few reads or reclaims after a race),
//!   each with its own deadline.
//! - Completion retries stop at the first of: success, `LeaseLost` (another attempt owns
//!   the record; never sent again), a final error (a corrupt record, an unsupported call),
//!   or the retry window, one lease TTL after the first attempt was sent. The lease keeps
//!   being renewed while the completion is resent (the renewal covers the handler and its
//!   completion), so a retry meanwhile is answered 409 in flight instead of reclaiming
//!   the record; a `complete` after a reclaim would be refused by its token anyway. The
//!   response is returned once the retries end, so a long store outage delays the
//!   response by up to one lease TTL: that is the price of not running the handler twice.
//! - Deadlines use tokio's timer: the runtime must have time enabled, as for lease renewal.
//!   Outside a tokio runtime calls run without a deadline. A call's timer starts when it
//!   first waits: a store that answers at once (an in-memory one) never sets a timer.

use std::time::Duration;

use idem_core::StoreError;

/// The default deadline of every store call: long enough for a healthy store under load
/// (an `fsync`, a group-commit batch, a pool checkout), short enough that a client whose
/// own timeout is a few seconds hears a 503 before it gives up.
pub const DEFAULT_STORE_DEADLINE: Duration = Duration::from_secs(2);

/// How long each store operation may take before the layer gives up on it, per operation.
///
/// | field | store calls | default | when missed |
/// |---|---|---|---|
/// | [`claim`](Self::claim) | `claim`, `reclaim` | 2 s | 503 (fail closed) |
/// | [`read`](Self::read) | `get`, `journal_get` | 2 s | 503 / the read's caller sees a transient error |
/// | [`complete`](Self::complete) | `complete`, `fail` (each attempt) | 2 s | retried, see [`CompletionRetry`] |
/// | [`extend`](Self::extend) | `extend` (lease renewal) | 2 s | renewal retries it; it also never waits past the lease it tries to keep |
/// | [`journal`](Self::journal) | `journal_put` (steps, intents) | 2 s | retried like a completion, then the step fails transiently |
///
/// `sweep` runs without a deadline: the layer never sweeps (the sweeper in `idem_core::sweeper` does).
/// A zero deadline is taken as 1 ms.
///
/// ```
/// use std::time::Duration;
/// use idem_http::{CompletionRetry, StoreDeadlines};
///
/// let mut deadlines = StoreDeadlines::default();
/// deadlines.claim = Duration::from_millis(500);
/// deadlines.completion_retry = CompletionRetry::Off;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreDeadlines {
    /// `claim` and `reclaim`.
    pub claim: Duration,
    /// `get` and `journal_get`.
    pub read: Duration,
    /// One `complete` or `fail` attempt.
    pub complete: Duration,
    /// One lease renewal (`extend`).
    pub extend: Duration,
    /// `journal_put`.
    pub journal: Duration,
    /// Whether completions and journal writes are sent again (default
    /// [`CompletionRetry::WhileLeaseLasts`]).
    pub completion_retry: CompletionRetry,
}

impl Default for StoreDeadlines {
    fn default() -> Self {
        Self {
            claim: DEFAULT_STORE_DEADLINE,
            read: DEFAULT_STORE_DEADLINE,
            complete: DEFAULT_STORE_DEADLINE,
            extend: DEFAULT_STORE_DEADLINE,
            journal: DEFAULT_STORE_DEADLINE,
            completion_retry: CompletionRetry::default(),
        }
    }
}

/// Whether a `complete` or `fail` that missed its deadline or met an outage (any
/// [`StoreError::Unavailable`], the ones the backend calls permanent too, such as a full
/// disk) is sent again; the same switch governs journal writes (a step's outcome, an
/// intent's state).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompletionRetry {
    /// Retry with backoff (25 ms, doubling, at most 1 s) for up to one lease TTL after the
    /// first attempt (default). Applies to completions and journal writes.
    #[default]
    WhileLeaseLasts,
    /// Send once. A completion lost to a blip or a full disk leaves the record in flight
    /// until its lease ends, and a retry after that runs the handler again; a step outcome
    /// lost the same way fails the request, and its retry runs the step again. For
    /// measuring what the retry prevents, not for production.
    Off,
}

/// The source of a [`StoreError::Unavailable`] for a call that missed its deadline.
#[derive(Debug, thiserror::Error)]
#[error("no answer from the store within {} ms", .0.as_millis())]
pub struct DeadlineMissed(Duration);

impl DeadlineMissed {
    /// The transient failure of the call named `what` that had no answer within `limit`.
    pub(crate) fn error(limit: Duration, what: &'static str) -> StoreError {
        StoreError::unavailable("idem-http", what, true, Self(limit))
    }
}
