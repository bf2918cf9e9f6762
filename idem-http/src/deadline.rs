//! Store deadlines and completion retries: what the layer does when its store stalls or
//! blips.
//!
//! Every store call the layer makes (the claim and the calls that decide a request, the
//! `complete`/`fail` after the handler, lease renewals, the handler's journal steps) goes
//! through a [`Store`] wrapper (`DeadlineStore`) the layer puts around the store it was
//! given. It does three things:
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
//!   Outside a tokio runtime calls run without a deadline.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, Receipt, ReclaimOutcome, ReclaimRequest,
    Record, RecordId, RecordState, Store, StoreError, StoredResponse, SweepOutcome,
};
use tokio::time::Instant;

use crate::observe::StoreOp as Op;

/// The default deadline of every store call: long enough for a healthy store under load
/// (an `fsync`, a group-commit batch, a pool checkout), short enough that a client whose
/// own timeout is a few seconds hears a 503 before it gives up.
pub const DEFAULT_STORE_DEADLINE: Duration = Duration::from_secs(2);

/// First pause before a completion is sent again.
const RETRY_FIRST: Duration = Duration::from_millis(25);
/// Longest pause between two completion attempts.
const RETRY_MAX: Duration = Duration::from_secs(1);

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

/// Whether a completion or journal write that failed with `error` may land if sent again:
/// any [`StoreError::Unavailable`], the retryable ones (a blip, a busy timeout, a missed
/// deadline) and the others too (SQLite's full disk, redb's latched I/O failure), as lease
/// renewal treats them: the store may recover within the retry window, and the fence keeps
/// a late write harmless. Refusals (`LeaseLost`), corrupt records and unsupported
/// operations are final.
fn is_outage(error: &StoreError) -> bool {
    matches!(error, StoreError::Unavailable { .. })
}

/// The layer's store: `inner` with a deadline on every call and completion retries.
pub(crate) struct DeadlineStore {
    inner: Arc<dyn Store>,
    deadlines: StoreDeadlines,
    /// How long completions are retried: the lease TTL.
    retry_window: Duration,
    /// `inner`'s backend name, the `backend` label of the store metrics.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code, reason = "read by the metrics only"))]
    backend: &'static str,
    /// The layer's store call histograms and error counters.
    #[cfg(feature = "metrics")]
    metrics: Arc<crate::observe::StoreMetrics>,
    /// Seals responses before `complete` and opens every record a call returns, inside
    /// the deadlines and retries: a resend sends the same sealed bytes, and the read-back
    /// after an ambiguous completion is opened.
    #[cfg(feature = "seal")]
    sealing: Option<idem_core::seal::Sealing>,
}

/// What a store call returns that may carry a sealed response.
trait Opened: Sized {
    #[cfg(feature = "seal")]
    fn opened(self, sealing: &idem_core::seal::Sealing) -> Result<Self, StoreError>;
}

impl Opened for Record {
    #[cfg(feature = "seal")]
    fn opened(self, sealing: &idem_core::seal::Sealing) -> Result<Self, StoreError> {
        sealing.open(self)
    }
}

impl Opened for Option<Record> {
    #[cfg(feature = "seal")]
    fn opened(self, sealing: &idem_core::seal::Sealing) -> Result<Self, StoreError> {
        self.map(|record| sealing.open(record)).transpose()
    }
}

impl Opened for ClaimOutcome {
    #[cfg(feature = "seal")]
    fn opened(self, sealing: &idem_core::seal::Sealing) -> Result<Self, StoreError> {
        Ok(match self {
            ClaimOutcome::Claimed(record) => ClaimOutcome::Claimed(sealing.open(record)?),
            ClaimOutcome::Existing { record, now } => ClaimOutcome::Existing { record: sealing.open(record)?, now },
        })
    }
}

impl Opened for ReclaimOutcome {
    #[cfg(feature = "seal")]
    fn opened(self, sealing: &idem_core::seal::Sealing) -> Result<Self, StoreError> {
        Ok(match self {
            ReclaimOutcome::Reclaimed(record) => ReclaimOutcome::Reclaimed(sealing.open(record)?),
            ReclaimOutcome::Conflict { current, now } => {
                ReclaimOutcome::Conflict { current: current.opened(sealing)?, now }
            }
        })
    }
}

