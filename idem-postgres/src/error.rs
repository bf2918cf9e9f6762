//! Errors of the Postgres backend, and which driver failures are worth a retry.
//!
//! Building a store (connecting, validating the schema name, migrating or checking the
//! migration version) returns [`Error`]. Store operations return
//! [`idem_core::StoreError`]: a driver failure becomes [`StoreError::Unavailable`] with
//! `backend = "postgres"`, this crate's [`Error`] as `source` (whose own `source` is the
//! driver's [`tokio_postgres::Error`] or [`deadpool_postgres::PoolError`]), and
//! `retryable` set by [`Error::is_retryable`].

use std::error::Error as _;

use deadpool_postgres::PoolError;
use idem_core::StoreError;
use tokio_postgres::error::SqlState;

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
    /// The connection URL (or key=value string) does not parse.
    #[error("invalid PostgreSQL connection string")]
    InvalidUrl(#[source] tokio_postgres::Error),
    /// The connection pool could not be built.
    #[error("could not build the PostgreSQL connection pool")]
    Pool(#[source] deadpool_postgres::BuildError),
    /// No connection could be taken from the pool (server down, pool exhausted).
    #[error("could not get a PostgreSQL connection while {operation}")]
    Connection {
        /// What was being done.
        operation: &'static str,
        /// The pool's error.
        #[source]
        source: PoolError,
    },
    /// A statement failed.
    #[error("PostgreSQL statement failed while {operation}")]
    Postgres {
        /// What was being done.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
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
    /// A statement failed on the `sqlx::PgPool` the store was built on (feature `sqlx`).
    #[cfg(feature = "sqlx")]
    #[error("PostgreSQL statement failed (sqlx) while {operation}")]
    Sqlx {
        /// What was being done.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The connection was closed after its session was lost, and the call went on with it.
    #[error("the PostgreSQL connection was closed while {operation}")]
    Detached {
        /// What was being done.
        operation: &'static str,
    },
    /// A compare-and-set kept losing to claims its statement snapshot could not see.
    #[error("the record changed under every compare-and-set attempt while {operation}")]
    Contention {
        /// What was being done.
        operation: &'static str,
    },
    /// [`crate::PostgresStore::complete_in`] was handed a transaction running above READ
    /// COMMITTED. The layer renews the lease with an `UPDATE` of the record while the
    /// handler runs; a REPEATABLE READ or SERIALIZABLE transaction whose snapshot predates
    /// such a renewal cannot update the row at all (SQLSTATE 40001 whatever the
    /// statement's `WHERE`), so the completion is refused before it touches the row, every
    /// time, rather than fail only when a renewal happened to commit meanwhile. Nothing was
    /// written by the store; roll the transaction back. Not retryable: the same
    /// transaction setup fails the same way.
    #[error(
        "complete_in needs a READ COMMITTED transaction, and the handler's transaction runs at {level}: the lease \
         renewal updates the record while the handler runs, and a {level} transaction cannot update a row changed \
         after its snapshot (it would fail with SQLSTATE 40001 whenever a renewal committed meanwhile); begin it with \
         `BEGIN ISOLATION LEVEL READ COMMITTED` (sqlx: `pool.begin_with(..)`; tokio-postgres: \
         `build_transaction().isolation_level(IsolationLevel::ReadCommitted)`)"
    )]
    IsolationNotSupported {
        /// The transaction's `transaction_isolation`, as PostgreSQL spells it
        /// (`repeatable read`, `serializable`).
        level: String,
    },
}

impl Error {
    /// Whether the same call may succeed if retried: the server is starting up, shutting
    /// down, unreachable, the pool timed out, or a compare-and-set lost to concurrent
    /// claims. Configuration mistakes and a schema at the wrong migration are permanent.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Connection { source, .. } => is_retryable_pool(source),
            Error::Postgres { source, .. } => is_retryable_pg(source),
            #[cfg(feature = "sqlx")]
            Error::Sqlx { source, .. } => is_retryable_sqlx(source),
            Error::Contention { .. } | Error::Detached { .. } => true,
            Error::InvalidSchema { .. }
            | Error::InvalidUrl(_)
            | Error::Pool(_)
            | Error::SchemaTooNew { .. }
            | Error::NotMigrated { .. }
            | Error::IsolationNotSupported { .. } => false,
        }
    }

    /// Whether the statement was rolled back by a serialization failure or a deadlock
    /// (SQLSTATE 40001, 40P01): running it again, with a fresh snapshot, can succeed.
    #[must_use]
    pub fn is_serialization_failure(&self) -> bool {
        let code = match self {
            Error::Postgres { source, .. } => source.code().map(|c| c.code().to_owned()),
            #[cfg(feature = "sqlx")]
            Error::Sqlx { source, .. } => source.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned()),
            _ => None,
        };
        matches!(code.as_deref(), Some("40001" | "40P01"))
    }

    #[cfg(feature = "sqlx")]
    pub(crate) fn sqlx(operation: &'static str) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| Error::Sqlx { operation, source }
    }

    pub(crate) fn postgres(operation: &'static str) -> impl FnOnce(tokio_postgres::Error) -> Self {
        move |source| Error::Postgres { operation, source }
    }

    pub(crate) fn connection(operation: &'static str) -> impl FnOnce(PoolError) -> Self {
        move |source| Error::Connection { operation, source }
    }
}

