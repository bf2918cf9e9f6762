//! The record state machine as pure functions: given the current record (if any), a
//! request and `now`, what the record becomes and what the caller is told.
//!
//! ```text
//! absent --claim--> in_flight(token = first_at(now))
//! in_flight --complete(token)--> completed
//! in_flight --fail(token)--> failed
//! in_flight --extend(token)--> in_flight              (lease renewed, same token)
//! in_flight, lease expired --reclaim CAS(token)--> in_flight(token+1)
//! failed --reclaim CAS(token)--> in_flight(token+1)   (same fingerprint only)
//! any state --retention passes--> absent
//! ```
//!
//! Stores that run a read-modify-write inside one transaction (memory, redb, SQLite) call
//! these directly, so every such backend shares one implementation of the rules; stores
//! that run the rules server-side (Redis Lua, Postgres SQL) restate them. The conformance
//! suite's model test checks all of them, these functions included, against a second
//! statement of the rules (`idem_conformance::Spec`) that does not call them.

use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{FencingToken, Record, RecordState, StoredResponse};
use crate::scope::{RecordId, Scope};
use crate::time::UnixMillis;

/// Ask to claim `key` in `scope`: insert an in-flight record if none is live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRequest {
    /// `scope.record_id(&key)`.
    pub(crate) id: RecordId,
    /// The scope.
    pub(crate) scope: Scope,
    /// The key.
    pub(crate) key: IdempotencyKey,
    /// The request's fingerprint.
    pub(crate) fingerprint: Fingerprint,
    /// Lease length. Zero is allowed and means "expires at once": every lease is finite.
    pub(crate) lease_ttl: Duration,
    /// Retention window, measured from this claim; raised to `lease_ttl` if shorter.
    pub(crate) retention: Duration,
}

impl ClaimRequest {
    /// Builds a claim, deriving the record id.
    #[must_use]
    pub fn new(
        scope: Scope,
        key: IdempotencyKey,
        fingerprint: Fingerprint,
        lease_ttl: Duration,
        retention: Duration,
    ) -> Self {
        Self { id: scope.record_id(&key), scope, key, fingerprint, lease_ttl, retention }
    }

    /// `scope.record_id(&key)`.
    #[must_use]
    pub fn id(&self) -> RecordId {
        self.id
    }

    /// The scope.
    #[must_use]
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The key.
    #[must_use]
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The request's fingerprint.
    #[must_use]
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// Lease length, as requested.
    #[must_use]
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Retention window, as requested (before it is raised to the lease).
    #[must_use]
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Lease in ms, as stores write it.
    #[must_use]
    pub fn lease_ms(&self) -> i64 {
        crate::time::duration_ms(self.lease_ttl)
    }

    /// Effective retention in ms (never shorter than the lease).
    #[must_use]
    pub fn retention_ms(&self) -> i64 {
        effective_retention_ms(self.lease_ttl, self.retention)
    }
}

/// Retention in ms as every claim and reclaim applies it: never shorter than the lease, so
/// a live claim is never swept.
fn effective_retention_ms(lease: Duration, retention: Duration) -> i64 {
    crate::time::duration_ms(retention.max(lease))
}

/// Ask to take over a record whose lease expired or which failed: a compare-and-set on
/// `expected`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReclaimRequest {
    /// The record.
    pub id: RecordId,
    /// The token the caller saw; the reclaim applies only if it is still current.
    pub expected: FencingToken,
    /// The retry's fingerprint; must equal the record's.
    pub fingerprint: Fingerprint,
    /// Lease length for the new attempt.
    pub lease_ttl: Duration,
    /// Retention from now; the record's `expires_at` never moves earlier.
    pub retention: Duration,
}

impl ReclaimRequest {
    /// Lease in ms.
    #[must_use]
    pub fn lease_ms(&self) -> i64 {
        crate::time::duration_ms(self.lease_ttl)
    }

    /// Effective retention in ms (never shorter than the lease).
    #[must_use]
    pub fn retention_ms(&self) -> i64 {
        effective_retention_ms(self.lease_ttl, self.retention)
    }
}

/// What a claim found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// This caller created (or replaced an expired) record and holds its lease.
    Claimed(Record),
    /// A live record exists; the caller decides with [`crate::decide`] using `now`.
    Existing {
        /// The record as stored.
        record: Record,
        /// The store's clock when it read the record.
        now: UnixMillis,
    },
}

/// What a reclaim did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReclaimOutcome {
    /// The caller won the compare-and-set and holds the new token.
    Reclaimed(Record),
    /// The record was not reclaimable: the token moved on, the lease is fresh, the record
    /// completed, the fingerprint differs, or it no longer exists (`current` is `None`).
    /// Nothing was written.
    Conflict {
        /// The record as it is now.
        current: Option<Record>,
        /// The store's clock.
        now: UnixMillis,
    },
}

/// Why a complete or fail was refused: the caller's token is not the current claim's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseLost {
    /// The token the caller presented.
    pub presented: FencingToken,
    /// The record's current token, `None` when the record is gone.
    pub current: Option<FencingToken>,
}

/// Claim: returns the record to write (if any) and the outcome.
#[must_use]
pub fn claim(current: Option<&Record>, req: &ClaimRequest, now: UnixMillis) -> (Option<Record>, ClaimOutcome) {
    match current {
        Some(r) if !r.is_expired(now) => (None, ClaimOutcome::Existing { record: r.clone(), now }),
        _ => {
            let record = new_generation(current, req, now);
            (Some(record.clone()), ClaimOutcome::Claimed(record))
        }
    }
}

