//! Errors of the SQLite backend: every SQLite failure keeps rusqlite's error as its
//! `source`, where [`rusqlite::Error::sqlite_error_code`] gives SQLite's result code.

use std::path::PathBuf;

use idem_core::{RecordId, StoreError};
use rusqlite::ErrorCode;

/// Name used in [`StoreError::Unavailable`].
pub(crate) const BACKEND: &str = "sqlite";

/// A failure of the SQLite store. Only `SQLITE_BUSY` and `SQLITE_LOCKED` are retryable
/// ([`Error::is_retryable`]); a missing file, a schema from a newer build, a full disk or a
/// corrupt row are not.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Opening the database file or configuring the connection (WAL, busy timeout,
    /// `synchronous`) failed.
    #[error("cannot open SQLite database {path}: {step}")]
    Open {
        /// The database file.
        path: PathBuf,
        /// What was being done.
        step: &'static str,
        /// rusqlite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// The file did not switch to write-ahead logging (an in-memory database, or a file
    /// system without shared memory); the store needs WAL so that readers never block the
    /// writer.
    #[error("SQLite database {path} uses journal mode {mode:?}, not WAL")]
    NotWal {
        /// The database file.
        path: PathBuf,
        /// The journal mode SQLite reported.
        mode: String,
    },
    /// A schema migration failed; its transaction was rolled back.
    #[error("SQLite migration {version} ({name}) failed")]
    Migration {
        /// The migration's version (`PRAGMA user_version` after it).
        version: u32,
        /// The migration's file name.
        name: &'static str,
        /// rusqlite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// The file was migrated by a newer build of this crate.
    #[error("SQLite schema version {found} is newer than this build knows ({known})")]
    SchemaTooNew {
        /// `PRAGMA user_version` of the file.
        found: i64,
        /// The newest version this build ships.
        known: u32,
    },
    /// The file's schema is older than this build needs and the store was opened with
    /// [`crate::Config::with_auto_migrate`]`(false)`: run [`crate::SqliteStore::migrate`]
    /// first.
    #[error("SQLite schema version {found} is older than this build needs ({required}); run SqliteStore::migrate")]
    SchemaOutdated {
        /// `PRAGMA user_version` of the file (0 for a new file).
        found: i64,
        /// The version this build needs.
        required: u32,
    },
    /// One statement failed. Inside a group commit, this is the cause every caller of the
    /// failed batch finds under the executor's error (see [`idem_core::group_commit`]).
    #[error("SQLite {operation} failed")]
    Sqlite {
        /// What was being done, e.g. `read record`.
        operation: &'static str,
        /// rusqlite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// A stored row breaks the schema's rules (edited by hand, or written by other code).
    #[error("record {id} has an invalid {column} column: {reason}")]
    InvalidRow {
        /// The record's id, hex.
        id: String,
        /// The column.
        column: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The file holds a claim made at a time further ahead of this process's clock than
    /// [`crate::Config::with_max_clock_skew`] allows: another process sharing the file
    /// runs a clock ahead of this one (or this clock was stepped back), and this process
    /// would see that process's leases as longer than they are, and it would see this
    /// one's as shorter. Fix the clocks (NTP), or raise the limit.
    #[error(
        "this process's clock is {ahead_ms} ms behind the newest claim in the SQLite file (limit {limit_ms} ms); sync the clocks of every process sharing the file"
    )]
    ClockBehind {
        /// How far the newest claim's `started_at` lies ahead of this clock, ms.
        ahead_ms: u64,
        /// The configured limit, ms.
        limit_ms: u64,
    },
    /// The group-commit writer thread could not be started.
    #[error("cannot start the SQLite writer thread")]
    Spawn(#[source] std::io::Error),
}

impl Error {
    /// Whether retrying the same call can help: `SQLITE_BUSY` and `SQLITE_LOCKED` (the
    /// lock was held by another connection for longer than the busy timeout).
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        let code = match self {
            Error::Open { source, .. } | Error::Migration { source, .. } | Error::Sqlite { source, .. } => {
                source.sqlite_error_code()
            }
            _ => None,
        };
        matches!(code, Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked))
    }

    pub(crate) fn sqlite(operation: &'static str) -> impl FnOnce(rusqlite::Error) -> Error {
        move |source| Error::Sqlite { operation, source }
    }

    pub(crate) fn invalid_row(id: &[u8], column: &'static str, reason: impl Into<String>) -> Error {
        let hex = id.iter().map(|b| format!("{b:02x}")).collect();
        Error::InvalidRow { id: hex, column, reason: reason.into() }
    }

    pub(crate) fn invalid_record(id: RecordId, column: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidRow { id: id.to_hex(), column, reason: reason.into() }
    }
}

impl From<Error> for StoreError {
    fn from(err: Error) -> Self {
        // A row that breaks the schema's rules is a record that does not decode, the same
        // kind on every backend, never "unavailable": a front end must not run the handler
        // of a possibly completed operation again because its row is damaged.
        if let Error::InvalidRow { id, column, reason } = err {
            let source = idem_core::codec::CodecError::BadField { field: column, reason };
            return StoreError::Corrupt { id: RecordId::from_hex(&id), source };
        }
        let retryable = err.is_retryable();
        let message = err.to_string();
        StoreError::unavailable(BACKEND, message, retryable, err)
    }
}
