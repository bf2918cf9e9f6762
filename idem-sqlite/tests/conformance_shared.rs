//! The idem conformance suite against SQLite with durable claims (the default), the
//! configuration for stores sharing a file: the two-instance scenarios run on a second `SqliteStore` on the
//! same file and race through SQLite's file locks for real.

mod backend;

idem_conformance::store_tests!(backend::Sqlite::new(true));
