//! Errors of the MySQL/MariaDB backend, and which driver failures are worth a retry.
//!
//! Building a store (connecting, validating the table prefix, checking the pool's isolation
//! level, migrating or checking the migration version) returns [`Error`]. Store operations
//! return [`idem_core::StoreError`]: a driver failure becomes [`StoreError::Unavailable`]
//! with `backend = "mysql"`, this crate's [`Error`] as `source` (whose own `source` is the
//! [`sqlx::Error`]), and `retryable` set by [`Error::is_retryable`].

use idem_core::StoreError;
use sqlx::mysql::MySqlDatabaseError;

/// The backend name carried by [`StoreError::Unavailable`].
pub(crate) const BACKEND: &str = "mysql";

/// Server error numbers this crate looks at (the same on MySQL 8 and MariaDB 10.11).
pub(crate) mod code {
    /// `ER_LOCK_DEADLOCK`: InnoDB chose this transaction as a deadlock victim and rolled
    /// the whole transaction back.
    pub(crate) const DEADLOCK: u16 = 1213;
    /// `ER_LOCK_WAIT_TIMEOUT`: a row lock was not granted within `innodb_lock_wait_timeout`;
    /// only the statement is rolled back (unless `innodb_rollback_on_timeout`).
    pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;
    /// `ER_DUP_ENTRY`: a concurrent claim inserted the same id first.
    pub(crate) const DUPLICATE_KEY: u16 = 1062;
    /// `ER_NO_SUCH_TABLE`: the records table is missing (not migrated).
    pub(crate) const NO_SUCH_TABLE: u16 = 1146;
    /// `ER_UNKNOWN_SYSTEM_VARIABLE`: e.g. `@@transaction_isolation` on MariaDB before 11.1.
    pub(crate) const UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;
}

/// What went wrong talking to MySQL or MariaDB.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The table prefix is not a plain lower-case identifier (see
    /// [`crate::Config::with_table_prefix`]).
    #[error("invalid table prefix {name:?}: {reason}")]
    InvalidPrefix {
        /// The prefix given.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// The connection URL does not parse.
    #[error("invalid MySQL connection URL")]
    InvalidUrl(#[source] sqlx::Error),
    /// No connection could be had from the pool (server down or refusing, pool exhausted
    /// for the whole acquire timeout).
    #[error("could not get a MySQL connection while {operation}")]
    Connection {
        /// What was being done.
        operation: &'static str,
        /// The pool's error.
        #[source]
        source: sqlx::Error,
    },
    /// A statement failed.
    #[error("MySQL statement failed while {operation}")]
    MySql {
        /// What was being done.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The tables were migrated by a newer build of this crate: this build does not know
    /// the table layout and refuses to touch it.
    #[error("tables {prefix:?} are at migration {found}, newer than this build's {known}")]
    SchemaTooNew {
        /// The table prefix.
        prefix: String,
        /// Highest migration recorded.
        found: i32,
        /// Highest migration this build ships.
        known: i32,
    },
    /// The store was built with [`crate::Config::with_auto_migrate`] off and the tables
    /// lack migrations this build needs.
    #[error(
        "tables {prefix:?} are at migration {found}, this build needs {known}: run MySqlStore::migrate(&pool, &config) (a store \
         built with auto-migration on, the default, runs it on start) or apply idem_mysql::MIGRATIONS"
    )]
    NotMigrated {
        /// The table prefix.
        prefix: String,
        /// Highest migration recorded (0: none).
        found: i32,
        /// Highest migration this build ships.
        known: i32,
    },
    /// A transaction kept being rolled back by deadlocks or lock-wait timeouts, or a claim
    /// kept losing the insert race, for every attempt.
    #[error("the record stayed contended for every attempt while {operation}")]
    Contention {
        /// What was being done.
        operation: &'static str,
    },
    /// The pool handed to [`crate::MySqlStore::from_pool`] runs its sessions above READ
    /// COMMITTED. Under REPEATABLE READ a locking read of an absent id takes a gap lock, so
    /// claims of unrelated keys that fall in one gap block each other and deadlock; the
    /// store refuses such a pool rather than run slowly and spuriously contended. Pin the
    /// level in the pool's `after_connect` with `SET SESSION TRANSACTION ISOLATION LEVEL
    /// READ COMMITTED`, or let [`crate::MySqlStore::connect`] build the pool. Not
    /// retryable.
    #[error(
        "the pool's sessions run at {level}, and idem-mysql needs READ COMMITTED: set it in the pool's after_connect with \
         `SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED` (MySqlStore::connect does)"
    )]
    IsolationNotSupported {
        /// The session's isolation level as the server spells it (`REPEATABLE-READ`).
        level: String,
    },
}

