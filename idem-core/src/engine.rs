//! The one engine of every in-process store: each [`crate::Store`] operation as a
//! read-compute-write on a [`RecordTable`], through the pure rules of [`crate::transition`].
//!
//! The memory store, redb, SQLite and the file-store example run it inside their own
//! transactions; none of them restates a rule. Each function answers with its operation's
//! own outcome type, so an executor that queues operations and applies a batch of them in
//! one transaction (`crate::group_commit`) hands every caller exactly what its
//! [`crate::Store`] method returns; reads are [`get`] and [`journal_get`].
//!
//! Every function reads what it needs and decides before it changes anything (a claim's
//! [`RecordTable::create`] writes only where nothing is stored, which is what it decides
//! on): a refusal (`LeaseLost`, a corrupt record, a value the engine will not take) leaves
//! the transaction as it was.

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
pub fn claim<T: RecordTable + ?Sized>(
    t: &mut T,
    req: &ClaimRequest,
    now: UnixMillis,
) -> Result<ClaimOutcome, StoreError> {
    // A claim that reaches a table mostly finds nothing (a store with read views answers
    // the claims of live records from them), so it is written where nothing is stored, and
    // what is stored is looked at only when there is something: one lookup, not a read
    // and then a write.
    let first = transition::new_generation(None, req, now);
    let current = match t.create(&first)? {
        None => return Ok(ClaimOutcome::Claimed(first)),
        // The replay path (the pure rule writes nothing for it): the record as read,
        // without the copy `transition::claim` would make of it.
        Some(record) if !record.is_expired(now) => return Ok(ClaimOutcome::Existing { record, now }),
        Some(expired) => expired,
    };
    let (write, outcome) = transition::claim(Some(&current), req, now);
    if let Some(new) = write {
        // A claim that replaces an expired record starts with an empty journal. The old
        // entries go first: on a store without transactions (files) a crash in between
        // leaves an expired record without entries, never a new claim with old entries.
        t.journal_clear(new.id)?;
        // The pure rule handed out its own copy for the outcome; this one goes to the table.
        t.write_owned(Some(&current), new)?;
    }
    Ok(outcome)
}

/// See [`crate::Store::reclaim`].
///
/// # Errors
/// What the table reports.
pub fn reclaim<T: RecordTable + ?Sized>(
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
pub fn complete<T: RecordTable + ?Sized>(
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
pub fn fail<T: RecordTable + ?Sized>(
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
pub fn extend<T: RecordTable + ?Sized>(
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
pub fn sweep<T: RecordTable + ?Sized>(t: &mut T, limit: usize, now: UnixMillis) -> Result<SweepOutcome, StoreError> {
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
pub fn journal_put<T: RecordTable + ?Sized>(
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
