//! The idem conformance suite against SQLite with deferred claims (the default): a fresh
//! database file per scenario; the two-instance scenarios share the one store the file
//! allows.

mod backend;

idem_conformance::store_tests!(backend::Sqlite::new(false));
