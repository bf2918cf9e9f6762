//! The record-table seam: what a store that runs the rules in-process must offer.
//!
//! A store whose engine gives it transactions over ordinary tables (a map behind a mutex,
//! redb, SQLite, files) implements [`RecordTable`] for one open transaction: point reads
//! and writes of records, journal entries, and an expiry index. [`crate::engine`] runs
//! every [`crate::Store`] operation on top of it through the pure rules of
//! [`crate::transition`], so such a store never restates a rule; with the group-commit
//! executor (feature `group-commit`) it does not restate batching either.
//!
//! # Contract
//! - Every method acts inside the one transaction the table was opened in; the caller
//!   commits or aborts it. Nothing here commits.
//! - [`RecordRead::read`] returns the record as stored, expired or not (the engine decides
//!   what "expired" means), and [`crate::StoreError::Corrupt`] for bytes that do not decode.
//! - [`RecordTable::write`] replaces the whole record and keeps the expiry index at exactly
//!   one entry per record, keyed by `expires_at` (`old` is what `read` returned, so a
//!   store can move the entry without a second read).
//! - [`RecordTable::create`] writes a record only where none is stored, and otherwise
//!   leaves the stored one (and its index entry) exactly as they were.
//! - A method that fails having changed nothing returns its error and leaves the
//!   transaction usable; a failure that leaves the transaction in an unknown state must
//!   also make [`RecordTable::is_poisoned`] true, so the batch is aborted as a whole.

use crate::list::{ListFilter, Listing};
use crate::record::Record;
use crate::scope::RecordId;
use crate::store::StoreError;
use crate::time::UnixMillis;

/// A record the expiry index lists as past its retention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Expired {
    /// When its retention ended, ms since the epoch (the index key).
    pub expires_at: UnixMillis,
    /// The record.
    pub id: RecordId,
}

/// Point reads, valid in a read or a write transaction.
pub trait RecordRead {
    /// The record with `id` as stored, expired or not; `None` when there is none.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] when the stored bytes do not decode; an engine error otherwise.
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError>;

    /// Journal entry `name` of record `id`, whatever the record's state.
    ///
    /// # Errors
    /// An engine error.
    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError>;

    /// Visits every stored record, expired or not, in any order, for the default
    /// [`RecordRead::list`]. The default answers [`StoreError::Unsupported`]: a table that
    /// cannot enumerate its records simply does not offer listing.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for a record that does not decode; an engine error otherwise.
    fn scan(&self, visit: &mut dyn FnMut(Record)) -> Result<(), StoreError> {
        let _ = visit;
        Err(StoreError::Unsupported { operation: "list" })
    }

    /// A page of [`crate::Store::list`] at `now`. The default selects from
    /// [`RecordRead::scan`], which visits every record; a table with an ordered index
    /// reads only the page.
    ///
    /// # Errors
    /// As [`RecordRead::scan`].
    fn list(&self, filter: &ListFilter, now: UnixMillis) -> Result<Listing, StoreError> {
        let mut matching = Vec::new();
        self.scan(&mut |r| {
            if filter.matches(&r, now) {
                matching.push(r);
            }
        })?;
        Ok(filter.select(matching, now))
    }
}

/// Writes inside one write transaction (see the module's contract).
pub trait RecordTable: RecordRead {
    /// Writes `new` in place of `old` (`None`: no record with that id exists) and moves its
    /// expiry index entry when `expires_at` changed.
    ///
    /// # Errors
    /// An engine error; a value the engine refuses before writing anything (too large)
    /// leaves the transaction usable.
    fn write(&mut self, old: Option<&Record>, new: &Record) -> Result<(), StoreError>;

    /// [`RecordTable::write`] of a record the caller no longer needs: a table that keeps
    /// records as values (the in-memory model) takes it without a copy. The default writes
    /// through [`RecordTable::write`].
    ///
    /// # Errors
    /// As [`RecordTable::write`].
    fn write_owned(&mut self, old: Option<&Record>, new: Record) -> Result<(), StoreError> {
        self.write(old, &new)
    }

    /// Writes `new` (with its index entry) when no record with its id is stored, expired
    /// or not, and returns `None`; otherwise changes nothing and returns the stored record,
    /// as [`RecordRead::read`] would. A first claim is one lookup this way: a table whose
    /// engine reports what an insert found (redb's `insert`, SQLite's `ON CONFLICT DO
    /// NOTHING`) does not read before it writes. The default reads, then writes.
    ///
    /// # Errors
    /// As [`RecordRead::read`] and [`RecordTable::write`].
    fn create(&mut self, new: &Record) -> Result<Option<Record>, StoreError> {
        match self.read(new.id)? {
            Some(stored) => Ok(Some(stored)),
            None => self.write(None, new).map(|()| None),
        }
    }

    /// Up to `limit` index entries with `expires_at <= now`, oldest first.
    ///
    /// # Errors
    /// An engine error.
    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<Expired>, StoreError>;

    /// Removes the record and its index entry (not its journal: see
    /// [`RecordTable::journal_clear`]). The index is the authority: the record is not
    /// decoded first, so a corrupt record still leaves once its retention has passed.
    ///
    /// # Errors
    /// An engine error.
    fn remove(&mut self, expired: Expired) -> Result<(), StoreError>;

    /// Writes journal entry `name` of record `id`, replacing any entry of that name.
    ///
    /// # Errors
    /// An engine error; a value the engine refuses before writing anything leaves the
    /// transaction usable.
    fn journal_write(&mut self, id: RecordId, name: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Removes every journal entry of record `id`.
    ///
    /// # Errors
    /// An engine error.
    fn journal_clear(&mut self, id: RecordId) -> Result<(), StoreError>;

    /// Whether an earlier failure left the transaction unable to commit what it holds
    /// (SQLite rolled it back, redb refused a write half-way). The executor then fails the
    /// whole batch instead of committing it. The default is `false`: a table whose every
    /// error leaves the transaction usable needs nothing more.
    fn is_poisoned(&self) -> bool {
        false
    }
}
