//! The store's three redb tables, and the record-table seam ([`idem_core::table`]) over
//! them: `RedbTable` in a write transaction (what the group-commit writer applies batches
//! to), `RedbView` in a read transaction (claims of live records, `get`, `journal_get`,
//! `list`), and `RedbEngine`, which runs the writer's transactions
//! ([`idem_core::group_commit::Engine`]).
//!
//! The rules themselves are [`idem_core::engine`]'s; this module only stores bytes.

use std::sync::Arc;

use idem_core::group_commit::{Engine, Stage, TransactionFailed};
use idem_core::table::{Expired, RecordRead, RecordTable};
use idem_core::{ListFilter, Listing, Record, RecordId, StoreError, UnixMillis, codec};
use redb::{
    Database, ReadTransaction, ReadableDatabase, ReadableTable, StorageError, TableDefinition, WriteTransaction,
};

use crate::error::{BACKEND, Error};
use crate::handle::{Handle, needs_reopen};

const RECORDS_NAME: &str = "idem_records";
const EXPIRY_NAME: &str = "idem_expiry";
const JOURNAL_NAME: &str = "idem_journal";

/// Records: record id (32 bytes) -> [`idem_core::codec::encode`]d record (one
/// format-version byte, then postcard).
pub const RECORDS: TableDefinition<'static, &'static [u8; 32], &'static [u8]> = TableDefinition::new(RECORDS_NAME);

/// The expiry index: (`expires_at` in ms since the epoch, record id) -> `()`. redb orders
/// `i64` keys numerically and tuples field by field, so a range scan up to `(now, max id)`
/// visits exactly the expired records, oldest first, without reading the records table.
/// Every write that changes a record's `expires_at` moves its entry in the same write
/// transaction, so the index holds exactly one entry per record.
pub const EXPIRY: TableDefinition<'static, (i64, [u8; 32]), ()> = TableDefinition::new(EXPIRY_NAME);

/// The journal of resumable handlers (steps, intents): (record id, entry name) -> value
/// bytes. Entries live and die with their record: the sweep that removes a record and the
/// claim that replaces an expired one remove its entries in the same write transaction.
pub const JOURNAL: TableDefinition<'static, (&'static [u8; 32], &'static str), &'static [u8]> =
    TableDefinition::new(JOURNAL_NAME);

fn table_error(table: &'static str) -> impl FnOnce(redb::TableError) -> Error {
    move |source| Error::Table { table, source }
}

fn read_record(
    records: &impl ReadableTable<&'static [u8; 32], &'static [u8]>,
    id: RecordId,
) -> Result<Option<Record>, StoreError> {
    let Some(value) = records.get(id.as_bytes()).map_err(Error::from)? else {
        return Ok(None);
    };
    decode_record(id, value.value()).map(Some)
}

/// Decodes the value stored at `id` in [`RECORDS`]. A value that decodes to a record of
/// another id (bytes copied from one key to another by something with write access to the
/// file) is refused as corrupt, never returned: the layer would otherwise replay one
/// scope's response under another's key.
///
/// # Errors
/// [`StoreError::Corrupt`] when the bytes do not decode or name another record.
fn decode_record(id: RecordId, bytes: &[u8]) -> Result<Record, StoreError> {
    let record = codec::decode(bytes).map_err(|source| StoreError::Corrupt { id: Some(id), source })?;
    if record.id != id {
        return Err(StoreError::Corrupt {
            id: Some(id),
            source: codec::CodecError::BadField { field: "id", reason: "the record names another id".into() },
        });
    }
    Ok(record)
}

fn read_journal(
    journal: &impl ReadableTable<(&'static [u8; 32], &'static str), &'static [u8]>,
    id: RecordId,
    name: &str,
) -> Result<Option<Vec<u8>>, StoreError> {
    Ok(journal.get((id.as_bytes(), name)).map_err(Error::from)?.map(|v| v.value().to_vec()))
}

/// A write failed after redb may have changed part of a B-tree: the transaction must not
/// commit.
fn broken(poisoned: &mut bool, e: StorageError) -> StoreError {
    *poisoned = true;
    Error::Storage(e).into()
}

/// The first write of an operation failed. redb checks a value's size before it touches
/// the tree, so a value over its limit leaves the transaction usable and fails only its
/// own caller; any other failure is [`broken`].
fn refused(poisoned: &mut bool, e: StorageError) -> StoreError {
    if matches!(e, StorageError::ValueTooLarge(_)) { Error::Storage(e).into() } else { broken(poisoned, e) }
}

