//! The one engine of every in-process store: each [`crate::Store`] operation as a
//! read-compute-write on a [`RecordTable`], through the pure rules of [`crate::transition`].
//!
//! The memory store, redb, SQLite and the file-store example run it inside their own
//! transactions; none of them restates a rule. Operations that write are data ([`Write`],
//! applied with [`apply`]), so an executor can queue them, apply a batch of them in one
//! transaction and answer each caller with its own [`Written`] outcome; reads are
//! [`get`] and [`journal_get`].
//!
//! Every function reads what it needs and decides before it changes anything: a refusal
//! (`LeaseLost`, a corrupt record, a value the engine will not take) leaves the
//! transaction as it was.

use crate::record::{FencingToken, Record, StoredResponse};
use crate::scope::RecordId;
use crate::store::{JournalWrite, Receipt, StoreError, SweepOutcome};
use crate::table::{RecordRead, RecordTable};
use crate::time::UnixMillis;
use crate::transition::{self, ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};

/// See [`crate::Store::claim`].
///
/// # Errors
/// What the table reports.
pub(crate) fn claim<T: RecordTable + ?Sized>(
    t: &mut T,
    req: &ClaimRequest,
    now: UnixMillis,
) -> Result<ClaimOutcome, StoreError> {
    // A live record is the replay path (the pure rule writes nothing for it): hand over the
    // record as read, without the copy `transition::claim` would make of it.
    let current = match t.read(req.id)? {
        Some(record) if !record.is_expired(now) => return Ok(ClaimOutcome::Existing { record, now }),
        other => other,
    };
    let (write, outcome) = transition::claim(current.as_ref(), req, now);
    if let Some(new) = write {
        // A claim that replaces an expired record starts with an empty journal. The old
        // entries go first: on a store without transactions (files) a crash in between
        // leaves an expired record without entries, never a new claim with old entries.
        if current.is_some() {
            t.journal_clear(new.id)?;
        }
        // The pure rule handed out its own copy for the outcome; this one goes to the table.
        t.write_owned(current.as_ref(), new)?;
    }
    Ok(outcome)
}

/// See [`crate::Store::reclaim`].
///
/// # Errors
/// What the table reports.
pub(crate) fn reclaim<T: RecordTable + ?Sized>(
    t: &mut T,
    req: &ReclaimRequest,
    now: UnixMillis,
) -> Result<ReclaimOutcome, StoreError> {
    let current = t.read(req.id)?;
    let (write, outcome) = transition::reclaim(current.as_ref(), req, now);
    if let Some(new) = write {
        t.write(current.as_ref(), &new)?;
    }
    Ok(outcome)
}

/// See [`crate::Store::complete`].
///
/// # Errors
/// [`StoreError::LeaseLost`] when `token` is not the current claim; what the table reports.
pub(crate) fn complete<T: RecordTable + ?Sized>(
    t: &mut T,
    id: RecordId,
    token: FencingToken,
    response: StoredResponse,
    now: UnixMillis,
) -> Result<Receipt, StoreError> {
    let current = t.read(id)?;
    let new = transition::complete(current.as_ref(), id, token, response, now)
        .map_err(|lost| StoreError::lease_lost(id, lost))?;
    let receipt = Receipt::of(&new);
    t.write_owned(current.as_ref(), new)?;
    Ok(receipt)
}

/// See [`crate::Store::fail`].
///
/// # Errors
/// [`StoreError::LeaseLost`] when `token` is not the current claim; what the table reports.
pub(crate) fn fail<T: RecordTable + ?Sized>(
    t: &mut T,
    id: RecordId,
    token: FencingToken,
    now: UnixMillis,
) -> Result<Receipt, StoreError> {
    let current = t.read(id)?;
    let new = transition::fail(current.as_ref(), id, token, now).map_err(|lost| StoreError::lease_lost(id, lost))?;
    let receipt = Receipt::of(&new);
    t.write_owned(current.as_ref(), new)?;
    Ok(receipt)
}

