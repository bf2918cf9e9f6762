//! The storage contract every backend implements, and its typed outcomes.
//!
//! # Contract (all methods)
//! The same rules, with the reasons, are in `docs/contract.md#for-every-operation`.
//! - Every method is atomic on the backend's engine: another caller sees the record either
//!   before or after the operation, never half of it.
//! - Time comes from one clock per store (the server's where it has one, an injected
//!   [`crate::Clock`] otherwise) and every comparison is in milliseconds:
//!   a lease is fresh while `now < lease_expires_at`; a record is gone once
//!   `now >= expires_at`, whether or not a sweep has removed it yet.
//! - A lost race is an outcome (`ClaimOutcome::Existing`, `ReclaimOutcome::Conflict`,
//!   `StoreError::LeaseLost`), never a generic error: a key conflict is not a store failure
//!   (`docs/failures.md#concurrent-first-requests-both-run`).
//! - Keys, principals, endpoints, header values and bodies round-trip byte-exact.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use crate::codec::CodecError;
use crate::list::{ListFilter, Listing};
use crate::record::{FencingToken, Record, StoredResponse};
use crate::scope::RecordId;
use crate::settle::Settlements;
use crate::time::UnixMillis;
use crate::transition::{ClaimOutcome, ClaimRequest, LeaseLost, ReclaimOutcome, ReclaimRequest};

/// A boxed driver error, kept as the `source` of a [`StoreError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Complete or fail presented a token that is not the record's current in-flight claim
    /// (the lease was reclaimed by a newer attempt, the record completed, or it expired).
    /// Nothing was changed.
    #[error("lease lost on record {id:?}: presented token {presented}, current {current:?}")]
    LeaseLost {
        /// The record.
        id: RecordId,
        /// The token the caller presented.
        presented: FencingToken,
        /// The record's current token (`None`: the record is gone).
        current: Option<FencingToken>,
    },
    /// The backend could not be reached or refused the operation.
    #[error("{backend} store unavailable: {message}")]
    Unavailable {
        /// Backend name, e.g. `redis`.
        backend: &'static str,
        /// What was being done.
        message: String,
        /// Whether the same call may succeed if retried (connection loss, timeout,
        /// serialization failure, failover) or not (bad credentials, schema missing).
        retryable: bool,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
    /// A stored value does not decode.
    #[error("record {id:?} is corrupt")]
    Corrupt {
        /// The record, when known.
        id: Option<RecordId>,
        /// Why it does not decode.
        #[source]
        source: CodecError,
    },
    /// The backend does not offer this operation (see [`Capabilities`]).
    #[error("operation {operation} is not supported by this store")]
    Unsupported {
        /// The operation's name.
        operation: &'static str,
    },
}

impl StoreError {
    /// Wraps a driver error.
    pub fn unavailable(
        backend: &'static str,
        message: impl Into<String>,
        retryable: bool,
        source: impl Into<BoxError>,
    ) -> Self {
        StoreError::Unavailable { backend, message: message.into(), retryable, source: source.into() }
    }

    /// Builds `LeaseLost` from the pure transition's refusal.
    #[must_use]
    pub fn lease_lost(id: RecordId, lost: LeaseLost) -> Self {
        StoreError::LeaseLost { id, presented: lost.presented, current: lost.current }
    }

    /// Whether retrying the same call can help. `LeaseLost` never can: the caller's
    /// attempt is over.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Unavailable { retryable: true, .. })
    }

    /// Whether this is the fencing refusal.
    #[must_use]
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, StoreError::LeaseLost { .. })
    }

    /// Whether a stored record does not decode ([`StoreError::Corrupt`]). Unlike an
    /// unavailable store, retrying does not help, and a front end must not treat it as an
    /// outage: the record may be a completed operation, so running its handler again
    /// (fail-open) could repeat it.
    #[must_use]
    pub fn is_corrupt(&self) -> bool {
        matches!(self, StoreError::Corrupt { .. })
    }
}

/// What a backend offers beyond the required behaviour. The conformance suite runs the
/// matching scenario variants and reports which ones ran; it never skips silently.
///
/// Build it from [`Capabilities::NONE`] so that a capability added later stays off:
/// `Capabilities { backend: "mystore", journal: true, ..Capabilities::NONE }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// The backend's name (`memory`, `redb`, `sqlite`, `redis`, `postgres`; `custom` unless
    /// a store says): the `backend` label of the store metrics and the `backend` field of
    /// the start-up event (docs/observability.md).
    pub backend: &'static str,
    /// Records vanish on their own at `expires_at` (Redis `PEXPIREAT`); `sweep` is a no-op
    /// that reports zero.
    pub native_expiry: bool,
    /// Time comes from the server rather than from an in-process clock.
    pub server_clock: bool,
    /// Several processes may share the store.
    pub shared: bool,
    /// The store keeps a per-record journal ([`Store::journal_put`], [`Store::journal_get`])
    /// for resumable handlers' steps and intents.
    pub journal: bool,
    /// The store lists its records for operators ([`Store::list`]).
    pub list: bool,
}