impl Error {
    /// Whether the same call may succeed if retried: the server is unreachable or
    /// restarting, the pool timed out, the connection broke, a deadlock or lock-wait
    /// timeout, or contention. Configuration mistakes, SQL errors and tables at the wrong
    /// migration are permanent.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Connection { source, .. } | Error::MySql { source, .. } => is_retryable_sqlx(source),
            Error::Contention { .. } => true,
            Error::InvalidPrefix { .. }
            | Error::InvalidUrl(_)
            | Error::SchemaTooNew { .. }
            | Error::NotMigrated { .. }
            | Error::IsolationNotSupported { .. } => false,
        }
    }

    pub(crate) fn mysql(operation: &'static str) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| Error::MySql { operation, source }
    }

    pub(crate) fn connection(operation: &'static str) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| Error::Connection { operation, source }
    }
}

/// The server's error number, if the server answered with an error.
pub(crate) fn number(e: &sqlx::Error) -> Option<u16> {
    e.as_database_error().and_then(|d| d.try_downcast_ref::<MySqlDatabaseError>()).map(MySqlDatabaseError::number)
}

/// Whether the transaction did not commit and nothing it did is left, so running it again
/// from `BEGIN` is safe: a deadlock (the server rolled the whole transaction back) or a
/// lock-wait timeout (the statement was rolled back, and the store rolls back the rest).
pub(crate) fn is_transient_lock(e: &sqlx::Error) -> bool {
    matches!(number(e), Some(code::DEADLOCK | code::LOCK_WAIT_TIMEOUT))
}

/// Retryable server errors: deadlock (1213), lock-wait timeout (1205), too many
/// connections (1040, 1203), server shutting down (1053), connection killed (1927 on
/// MariaDB), query interrupted (1317) and the statement time limit (3024 on MySQL, 1969 on
/// MariaDB).
fn is_retryable_number(n: u16) -> bool {
    matches!(n, 1213 | 1205 | 1040 | 1203 | 1053 | 1927 | 1317 | 3024 | 1969)
}

/// Whether a sqlx error is transient: a retryable server error, an I/O failure, a pool
/// timeout, or a crashed connection worker.
fn is_retryable_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(_) => number(e).is_some_and(is_retryable_number),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// Whether the error means the session is gone or in an unknown state (broken socket,
/// protocol error, killed connection, server shutdown): such a connection must not go back
/// to the pool.
pub(crate) fn is_session_lost(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(_) => matches!(number(e), Some(1053 | 1927)),
        sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed | sqlx::Error::Protocol(_) => true,
        _ => false,
    }
}

impl From<Error> for StoreError {
    fn from(e: Error) -> Self {
        let retryable = e.is_retryable();
        let message = match &e {
            Error::MySql { operation, source } if number(source) == Some(code::NO_SUCH_TABLE) => {
                format!("{operation}: the records table is missing; run MySqlStore::migrate(&pool, &config) first")
            }
            Error::MySql { operation, .. } => (*operation).to_owned(),
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
    fn store_error_keeps_ours_and_the_driver_error_as_sources() {
        let e = Error::Connection { operation: "claiming a record", source: sqlx::Error::PoolTimedOut };
        let store: StoreError = e.into();
        assert!(store.is_retryable());
        assert!(store.to_string().contains("claiming a record: no connection"), "{store}");
        let ours = std::error::Error::source(&store).expect("source");
        let ours = ours.downcast_ref::<Error>().expect("idem_mysql::Error");
        let driver = std::error::Error::source(ours).expect("driver source");
        assert!(matches!(driver.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::PoolTimedOut)));
        let closed = Error::Connection { operation: "claiming a record", source: sqlx::Error::PoolClosed };
        assert!(!closed.is_retryable(), "a closed pool stays closed");
    }

    #[test]
    fn contention_is_retryable_and_unmigrated_tables_are_not() {
        assert!(StoreError::from(Error::Contention { operation: "completing a record" }).is_retryable());
        let e = Error::NotMigrated { prefix: "idem".into(), found: 0, known: 1 };
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("MySqlStore::migrate("), "{e}");
    }

    #[test]
    fn an_isolation_refusal_is_permanent_and_says_how_to_fix_it() {
        let store = StoreError::from(Error::IsolationNotSupported { level: "REPEATABLE-READ".into() });
        assert!(!store.is_retryable());
        let message = store.to_string();
        assert!(message.contains("READ COMMITTED") && message.contains("after_connect"), "{message}");
    }

    #[test]
    fn numbers() {
        for n in [1213, 1205, 1040, 1053, 1927, 1317, 3024, 1969] {
            assert!(is_retryable_number(n), "{n}");
        }
        for n in [1062, 1146, 1064, 1045, 1049, 1193, 1406] {
            assert!(!is_retryable_number(n), "{n}");
        }
    }

    #[test]
    fn non_database_errors_have_no_number() {
        assert_eq!(number(&sqlx::Error::PoolTimedOut), None);
        assert!(!is_transient_lock(&sqlx::Error::RowNotFound));
        assert!(is_session_lost(&sqlx::Error::WorkerCrashed));
        assert!(!is_session_lost(&sqlx::Error::RowNotFound));
    }
}
