//! The idem conformance suite against SQLite with deferred claims
//! (`with_durable_claims(false)`): a fresh database file per scenario; the two-instance
//! scenarios share the one store the file then allows.

mod backend;

idem_conformance::store_tests!(backend::Sqlite::new(false));