/// Creates the three tables, so that readers never meet a missing one.
pub(crate) fn create_tables(db: &Database) -> Result<(), Error> {
    let txn = db.begin_write()?;
    drop(RedbTable::open(&txn)?);
    txn.commit()?;
    Ok(())
}

/// The tables, open in one write transaction.
pub(crate) struct RedbTable<'txn> {
    records: redb::Table<'txn, &'static [u8; 32], &'static [u8]>,
    expiry: redb::Table<'txn, (i64, [u8; 32]), ()>,
    journal: redb::Table<'txn, (&'static [u8; 32], &'static str), &'static [u8]>,
    /// A table write failed half-way (anything but a value over redb's size limit).
    poisoned: bool,
}

impl<'txn> RedbTable<'txn> {
    fn open(txn: &'txn WriteTransaction) -> Result<Self, Error> {
        Ok(Self {
            records: txn.open_table(RECORDS).map_err(table_error(RECORDS_NAME))?,
            expiry: txn.open_table(EXPIRY).map_err(table_error(EXPIRY_NAME))?,
            journal: txn.open_table(JOURNAL).map_err(table_error(JOURNAL_NAME))?,
            poisoned: false,
        })
    }
}

impl RecordRead for RedbTable<'_> {
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        read_record(&self.records, id)
    }

    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        read_journal(&self.journal, id, name)
    }
}

impl RecordTable for RedbTable<'_> {
    fn write(&mut self, old: Option<&Record>, new: &Record) -> Result<(), StoreError> {
        let bytes = codec::encode(new);
        self.records.insert(new.id.as_bytes(), bytes.as_slice()).map_err(|e| refused(&mut self.poisoned, e))?;
        if old.map(|o| o.expires_at) != Some(new.expires_at) {
            if let Some(o) = old {
                self.expiry.remove((o.expires_at.0, *o.id.as_bytes())).map_err(|e| broken(&mut self.poisoned, e))?;
            }
            self.expiry
                .insert((new.expires_at.0, *new.id.as_bytes()), ())
                .map_err(|e| broken(&mut self.poisoned, e))?;
        }
        Ok(())
    }

    /// One insert: redb's `insert` hands back what it replaced, so a first claim is one
    /// B-tree descent instead of a read and then a write. When something was stored, its
    /// bytes go back exactly as they were (the index entry was never touched), so the
    /// table is unchanged, and the record is decided on as read.
    fn create(&mut self, new: &Record) -> Result<Option<Record>, StoreError> {
        let bytes = codec::encode(new);
        let displaced = match self.records.insert(new.id.as_bytes(), bytes.as_slice()) {
            Ok(displaced) => displaced.map(|stored| stored.value().to_vec()),
            Err(e) => return Err(refused(&mut self.poisoned, e)),
        };
        let Some(stored) = displaced else {
            self.expiry
                .insert((new.expires_at.0, *new.id.as_bytes()), ())
                .map_err(|e| broken(&mut self.poisoned, e))?;
            return Ok(None);
        };
        self.records.insert(new.id.as_bytes(), stored.as_slice()).map_err(|e| broken(&mut self.poisoned, e))?;
        decode_record(new.id, &stored).map(Some)
    }

    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<Expired>, StoreError> {
        let mut expired = Vec::new();
        for entry in self.expiry.range(..=(now.0, [u8::MAX; 32])).map_err(Error::from)?.take(limit) {
            let (expires_at, id) = entry.map_err(Error::from)?.0.value();
            expired.push(Expired { expires_at: UnixMillis(expires_at), id: RecordId::from_bytes(id) });
        }
        Ok(expired)
    }

    fn remove(&mut self, expired: Expired) -> Result<(), StoreError> {
        let Expired { expires_at, id } = expired;
        self.expiry.remove((expires_at.0, *id.as_bytes())).map_err(|e| broken(&mut self.poisoned, e))?;
        self.records.remove(id.as_bytes()).map_err(|e| broken(&mut self.poisoned, e))?;
        Ok(())
    }

    fn journal_write(&mut self, id: RecordId, name: &str, value: &[u8]) -> Result<(), StoreError> {
        self.journal.insert((id.as_bytes(), name), value).map_err(|e| refused(&mut self.poisoned, e))?;
        Ok(())
    }

    fn journal_clear(&mut self, id: RecordId) -> Result<(), StoreError> {
        // Entries of one record are adjacent: a range scan from (id, "") until the id changes.
        let mut names = Vec::new();
        for entry in self.journal.range((id.as_bytes(), "")..).map_err(Error::from)? {
            let entry = entry.map_err(Error::from)?;
            let (of, name) = entry.0.value();
            if of != id.as_bytes() {
                break;
            }
            names.push(name.to_owned());
        }
        for name in &names {
            self.journal.remove((id.as_bytes(), name.as_str())).map_err(|e| broken(&mut self.poisoned, e))?;
        }
        Ok(())
    }

    fn is_poisoned(&self) -> bool {
        self.poisoned
    }
}