impl fmt::Debug for DeadlineStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadlineStore")
            .field("inner", &self.inner)
            .field("deadlines", &self.deadlines)
            .field("retry_window", &self.retry_window)
            .finish()
    }
}

impl DeadlineStore {
    /// The store of a service made with `cfg`: its store, deadlines, sealing and metrics,
    /// completions retried for one lease TTL.
    pub(crate) fn new(cfg: &crate::config::Config) -> Self {
        Self {
            inner: Arc::clone(&cfg.store),
            deadlines: cfg.store_deadlines,
            retry_window: cfg.policy.lease_ttl,
            backend: cfg.store.capabilities().backend,
            #[cfg(feature = "metrics")]
            metrics: Arc::clone(&cfg.store_metrics),
            #[cfg(feature = "seal")]
            sealing: cfg.sealing.clone(),
        }
    }

    /// `value` (a record, or an outcome carrying records) with its responses opened when
    /// sealing is on; as is otherwise.
    #[cfg_attr(
        not(feature = "seal"),
        allow(clippy::unnecessary_wraps, clippy::unused_self, reason = "opens only with sealing")
    )]
    fn open<T: Opened>(&self, value: T) -> Result<T, StoreError> {
        #[cfg(feature = "seal")]
        if let Some(sealing) = &self.sealing {
            return value.opened(sealing);
        }
        Ok(value)
    }

    /// `call`, timed (`idem_store_call_seconds`) and its error counted
    /// (`idem_store_errors_total`) under the `metrics` feature; as is without it. Measured
    /// around the deadline and the completion retries: the latency the request saw.
    async fn observed<T>(
        &self,
        operation: Op,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        #[cfg(feature = "metrics")]
        {
            let started = std::time::Instant::now();
            let result = call.await;
            self.metrics.record(self.backend, operation, started.elapsed(), result.as_ref().err());
            result
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = operation;
            call.await
        }
    }

    /// `call`, abandoned after `limit` (at least 1 ms) as a transient failure named `what`.
    async fn within<T>(
        limit: Duration,
        what: &'static str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        // No tokio runtime, no timer: nothing can time the call out.
        if tokio::runtime::Handle::try_current().is_err() {
            return call.await;
        }
        let limit = limit.max(Duration::from_millis(1));
        match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::unavailable("idem-http", what, true, DeadlineMissed(limit))),
        }
    }

    /// Sends a completion (`complete` when `want` is completed, `fail` when failed) until
    /// it lands, is refused, fails for good, or the retry window closes.
    async fn finish<F, Fut>(
        &self,
        id: RecordId,
        token: FencingToken,
        want: RecordState,
        what: &'static str,
        mut send: F,
    ) -> Result<Receipt, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Receipt, StoreError>>,
    {
        let retry = self.deadlines.completion_retry == CompletionRetry::WhileLeaseLasts
            && tokio::runtime::Handle::try_current().is_ok();
        let window_end = Instant::now() + self.retry_window;
        let mut pause = RETRY_FIRST;
        // Whether an earlier attempt may have been applied without this call hearing so.
        let mut ambiguous = false;
        loop {
            let error = match Self::within(self.deadlines.complete, what, send()).await {
                Ok(receipt) => return Ok(receipt),
                Err(e) => e,
            };
            if error.is_lease_lost() {
                if ambiguous && let Some(receipt) = self.own_write(id, token, want).await {
                    tracing::debug!(record = %id, token = %token, what, "resent completion found already applied");
                    return Ok(receipt);
                }
                return Err(error);
            }
            // Any outage is sent again, not only the retryable ones: a `complete` refused by a
            // full disk (SQLite) or by redb after a latched I/O failure lands once the store
            // recovers, and giving up at once left the record in flight, so the retry after
            // the lease ran the handler a second time. `fail` follows the same rule although
            // a lost `fail` never runs anything twice (the record stays in flight and a retry
            // reclaims it when the lease ends): a `fail` that lands once the store is back
            // frees the key at once instead of answering every retry 409 for the rest of the
            // lease, and it only holds back an error answer, which a retryable outage
            // already does for as long. `LeaseLost` was handled above; a corrupt record or an
            // unsupported call is final.
            if !retry || !is_outage(&error) || Instant::now() + pause >= window_end {
                return Err(error);
            }
            tracing::warn!(record = %id, token = %token, what, error = %error, "store completion failed; retrying");
            ambiguous = true;
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_MAX);
        }
    }

    /// Writes a journal entry (a step's outcome, an intent's `pending` or `done`), sent
    /// again like a completion when it misses its deadline or the store is unavailable, for
    /// up to one lease TTL. The step's side effect has already happened when its outcome is
    /// written: giving up at the first failure (a full disk, a blip) fails the request with
    /// no outcome journalled, and the retry that reclaims the record runs the step again.
    ///
    /// A resend after an ambiguous success is safe: the write is fenced by `token`, a
    /// step's entry is written only if absent (the resend finds it and returns
    /// [`JournalWrite::Exists`] with the same value), and an intent's entry is overwritten
    /// with the same state. `LeaseLost` (another attempt owns the record) ends the retries.
    async fn journal_put_retried(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        let retry = self.deadlines.completion_retry == CompletionRetry::WhileLeaseLasts
            && tokio::runtime::Handle::try_current().is_ok();
        let window_end = Instant::now() + self.retry_window;
        let mut pause = RETRY_FIRST;
        loop {
            let call = self.inner.journal_put(id, token, name, value.clone(), overwrite);
            let error =
                match self.observed(Op::JournalPut, Self::within(self.deadlines.journal, "journal_put", call)).await {
                    Ok(written) => return Ok(written),
                    Err(e) => e,
                };
            if !retry || !is_outage(&error) || Instant::now() + pause >= window_end {
                return Err(error);
            }
            tracing::warn!(record = %id, token = %token, name, error = %error, "journal write failed; retrying");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_MAX);
        }
    }

    /// The record's receipt, if it carries `token` in state `want`: this attempt's own
    /// earlier write.
    async fn own_write(&self, id: RecordId, token: FencingToken, want: RecordState) -> Option<Receipt> {
        match Self::within(self.deadlines.read, "read after an ambiguous completion", self.inner.get(id)).await {
            Ok(Some(record)) if record.token == token && record.state == want => Some(Receipt::of(&record)),
            _ => None,
        }
    }
}

