//! Errors of the Postgres backend, and which driver failures are worth a retry.
//!
//! Building a store (connecting, validating the schema name, migrating or checking the
//! migration version) returns [`Error`]. Store operations return
//! [`idem_core::StoreError`]: a driver failure becomes [`StoreError::Unavailable`] with
//! `backend = "postgres"`, this crate's [`Error`] as `source` (whose own `source` is the
//! [`sqlx::Error`]), and `retryable` set by [`Error::is_retryable`].

use idem_core::StoreError;

/// The backend name carried by [`StoreError::Unavailable`].
pub(crate) const BACKEND: &str = "postgres";

/// What went wrong talking to PostgreSQL.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The schema name is not a plain lower-case identifier (see
    /// [`crate::Config::with_schema`]).
    #[error("invalid schema name {name:?}: {reason}")]
    InvalidSchema {
        /// The name given.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// The connection URL does not parse.
    #[error("invalid PostgreSQL connection URL")]
    InvalidUrl(#[source] sqlx::Error),
    /// No connection could be had from the pool (server down or refusing, pool exhausted
    /// for the whole acquire timeout).
    #[error("could not get a PostgreSQL connection while {operation}")]
    Connection {
        /// What was being done.
        operation: &'static str,
        /// The pool's error.
        #[source]
        source: sqlx::Error,
    },
    /// A statement failed.
    #[error("PostgreSQL statement failed while {operation}")]
    Postgres {
        /// What was being done.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The schema was migrated by a newer build of this crate: this build does not know
    /// the table layout and refuses to touch it.
    #[error("schema {schema:?} is at migration {found}, newer than this build's {known}")]
    SchemaTooNew {
        /// The schema.
        schema: String,
        /// Highest migration recorded in the schema.
        found: i32,
        /// Highest migration this build ships.
        known: i32,
    },
    /// The store was built with [`crate::Config::with_auto_migrate`] off and the schema
    /// lacks migrations this build needs.
    #[error(
        "schema {schema:?} is at migration {found}, this build needs {known}: run PostgresStore::migrate(&pool, &config) (a store \
         built with auto-migration on, the default, runs it on start) or apply idem_postgres::MIGRATIONS"
    )]
    NotMigrated {
        /// The schema.
        schema: String,
        /// Highest migration recorded in the schema (0: none).
        found: i32,
        /// Highest migration this build ships.
        known: i32,
    },
    /// A compare-and-set kept losing to claims its statement snapshot could not see.
    #[error("the record changed under every compare-and-set attempt while {operation}")]
    Contention {
        /// What was being done.
        operation: &'static str,
    },
    /// [`crate::PostgresStore::complete_in`] was handed a transaction running above READ
    /// COMMITTED. The layer renews the lease with an `UPDATE` of the record while the
    /// handler runs, and a REPEATABLE READ or SERIALIZABLE transaction whose snapshot
    /// predates a renewal cannot update the row (SQLSTATE 40001 whatever the `WHERE`), so
    /// the completion is refused every time, before it touches the row, rather than fail
    /// only when a renewal happened to commit meanwhile. Nothing was written; roll the
    /// transaction back. Not retryable: the same transaction setup fails the same way.
    #[error(
        "complete_in needs a READ COMMITTED transaction, and the handler's transaction runs at {level}: the lease \
         renewal updates the record while the handler runs, and a {level} transaction cannot update a row changed \
         after its snapshot (it would fail with SQLSTATE 40001 whenever a renewal committed meanwhile); begin it with \
         `pool.begin_with(\"BEGIN ISOLATION LEVEL READ COMMITTED\")`"
    )]
    IsolationNotSupported {
        /// The transaction's `transaction_isolation`, as PostgreSQL spells it
        /// (`repeatable read`, `serializable`).
        level: String,
    },
}

impl Error {
    /// Whether the same call may succeed if retried: the server is starting up, shutting
    /// down or unreachable, the pool timed out, the connection broke, a serialization
    /// failure or deadlock, or a compare-and-set lost to concurrent claims. Configuration
    /// mistakes, SQL errors and a schema at the wrong migration are permanent.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Connection { source, .. } | Error::Postgres { source, .. } => is_retryable_sqlx(source),
            Error::Contention { .. } => true,
            Error::InvalidSchema { .. }
            | Error::InvalidUrl(_)
            | Error::SchemaTooNew { .. }
            | Error::NotMigrated { .. }
            | Error::IsolationNotSupported { .. } => false,
        }
    }

    /// The statement's SQLSTATE, if the server answered with an error.
    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        match self {
            Error::Postgres { source, .. } => source.as_database_error().and_then(|d| d.code()),
            _ => None,
        }
    }

    /// Whether the statement was rolled back by a serialization failure or a deadlock
    /// (SQLSTATE 40001, 40P01): running it again, with a fresh snapshot, can succeed.
    pub(crate) fn is_serialization_failure(&self) -> bool {
        matches!(self.code().as_deref(), Some("40001" | "40P01"))
    }

    pub(crate) fn postgres(operation: &'static str) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| Error::Postgres { operation, source }
    }

    pub(crate) fn connection(operation: &'static str) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| Error::Connection { operation, source }
    }
}

/// Retryable SQLSTATEs: serialization failure (40001), deadlock (40P01), admin shutdown
/// (57P01, e.g. `pg_terminate_backend`), crash shutdown (57P02), cannot connect now (57P03,
/// the server is starting), too many connections (53300), lock not available (55P03), query
/// canceled (57014, e.g. `statement_timeout`) and every connection exception (class 08).
fn is_retryable_code(code: &str) -> bool {
    matches!(code, "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "53300" | "55P03" | "57014")
        || code.starts_with("08")
}

/// Whether a sqlx error is transient: a retryable SQLSTATE, an I/O failure, a pool timeout,
/// or a crashed connection worker.
fn is_retryable_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| is_retryable_code(&c)),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// Whether the error means the connection's session is gone (terminated backend, server
/// shutdown, broken socket or protocol): such a connection must not go back to the pool.
pub(crate) fn is_session_lost(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            db.code().is_some_and(|c| matches!(&*c, "57P01" | "57P02" | "57P03") || c.starts_with("08"))
        }
        sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed | sqlx::Error::Protocol(_) => true,
        _ => false,
    }
}

impl From<Error> for StoreError {
    fn from(e: Error) -> Self {
        let retryable = e.is_retryable();
        let message = match &e {
            // Undefined table, invalid schema name: the schema is not there.
            Error::Postgres { operation, .. } if matches!(e.code().as_deref(), Some("42P01" | "3F000")) => {
                format!("{operation}: the records table is missing; run PostgresStore::migrate(&pool, &config) first")
            }
            Error::Postgres { operation, .. } => (*operation).to_owned(),
            Error::Connection { operation, .. } => format!("{operation}: no connection"),
            Error::Contention { operation } => format!("{operation}: contention"),
            other => other.to_string(),
        };
        StoreError::unavailable(BACKEND, message, retryable, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        for code in ["40001", "40P01", "57P01", "57P02", "57P03", "53300", "08006", "08001", "55P03", "57014"] {
            assert!(is_retryable_code(code), "{code}");
        }
        for code in ["42601", "42P01", "23505", "28P01", "3F000", "22003"] {
            assert!(!is_retryable_code(code), "{code}");
        }
    }
}