impl Capabilities {
    /// No optional capability, backend `custom`.
    pub const NONE: Self = Self {
        backend: "custom",
        native_expiry: false,
        server_clock: false,
        shared: false,
        journal: false,
        list: false,
    };
}

impl Default for Capabilities {
    fn default() -> Self {
        Self::NONE
    }
}

/// What a fenced write ([`Store::complete`], [`Store::fail`], [`Store::extend`]) reports:
/// the times of the record as written, not the record. The response a completion stored
/// stays where it was written; the caller already holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Receipt {
    /// The caller's claim, unchanged by the write.
    pub token: FencingToken,
    /// When the lease runs out (ms since the epoch, the store's clock).
    pub lease_expires_at: UnixMillis,
    /// When the record is gone (ms since the epoch, the store's clock): the
    /// `Idempotency-Key-Expires` a response carries.
    pub expires_at: UnixMillis,
}

impl Receipt {
    /// The receipt of `record` as written.
    #[must_use]
    pub fn of(record: &Record) -> Self {
        Self { token: record.token, lease_expires_at: record.lease_expires_at, expires_at: record.expires_at }
    }
}

/// What a [`Store::journal_put`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JournalWrite {
    /// The entry was written.
    Written,
    /// An entry of that name already existed and `overwrite` was false: nothing was
    /// written; this is the stored value (the step already ran in an earlier attempt).
    Exists(Vec<u8>),
}

/// Longest journal entry name, bytes.
pub const MAX_JOURNAL_NAME: usize = 255;

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepOutcome {
    /// Records removed.
    pub removed: u64,
    /// Whether expired records may remain (the batch was full); call again.
    pub more: bool,
}