/// Whether a driver error is transient.
///
/// Retryable: serialization failure (SQLSTATE 40001), deadlock (40P01), admin shutdown
/// (57P01, e.g. `pg_terminate_backend`), crash shutdown (57P02), cannot connect now
/// (57P03, the server is starting), too many connections (53300), lock not available
/// (55P03), query canceled (57014, e.g. `statement_timeout`), every connection exception
/// (class 08), a closed connection, and any I/O failure. Everything else (syntax, missing
/// table, constraint violation, authentication) is permanent: retrying cannot help.
#[must_use]
pub fn is_retryable_pg(e: &tokio_postgres::Error) -> bool {
    if let Some(code) = e.code() {
        return is_retryable_code(code);
    }
    if e.is_closed() {
        return true;
    }
    // Connection refused/reset, timeouts: the driver keeps the io::Error as its cause.
    let mut cause = e.source();
    while let Some(c) = cause {
        if c.is::<std::io::Error>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Whether the error means the connection's session is gone (terminated backend, server
/// shutdown, closed socket, broken I/O): such a connection must not go back to the pool.
pub(crate) fn is_session_lost(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        Some(code) => {
            code == &SqlState::ADMIN_SHUTDOWN
                || code == &SqlState::CRASH_SHUTDOWN
                || code == &SqlState::CANNOT_CONNECT_NOW
                || code.code().starts_with("08")
        }
        None => e.is_closed() || is_retryable_pg(e),
    }
}

/// Whether a sqlx error is transient: a retryable SQLSTATE (as for [`is_retryable_pg`]),
/// an I/O failure, a pool timeout, or a crashed connection worker.
#[cfg(feature = "sqlx")]
#[must_use]
pub fn is_retryable_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| is_retryable_code(&SqlState::from_code(&c))),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// Whether a sqlx error means the connection's session is gone.
#[cfg(feature = "sqlx")]
pub(crate) fn is_session_lost_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            let c = SqlState::from_code(&c);
            c == SqlState::ADMIN_SHUTDOWN
                || c == SqlState::CRASH_SHUTDOWN
                || c == SqlState::CANNOT_CONNECT_NOW
                || c.code().starts_with("08")
        }),
        sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed | sqlx::Error::Protocol(_) => true,
        _ => false,
    }
}

fn is_retryable_code(code: &SqlState) -> bool {
    code == &SqlState::T_R_SERIALIZATION_FAILURE
        || code == &SqlState::T_R_DEADLOCK_DETECTED
        || code == &SqlState::ADMIN_SHUTDOWN
        || code == &SqlState::CRASH_SHUTDOWN
        || code == &SqlState::CANNOT_CONNECT_NOW
        || code == &SqlState::TOO_MANY_CONNECTIONS
        || code == &SqlState::LOCK_NOT_AVAILABLE
        || code == &SqlState::QUERY_CANCELED
        || code.code().starts_with("08")
}