/// See [`crate::Store::extend`].
///
/// # Errors
/// [`StoreError::LeaseLost`] when `token` is not the current claim; what the table reports.
pub(crate) fn extend<T: RecordTable + ?Sized>(
    t: &mut T,
    id: RecordId,
    token: FencingToken,
    lease_ttl: std::time::Duration,
    now: UnixMillis,
) -> Result<Receipt, StoreError> {
    let current = t.read(id)?;
    let new = transition::extend(current.as_ref(), id, token, lease_ttl, now)
        .map_err(|lost| StoreError::lease_lost(id, lost))?;
    let receipt = Receipt::of(&new);
    t.write_owned(current.as_ref(), new)?;
    Ok(receipt)
}

/// See [`crate::Store::get`].
///
/// # Errors
/// What the view reports.
pub fn get<V: RecordRead + ?Sized>(view: &V, id: RecordId, now: UnixMillis) -> Result<Option<Record>, StoreError> {
    Ok(view.read(id)?.filter(|r| !r.is_expired(now)))
}

/// See [`crate::Store::sweep`]: removes up to `limit` expired records, oldest expiry first,
/// with their journals.
///
/// # Errors
/// What the table reports.
pub(crate) fn sweep<T: RecordTable + ?Sized>(
    t: &mut T,
    limit: usize,
    now: UnixMillis,
) -> Result<SweepOutcome, StoreError> {
    // One more than the batch, to tell whether another call is needed.
    let mut expired = t.expired(now, limit.saturating_add(1))?;
    let more = expired.len() > limit;
    expired.truncate(limit);
    for e in &expired {
        t.journal_clear(e.id)?;
        t.remove(*e)?;
    }
    Ok(SweepOutcome { removed: expired.len() as u64, more })
}

/// See [`crate::Store::journal_put`].
///
/// # Errors
/// [`StoreError::LeaseLost`] when `token` is not the current claim (checked before the
/// entry is looked at); what the table reports.
pub(crate) fn journal_put<T: RecordTable + ?Sized>(
    t: &mut T,
    id: RecordId,
    token: FencingToken,
    name: &str,
    value: &[u8],
    overwrite: bool,
    now: UnixMillis,
) -> Result<JournalWrite, StoreError> {
    let current = t.read(id)?;
    transition::check_journal_owner(current.as_ref(), id, token, now)
        .map_err(|lost| StoreError::lease_lost(id, lost))?;
    if !overwrite && let Some(stored) = t.journal_read(id, name)? {
        return Ok(JournalWrite::Exists(stored));
    }
    t.journal_write(id, name, value)?;
    Ok(JournalWrite::Written)
}

/// See [`crate::Store::journal_get`].
///
/// # Errors
/// What the view reports.
pub fn journal_get<V: RecordRead + ?Sized>(
    view: &V,
    id: RecordId,
    name: &str,
    now: UnixMillis,
) -> Result<Option<Vec<u8>>, StoreError> {
    if get(view, id, now)?.is_none() {
        return Ok(None);
    }
    view.journal_read(id, name)
}

/// An operation that may write, as data: what an executor queues and applies in a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Write {
    /// [`crate::Store::claim`].
    Claim(ClaimRequest),
    /// [`crate::Store::reclaim`].
    Reclaim(ReclaimRequest),
    /// [`crate::Store::complete`].
    Complete {
        /// The record.
        id: RecordId,
        /// The caller's claim.
        token: FencingToken,
        /// The response to store.
        response: StoredResponse,
    },
    /// [`crate::Store::fail`].
    Fail {
        /// The record.
        id: RecordId,
        /// The caller's claim.
        token: FencingToken,
    },
    /// [`crate::Store::extend`].
    Extend {
        /// The record.
        id: RecordId,
        /// The caller's claim.
        token: FencingToken,
        /// The new lease, from the store's `now`.
        lease_ttl: std::time::Duration,
    },
    /// [`crate::Store::sweep`].
    Sweep {
        /// Most records to remove.
        limit: usize,
    },
    /// [`crate::Store::journal_put`].
    JournalPut {
        /// The record.
        id: RecordId,
        /// The caller's claim.
        token: FencingToken,
        /// Entry name.
        name: String,
        /// Entry value.
        value: Vec<u8>,
        /// Replace an existing entry.
        overwrite: bool,
    },
}