/// Idempotency record storage.
///
/// - The record's life: [`claim`](Store::claim), [`reclaim`](Store::reclaim),
///   [`complete`](Store::complete), [`fail`](Store::fail), [`extend`](Store::extend),
///   [`get`](Store::get).
/// - Housekeeping: [`sweep`](Store::sweep) (required: a store with native expiry answers
///   zero, see [`Capabilities::native_expiry`]; the `Sweeper` of feature `sweeper` runs it) and
///   [`list`](Store::list) for operators.
/// - Resumable handlers: [`journal_put`](Store::journal_put),
///   [`journal_get`](Store::journal_get).
///
/// What a store offers beyond the required methods is in [`Store::capabilities`]; the
/// optional methods default to [`StoreError::Unsupported`], so adding one breaks no
/// backend. Object safe: the HTTP layer holds an `Arc<dyn Store>`.
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Insert-if-absent.
    ///
    /// # Contract
    /// - If no record with `req.id` exists, or the existing one is past `expires_at`,
    ///   atomically write an in-flight record with `created_at = started_at = now`,
    ///   `lease_expires_at = now + lease_ttl`, `expires_at = now + max(retention, lease_ttl)`
    ///   and token [`FencingToken::first_at`]`(now)` (or, replacing an expired record still
    ///   present, the larger of that and its token + 1), and return
    ///   [`ClaimOutcome::Claimed`] with it.
    /// - Otherwise change nothing and return [`ClaimOutcome::Existing`] with the stored
    ///   record and the store's `now`.
    /// - Of N concurrent claims of one id, exactly one gets `Claimed`.
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError>;

    /// Compare-and-set takeover of an expired lease or a failed record.
    ///
    /// # Contract
    /// Applies iff the record exists, is not past `expires_at`, carries `req.expected`,
    /// has `req.fingerprint`, and is either failed or in flight with
    /// `now >= lease_expires_at`. Then the record becomes in flight with token + 1,
    /// `started_at = now`, `lease_expires_at = now + lease_ttl`,
    /// `expires_at = max(expires_at, now + retention)`, no response; returns
    /// [`ReclaimOutcome::Reclaimed`]. Otherwise nothing changes and
    /// [`ReclaimOutcome::Conflict`] carries the live record (or `None`). Of N concurrent
    /// reclaims with the same expected token, exactly one wins.
    ///
    /// The refusal itself is atomic; the record a `Conflict` reports may be read just after
    /// it (Postgres re-reads the row in a second statement), so it can already include a
    /// write that raced with the reclaim. Callers only use it to decide again, which is
    /// safe with a newer view; the conformance suite accepts any record written during the
    /// race and checks the refusal exactly.
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError>;

    /// Stores the terminal response.
    ///
    /// # Contract
    /// Applies iff the record is live, in flight, and carries `token`: the state becomes
    /// completed with `response`; all timestamps stay. Otherwise nothing changes and the
    /// call returns [`StoreError::LeaseLost`]. As with a reclaim's `Conflict`, the
    /// `current` token a refusal reports may be read just after the refusal (here and in
    /// `fail` and `journal_put`). Returns the written record's [`Receipt`].
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError>;

    /// Marks the attempt failed (handler error, panic, 5xx).
    ///
    /// # Contract
    /// Applies iff the record is live, in flight, and carries `token`: the state becomes
    /// failed and `lease_expires_at = min(lease_expires_at, now)`. Otherwise nothing
    /// changes and the call returns [`StoreError::LeaseLost`]. Returns the written record's
    /// [`Receipt`].
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError>;

    /// Renews the caller's lease (lease renewal while a handler runs).
    ///
    /// # Contract
    /// Applies iff the record is live, in flight, and carries `token` (whether or not its
    /// lease already ran out: until someone reclaims it, the holder may renew):
    /// `lease_expires_at = max(lease_expires_at, now + lease_ttl)` and
    /// `expires_at = max(expires_at, lease_expires_at)`; the token, state and every other
    /// field stay. Returns the written record's [`Receipt`]. Otherwise nothing changes and the call
    /// returns [`StoreError::LeaseLost`] (the claim was reclaimed, completed, failed, or the
    /// record is gone): the caller's attempt is over and it should stop before its next
    /// side effect.
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError>;

    /// Reads a record.
    ///
    /// # Contract
    /// Returns `None` for an absent record and for one past `expires_at`, swept or not.
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError>;

    /// Deletes up to `limit` records past `expires_at`.
    ///
    /// # Contract
    /// Never deletes a record with `now < expires_at` (so never a live claim: retention is
    /// at least the lease). Bounded work per call; `more` says whether to call again. A
    /// sweep racing a claim of the same id leaves either the old record or the new claim,
    /// never a mix. Stores with [`Capabilities::native_expiry`] return zero.
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError>;

    /// What this store offers.
    fn capabilities(&self) -> Capabilities;

    /// Writes journal entry `name` of record `id` (a step's result, an intent's state).
    ///
    /// # Contract
    /// - Fenced like `complete`: applies iff the record is live, in flight and carries
    ///   `token`; otherwise nothing changes and the call returns [`StoreError::LeaseLost`].
    /// - With `overwrite == false` an existing entry is kept and returned as
    ///   [`JournalWrite::Exists`] (first write wins: a step runs once per record); with
    ///   `overwrite == true` it is replaced (an intent moving from pending to done).
    /// - Entries live and die with their record: a reclaim keeps them (that is how a retry
    ///   resumes), a sweep or native expiry removes them with the record, and a claim that
    ///   replaces an expired record starts with no entries.
    /// - The token check comes first: a stale owner gets `LeaseLost`, never the stored
    ///   value (it may read with [`Store::journal_get`], which is not fenced).
    /// - `name` is 1..=[`MAX_JOURNAL_NAME`] bytes (callers must not pass others; a store
    ///   may refuse them with an error, and [`crate::Resumable`] checks first); any bytes
    ///   are allowed in a name; values round-trip byte-exact.
    ///
    /// The default returns [`StoreError::Unsupported`]; stores that implement it set
    /// [`Capabilities::journal`].
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        let _ = (id, token, name, value, overwrite);
        Err(StoreError::Unsupported { operation: "journal_put" })
    }

    /// Reads journal entry `name` of record `id`.
    ///
    /// # Contract
    /// `None` when the entry was never written, or its record is absent or past
    /// `expires_at`. Not fenced: any attempt may read.
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let _ = (id, name);
        Err(StoreError::Unsupported { operation: "journal_get" })
    }

    /// Lists live records for operators (the `idem` CLI), one page at a time (see
    /// [`crate::list`] for the order and paging).
    ///
    /// # Contract
    /// - Returns the records with `now < expires_at` that match every condition of
    ///   `filter` ([`ListFilter::matches`]), ascending by [`RecordId`], at most
    ///   `filter.limit` of them, with `more` true exactly when further records matched,
    ///   and the store's `now`.
    /// - Reads only: changes nothing, takes no lease. Not a snapshot across pages: a record
    ///   written between two calls may or may not appear.
    /// - A record that does not decode is an error ([`StoreError::Corrupt`]), so an
    ///   operator never reads a partial listing as complete.
    ///
    /// The default returns [`StoreError::Unsupported`]; stores that implement it set
    /// [`Capabilities::list`].
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        let _ = filter;
        Err(StoreError::Unsupported { operation: "list" })
    }

    /// Where this store announces that a record settled (completed or failed), so a
    /// duplicate waiting for it re-reads at once instead of at its next poll; `None` (the
    /// default): waiters poll. A store that returns one settles every record it completes
    /// or fails; a wrapper returns its inner store's (`docs/contract.md#waking-a-waiting-duplicate`).
    fn settlements(&self) -> Option<&Settlements> {
        None
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        (**self).claim(req).await
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        (**self).reclaim(req).await
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        (**self).complete(id, token, response).await
    }
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        (**self).fail(id, token).await
    }
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        (**self).extend(id, token, lease_ttl).await
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        (**self).get(id).await
    }
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        (**self).sweep(limit).await
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        (**self).journal_put(id, token, name, value, overwrite).await
    }
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        (**self).journal_get(id, name).await
    }
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        (**self).list(filter).await
    }
    fn settlements(&self) -> Option<&Settlements> {
        (**self).settlements()
    }
}
