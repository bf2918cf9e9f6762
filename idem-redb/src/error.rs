//! [`Error`]: what redb reported, kept whole as `source`, and how it becomes a
//! [`StoreError::Unavailable`] (with [`Error::is_retryable`] as its flag).

use idem_core::StoreError;

/// The backend name in [`StoreError::Unavailable`].
pub(crate) const BACKEND: &str = "redb";

/// A redb operation failed, or the store's writer thread could not start. Decode failures
/// of stored values are [`StoreError::Corrupt`] instead; a failed batch is the executor's
/// error ([`idem_core::group_commit`]), with this as its source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database file could not be created or opened (already open elsewhere, needs an
    /// upgrade, I/O).
    #[error("could not open the redb database")]
    Open(#[from] redb::DatabaseError),
    /// A read or write transaction could not begin.
    #[error("could not begin a redb transaction")]
    Transaction(#[from] redb::TransactionError),
    /// A table could not be opened (wrong key or value types: another program wrote a table
    /// of the same name).
    #[error("could not open redb table {table}")]
    Table {
        /// The table's name.
        table: &'static str,
        /// redb's error.
        #[source]
        source: redb::TableError,
    },
    /// Reading or writing a table failed.
    #[error("redb storage error")]
    Storage(#[from] redb::StorageError),
    /// The write transaction could not be committed; nothing in it was applied.
    #[error("redb commit failed; nothing in the batch was applied")]
    Commit(#[from] redb::CommitError),
    /// The writer thread could not be started.
    #[error("could not start the redb writer thread")]
    Spawn(#[source] std::io::Error),
    /// The file could not be opened again after redb latched an I/O failure (the disk is
    /// still full, or a reader or the application still holds the old database). Retryable:
    /// the next attempt follows a backoff of at most 1 s.
    #[error("could not reopen the redb database after an I/O failure")]
    Reopen(#[source] redb::DatabaseError),
    /// The file is closed after an I/O failure and the next attempt to open it again waits
    /// for its backoff (at most 1 s). Retryable.
    #[error("the redb database is being reopened after an I/O failure")]
    Reopening,
}

fn storage_is_retryable(e: &redb::StorageError) -> bool {
    // An I/O error may be a blip (EINTR, a full disk being cleaned up). Everything else
    // (corruption, a latched earlier I/O failure that needs a reopen, a closed database,
    // a value over 3 GiB, a poisoned lock) fails the same way on every retry.
    matches!(e, redb::StorageError::Io(_))
}

impl Error {
    /// Whether the same call may succeed if retried.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Open(redb::DatabaseError::Storage(s)) | Error::Storage(s) => storage_is_retryable(s),
            Error::Open(_) => false,
            Error::Transaction(redb::TransactionError::Storage(s)) => storage_is_retryable(s),
            // Another writer held the database for a moment.
            Error::Transaction(redb::TransactionError::WouldBlock) => true,
            Error::Transaction(_) => false,
            Error::Table { source: redb::TableError::Storage(s), .. } => storage_is_retryable(s),
            Error::Table { .. } => false,
            Error::Commit(redb::CommitError::Storage(s)) => storage_is_retryable(s),
            // A poisoned transaction is dropped; the next batch starts a fresh one.
            Error::Commit(_) => true,
            Error::Reopen(_) | Error::Reopening => true,
            Error::Spawn(_) => false,
        }
    }

    fn what(&self) -> &'static str {
        match self {
            Error::Open(_) => "opening the database",
            Error::Transaction(_) => "beginning a transaction",
            Error::Table { .. } => "opening a table",
            Error::Storage(_) => "reading or writing a table",
            Error::Commit(_) => "committing a write transaction",
            Error::Spawn(_) => "starting the writer thread",
            Error::Reopen(_) | Error::Reopening => "reopening the database after an I/O failure",
        }
    }
}

impl From<Error> for StoreError {
    fn from(e: Error) -> Self {
        let retryable = e.is_retryable();
        let message = e.what();
        StoreError::unavailable(BACKEND, message, retryable, e)
    }
}