impl Write {
    /// Whether the operation only matters while its caller waits for it: a claim or a
    /// reclaim whose caller went away would hold a lease nobody uses, so an executor may
    /// skip it. Completions, fails, journal writes and sweeps are worth applying anyway.
    #[must_use]
    #[cfg(feature = "group-commit")]
    pub(crate) fn is_claim(&self) -> bool {
        matches!(self, Write::Claim(_) | Write::Reclaim(_))
    }
}

/// The outcome of a [`Write`], one variant per operation kind.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Written {
    /// Of [`Write::Claim`].
    Claim(ClaimOutcome),
    /// Of [`Write::Reclaim`].
    Reclaim(ReclaimOutcome),
    /// Of [`Write::Complete`], [`Write::Fail`] and [`Write::Extend`]: the written record's times.
    Receipt(Receipt),
    /// Of [`Write::Sweep`].
    Sweep(SweepOutcome),
    /// Of [`Write::JournalPut`].
    Journal(JournalWrite),
}

/// Applies one [`Write`] on `t` at `now`.
///
/// # Errors
/// As the matching function of this module.
pub fn apply<T: RecordTable + ?Sized>(t: &mut T, write: Write, now: UnixMillis) -> Result<Written, StoreError> {
    Ok(match write {
        Write::Claim(req) => Written::Claim(claim(t, &req, now)?),
        Write::Reclaim(req) => Written::Reclaim(reclaim(t, &req, now)?),
        Write::Complete { id, token, response } => Written::Receipt(complete(t, id, token, response, now)?),
        Write::Fail { id, token } => Written::Receipt(fail(t, id, token, now)?),
        Write::Extend { id, token, lease_ttl } => Written::Receipt(extend(t, id, token, lease_ttl, now)?),
        Write::Sweep { limit } => Written::Sweep(sweep(t, limit, now)?),
        Write::JournalPut { id, token, name, value, overwrite } => {
            Written::Journal(journal_put(t, id, token, &name, &value, overwrite, now)?)
        }
    })
}

/// A wrong-kind outcome from an executor: a bug in the executor, reported as an error
/// rather than a panic.
fn wrong_kind(backend: &'static str) -> StoreError {
    StoreError::unavailable(
        backend,
        "the executor answered with another operation's outcome",
        false,
        "wrong outcome kind",
    )
}

impl Written {
    /// The claim outcome; an error naming `backend` for any other kind.
    ///
    /// # Errors
    /// When this is not a claim's outcome.
    pub fn into_claim(self, backend: &'static str) -> Result<ClaimOutcome, StoreError> {
        if let Written::Claim(o) = self { Ok(o) } else { Err(wrong_kind(backend)) }
    }

    /// The reclaim outcome.
    ///
    /// # Errors
    /// When this is not a reclaim's outcome.
    pub fn into_reclaim(self, backend: &'static str) -> Result<ReclaimOutcome, StoreError> {
        if let Written::Reclaim(o) = self { Ok(o) } else { Err(wrong_kind(backend)) }
    }

    /// The receipt of a complete, a fail or an extend.
    ///
    /// # Errors
    /// When this is not a complete's, fail's or extend's outcome.
    pub fn into_receipt(self, backend: &'static str) -> Result<Receipt, StoreError> {
        if let Written::Receipt(o) = self { Ok(o) } else { Err(wrong_kind(backend)) }
    }

    /// The sweep outcome.
    ///
    /// # Errors
    /// When this is not a sweep's outcome.
    pub fn into_sweep(self, backend: &'static str) -> Result<SweepOutcome, StoreError> {
        if let Written::Sweep(o) = self { Ok(o) } else { Err(wrong_kind(backend)) }
    }

    /// The journal write outcome.
    ///
    /// # Errors
    /// When this is not a journal write's outcome.
    pub fn into_journal(self, backend: &'static str) -> Result<JournalWrite, StoreError> {
        if let Written::Journal(o) = self { Ok(o) } else { Err(wrong_kind(backend)) }
    }
}