/// The record a claim writes over `current`, which is absent or expired: a new generation.
pub(crate) fn new_generation(current: Option<&Record>, req: &ClaimRequest, now: UnixMillis) -> Record {
    // A new generation's token comes from the clock, so it is above every token of every
    // earlier generation, including ones whose record already left the store; replacing an
    // expired record that is still here also stays above its token.
    let first = FencingToken::first_at(now);
    let token = current.map_or(first, |r| r.token.next().max(first));
    Record {
        id: req.id,
        scope: req.scope.clone(),
        key: req.key.clone(),
        fingerprint: req.fingerprint,
        state: RecordState::InFlight,
        token,
        response: None,
        created_at: now,
        started_at: now,
        lease_expires_at: UnixMillis(now.0.saturating_add(req.lease_ms())),
        expires_at: UnixMillis(now.0.saturating_add(req.retention_ms())),
    }
}

/// Whether `r` may be reclaimed by `req` at `now`.
#[must_use]
pub fn is_reclaimable(r: &Record, req: &ReclaimRequest, now: UnixMillis) -> bool {
    !r.is_expired(now)
        && r.token == req.expected
        && r.fingerprint == req.fingerprint
        && match r.state {
            RecordState::Failed => true,
            RecordState::InFlight => !r.lease_is_fresh(now),
            RecordState::Completed => false,
        }
}

/// Reclaim: compare-and-set on the token.
#[must_use]
pub fn reclaim(current: Option<&Record>, req: &ReclaimRequest, now: UnixMillis) -> (Option<Record>, ReclaimOutcome) {
    match current {
        Some(r) if is_reclaimable(r, req, now) => {
            let mut next = r.clone();
            next.state = RecordState::InFlight;
            next.token = r.token.next();
            next.response = None;
            next.started_at = now;
            next.lease_expires_at = UnixMillis(now.0.saturating_add(req.lease_ms()));
            next.expires_at = r.expires_at.max(UnixMillis(now.0.saturating_add(req.retention_ms())));
            (Some(next.clone()), ReclaimOutcome::Reclaimed(next))
        }
        _ => (None, ReclaimOutcome::Conflict { current: current.filter(|r| !r.is_expired(now)).cloned(), now }),
    }
}

fn check_owner(
    current: Option<&Record>,
    id: RecordId,
    token: FencingToken,
    now: UnixMillis,
) -> Result<&Record, LeaseLost> {
    match current {
        Some(r) if r.id == id && !r.is_expired(now) && r.state == RecordState::InFlight && r.token == token => Ok(r),
        Some(r) if !r.is_expired(now) => Err(LeaseLost { presented: token, current: Some(r.token) }),
        _ => Err(LeaseLost { presented: token, current: None }),
    }
}

/// Journal write check: the caller must hold the record's current in-flight claim.
///
/// # Errors
/// [`LeaseLost`] when `token` is not the current in-flight claim.
pub fn check_journal_owner(
    current: Option<&Record>,
    id: RecordId,
    token: FencingToken,
    now: UnixMillis,
) -> Result<(), LeaseLost> {
    check_owner(current, id, token, now).map(|_| ())
}

/// Complete: compare-and-set on the token; stores the response.
///
/// # Errors
/// [`LeaseLost`] when `token` is not the current in-flight claim.
pub fn complete(
    current: Option<&Record>,
    id: RecordId,
    token: FencingToken,
    response: StoredResponse,
    now: UnixMillis,
) -> Result<Record, LeaseLost> {
    let r = check_owner(current, id, token, now)?;
    let mut next = r.clone();
    next.state = RecordState::Completed;
    next.response = Some(response);
    Ok(next)
}

/// Fail: compare-and-set on the token; the record becomes reclaimable by a retry with the
/// same fingerprint.
///
/// # Errors
/// [`LeaseLost`] when `token` is not the current in-flight claim.
pub fn fail(current: Option<&Record>, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<Record, LeaseLost> {
    let r = check_owner(current, id, token, now)?;
    let mut next = r.clone();
    next.state = RecordState::Failed;
    next.response = None;
    // The attempt is over: its lease no longer blocks anyone.
    next.lease_expires_at = next.lease_expires_at.min(now);
    Ok(next)
}

/// Extend (renew): compare-and-set on the token; moves the lease to `now + lease_ttl` (never
/// earlier than it was) and the retention end to at least the new lease end, so a renewed
/// claim is never swept. The token stays: the holder keeps writing with it.
///
/// # Errors
/// [`LeaseLost`] when `token` is not the current in-flight claim.
pub fn extend(
    current: Option<&Record>,
    id: RecordId,
    token: FencingToken,
    lease_ttl: Duration,
    now: UnixMillis,
) -> Result<Record, LeaseLost> {
    let r = check_owner(current, id, token, now)?;
    let mut next = r.clone();
    let lease_end = UnixMillis(now.0.saturating_add(crate::time::duration_ms(lease_ttl)));
    next.lease_expires_at = next.lease_expires_at.max(lease_end);
    next.expires_at = next.expires_at.max(next.lease_expires_at);
    Ok(next)
}