#[async_trait]
impl Store for DeadlineStore {
    // Records are opened inside `observed`: a response that does not open is a store error
    // of its call (`idem_store_errors_total`), as a record that does not decode is.
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let call = async { self.open(Self::within(self.deadlines.claim, "claim", self.inner.claim(req)).await?) };
        self.observed(Op::Claim, call).await
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let call = async { self.open(Self::within(self.deadlines.claim, "reclaim", self.inner.reclaim(req)).await?) };
        self.observed(Op::Reclaim, call).await
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        // Sealed once: a resend carries the same bytes (same nonce, same associated data).
        #[cfg(feature = "seal")]
        let stored = match &self.sealing {
            Some(sealing) => std::borrow::Cow::Owned(sealing.seal(id, token, &response)),
            None => std::borrow::Cow::Borrowed(&response),
        };
        #[cfg(not(feature = "seal"))]
        let stored = std::borrow::Cow::Borrowed(&response);
        let send = || self.inner.complete(id, token, StoredResponse::clone(&stored));
        self.observed(Op::Complete, self.finish(id, token, RecordState::Completed, "complete", send)).await
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        let call = self.finish(id, token, RecordState::Failed, "fail", || self.inner.fail(id, token));
        self.observed(Op::Fail, call).await
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        let call = Self::within(self.deadlines.extend, "extend", self.inner.extend(id, token, lease_ttl));
        self.observed(Op::Extend, call).await
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let call = async { self.open(Self::within(self.deadlines.read, "get", self.inner.get(id)).await?) };
        self.observed(Op::Get, call).await
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.observed(Op::Sweep, self.inner.sweep(limit)).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.journal_put_retried(id, token, name, value, overwrite).await
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.observed(
            Op::JournalGet,
            Self::within(self.deadlines.read, "journal_get", self.inner.journal_get(id, name)),
        )
        .await
    }
    /// An operator's listing: no request waits on it, so no deadline (like `sweep`).
    async fn list(&self, filter: idem_core::ListFilter) -> Result<idem_core::Listing, StoreError> {
        self.inner.list(filter).await
    }
}
