//! Errors of the Postgres backend as a store sees them: retryable or not, the message, and
//! this crate's error and the driver's kept as sources. No server needed.

use idem_core::StoreError;
use idem_postgres::{Error, sqlx};

#[test]
fn store_error_keeps_ours_and_the_driver_error_as_sources() {
    let e = Error::Connection { operation: "claiming a record", source: sqlx::Error::PoolTimedOut };
    let store: StoreError = e.into();
    assert!(store.is_retryable());
    assert!(store.to_string().contains("claiming a record: no connection"), "{store}");
    let ours = std::error::Error::source(&store).expect("source");
    let ours = ours.downcast_ref::<Error>().expect("idem_postgres::Error");
    let driver = std::error::Error::source(ours).expect("driver source");
    assert!(matches!(driver.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::PoolTimedOut)));
    let closed = Error::Connection { operation: "claiming a record", source: sqlx::Error::PoolClosed };
    assert!(!closed.is_retryable(), "a closed pool stays closed");
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
