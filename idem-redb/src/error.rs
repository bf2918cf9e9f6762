//! Errors of the redb store, and how they become [`StoreError`]s.
//!
//! Every redb error is kept whole as the `source` of a [`RedbStoreError`]; the conversion
//! into [`StoreError::Unavailable`] keeps it as the `source` again and decides the
//! `retryable` flag (see [`RedbStoreError::is_retryable`]). Decode failures of stored
//! values never appear here: they are [`StoreError::Corrupt`].

use std::sync::Arc;

use idem_core::StoreError;

/// The backend name in [`StoreError::Unavailable`].
pub const BACKEND: &str = "redb";

/// A redb operation failed, or the store's writer thread is gone.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedbStoreError {
    /// The database file could not be created or opened (already open elsewhere, needs an
    /// upgrade, I/O).
    #[error("could not open the redb database")]
    Open(#[source] redb::DatabaseError),
    /// A read or write transaction could not begin.
    #[error("could not begin a redb transaction")]
    Transaction(#[source] redb::TransactionError),
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
    Storage(#[source] redb::StorageError),
    /// The write transaction could not be committed; nothing in it was applied.
    #[error("redb commit failed; nothing in the batch was applied")]
    Commit(#[source] redb::CommitError),
    /// The configured durability was refused by redb (e.g. non-durable commits on a
    /// database shared between processes).
    #[error("redb refused the configured durability")]
    Durability(#[source] redb::SetDurabilityError),
    /// The writer thread could not be started.
    #[error("could not start the redb writer thread")]
    Spawn(#[source] std::io::Error),
    /// The writer thread has stopped, or dropped this operation unanswered because applying
    /// its batch panicked (nothing of that batch was applied).
    #[error("the redb writer thread has stopped")]
    WriterStopped,
    /// The blocking task that ran a read was cancelled or panicked.
    #[error("a blocking redb read task failed")]
    Join(#[source] tokio::task::JoinError),
    /// The same failure, reported to every caller whose operation was in the failed batch.
    #[error(transparent)]
    Batch(Arc<RedbStoreError>),
}

fn storage_is_retryable(e: &redb::StorageError) -> bool {
    // An I/O error may be a blip (EINTR, a full disk being cleaned up). Everything else
    // (corruption, a latched earlier I/O failure that needs a reopen, a closed database,
    // a value over 3 GiB, a poisoned lock) fails the same way on every retry.
    matches!(e, redb::StorageError::Io(_))
}

impl RedbStoreError {
    /// Whether the same call may succeed if retried.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            RedbStoreError::Open(redb::DatabaseError::Storage(s)) | RedbStoreError::Storage(s) => {
                storage_is_retryable(s)
            }
            RedbStoreError::Open(_) => false,
            RedbStoreError::Transaction(redb::TransactionError::Storage(s)) => storage_is_retryable(s),
            // Another writer held the database for a moment.
            RedbStoreError::Transaction(redb::TransactionError::WouldBlock) => true,
            RedbStoreError::Transaction(_) => false,
            RedbStoreError::Table { source: redb::TableError::Storage(s), .. } => storage_is_retryable(s),
            RedbStoreError::Table { .. } => false,
            RedbStoreError::Commit(redb::CommitError::Storage(s)) => storage_is_retryable(s),
            // A poisoned transaction is dropped; the next batch starts a fresh one.
            RedbStoreError::Commit(_) => true,
            RedbStoreError::Durability(_)
            | RedbStoreError::Spawn(_)
            | RedbStoreError::WriterStopped
            | RedbStoreError::Join(_) => false,
            RedbStoreError::Batch(inner) => inner.is_retryable(),
        }
    }

    fn what(&self) -> &'static str {
        match self {
            RedbStoreError::Open(_) => "opening the database",
            RedbStoreError::Transaction(_) => "beginning a transaction",
            RedbStoreError::Table { .. } => "opening a table",
            RedbStoreError::Storage(_) => "reading or writing a table",
            RedbStoreError::Commit(_) => "committing a write transaction",
            RedbStoreError::Durability(_) => "setting commit durability",
            RedbStoreError::Spawn(_) => "starting the writer thread",
            RedbStoreError::WriterStopped => "handing an operation to the writer thread",
            RedbStoreError::Join(_) => "running a blocking read",
            RedbStoreError::Batch(inner) => inner.what(),
        }
    }
}

impl From<RedbStoreError> for StoreError {
    fn from(e: RedbStoreError) -> Self {
        let retryable = e.is_retryable();
        let message = e.what();
        StoreError::unavailable(BACKEND, message, retryable, e)
    }
}

impl From<redb::StorageError> for RedbStoreError {
    fn from(e: redb::StorageError) -> Self {
        RedbStoreError::Storage(e)
    }
}

impl From<redb::TransactionError> for RedbStoreError {
    fn from(e: redb::TransactionError) -> Self {
        RedbStoreError::Transaction(e)
    }
}

impl From<redb::CommitError> for RedbStoreError {
    fn from(e: redb::CommitError) -> Self {
        RedbStoreError::Commit(e)
    }
}

impl From<redb::DatabaseError> for RedbStoreError {
    fn from(e: redb::DatabaseError) -> Self {
        RedbStoreError::Open(e)
    }
}

impl From<redb::SetDurabilityError> for RedbStoreError {
    fn from(e: redb::SetDurabilityError) -> Self {
        RedbStoreError::Durability(e)
    }
}