/// Whether a pool error is transient: a wait/create/recycle timeout, or a retryable driver
/// error while opening a connection. A closed pool or a failing hook is permanent.
#[must_use]
pub fn is_retryable_pool(e: &PoolError) -> bool {
    match e {
        PoolError::Timeout(_) => true,
        PoolError::Backend(e) => is_retryable_pg(e),
        PoolError::Closed | PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_) => false,
    }
}

impl From<Error> for StoreError {
    fn from(e: Error) -> Self {
        let retryable = e.is_retryable();
        let message = match &e {
            Error::Postgres { operation, source }
                if source.code() == Some(&SqlState::UNDEFINED_TABLE)
                    || source.code() == Some(&SqlState::INVALID_SCHEMA_NAME) =>
            {
                format!("{operation}: the records table is missing; run PostgresStore::migrate(&pool, &config) first")
            }
            Error::Postgres { operation, .. } => (*operation).to_owned(),
            Error::Connection { operation, .. } => format!("{operation}: no connection"),
            Error::Contention { operation } => format!("{operation}: contention"),
            #[cfg(feature = "sqlx")]
            Error::Sqlx { operation, .. } => (*operation).to_owned(),
            other => other.to_string(),
        };
        StoreError::unavailable(BACKEND, message, retryable, e)
    }
}

#[cfg(test)]
mod tests {
    use deadpool_postgres::TimeoutType;

    use super::*;

    #[test]
    fn pool_errors() {
        assert!(is_retryable_pool(&PoolError::Timeout(TimeoutType::Wait)));
        assert!(is_retryable_pool(&PoolError::Timeout(TimeoutType::Create)));
        assert!(!is_retryable_pool(&PoolError::Closed));
        assert!(!is_retryable_pool(&PoolError::NoRuntimeSpecified));
    }

    #[test]
    fn store_error_keeps_ours_and_the_driver_error_as_sources() {
        let e = Error::Connection { operation: "claiming a record", source: PoolError::Timeout(TimeoutType::Wait) };
        let store: StoreError = e.into();
        assert!(store.is_retryable());
        assert!(store.to_string().contains("claiming a record: no connection"), "{store}");
        let ours = std::error::Error::source(&store).expect("source");
        let ours = ours.downcast_ref::<Error>().expect("idem_postgres::Error");
        let driver = std::error::Error::source(ours).expect("driver source");
        assert!(driver.downcast_ref::<PoolError>().is_some());
    }

    #[test]
    fn contention_is_retryable_and_an_unmigrated_schema_is_not() {
        assert!(StoreError::from(Error::Contention { operation: "completing a record" }).is_retryable());
        let e = Error::NotMigrated { schema: "idem".into(), found: 0, known: 2 };
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("PostgresStore::migrate("), "{e}");
    }

    #[test]
    fn an_isolation_refusal_is_permanent_and_says_why() {
        let store = StoreError::from(Error::IsolationNotSupported { level: "repeatable read".into() });
        assert!(!store.is_retryable());
        let message = store.to_string();
        assert!(message.contains("READ COMMITTED") && message.contains("renewal"), "{message}");
        let ours = std::error::Error::source(&store).and_then(|s| s.downcast_ref::<Error>());
        assert!(matches!(ours, Some(Error::IsolationNotSupported { level }) if level == "repeatable read"));
    }

    #[test]
    fn codes() {
        for code in ["40001", "40P01", "57P01", "57P02", "57P03", "53300", "08006", "08001", "55P03", "57014"] {
            assert!(is_retryable_code(&SqlState::from_code(code)), "{code}");
        }
        for code in ["42601", "42P01", "23505", "28P01", "3F000", "22003"] {
            assert!(!is_retryable_code(&SqlState::from_code(code)), "{code}");
        }
    }
}