/// Point reads in one read transaction: it sees the last commit and never waits for the
/// writer. Each read opens its table (a few B-tree pages, normally in redb's cache).
pub(crate) struct RedbView(ReadTransaction);

impl RedbView {
    pub(crate) fn begin(db: &Database) -> Result<Self, Error> {
        Ok(Self(db.begin_read()?))
    }
}

impl RecordRead for RedbView {
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        read_record(&self.0.open_table(RECORDS).map_err(table_error(RECORDS_NAME))?, id)
    }

    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        read_journal(&self.0.open_table(JOURNAL).map_err(table_error(JOURNAL_NAME))?, id, name)
    }

    /// A range scan of the records table from the cursor, in key (= record id) order,
    /// decoding each record and stopping one past the limit (that one only says `more`).
    fn list(&self, filter: &ListFilter, now: UnixMillis) -> Result<Listing, StoreError> {
        use std::ops::Bound;
        let records = self.0.open_table(RECORDS).map_err(table_error(RECORDS_NAME))?;
        let start = filter.after.as_ref().map_or(Bound::Unbounded, |id| Bound::Excluded(id.as_bytes()));
        let mut page = Vec::new();
        let mut more = false;
        for entry in records.range::<&[u8; 32]>((start, Bound::Unbounded)).map_err(Error::from)? {
            let (key, value) = entry.map_err(Error::from)?;
            let id = RecordId::from_bytes(*key.value());
            let record = decode_record(id, value.value())?;
            if !filter.matches(&record, now) {
                continue;
            }
            if page.len() == filter.limit {
                more = true;
                break;
            }
            page.push(record);
        }
        Ok(Listing::new(now, page, more))
    }
}

/// The writer's transactions on the database.
pub(crate) struct RedbEngine {
    pub(crate) handle: Arc<Handle>,
}

impl RedbEngine {
    /// Closes `db` when `e` is redb's latched I/O failure, so the next transaction opens
    /// the file again (see [`crate::handle`]).
    fn after(&self, db: &Arc<Database>, e: Error) -> Error {
        let latched = match &e {
            Error::Transaction(redb::TransactionError::Storage(s))
            | Error::Commit(redb::CommitError::Storage(s))
            | Error::Table { source: redb::TableError::Storage(s), .. }
            | Error::Storage(s) => needs_reopen(s),
            _ => false,
        };
        if latched {
            self.handle.close_failed(db);
        }
        e
    }
}

fn failed(stage: Stage) -> impl FnOnce(Error) -> TransactionFailed {
    move |e| TransactionFailed { stage, error: e.into() }
}

impl Engine for RedbEngine {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn transaction(&mut self, apply: &mut dyn FnMut(&mut dyn RecordTable) -> bool) -> Result<(), TransactionFailed> {
        let db = self.handle.get().map_err(failed(Stage::Begin))?;
        let txn = db.begin_write().map_err(|e| self.after(&db, e.into())).map_err(failed(Stage::Begin))?;
        let commit = apply(&mut RedbTable::open(&txn).map_err(|e| self.after(&db, e)).map_err(failed(Stage::Begin))?);
        if !commit {
            // A batch that wrote nothing, or one that failed: nothing of it may reach the
            // file. An abort that fails leaves nothing to undo either (redb latches the
            // storage failure and the next batch reports it at begin).
            let _ = txn.abort();
            return Ok(());
        }
        txn.commit().map_err(|e| self.after(&db, e.into())).map_err(failed(Stage::Commit))
    }
}
