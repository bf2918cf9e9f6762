//! The schema: versioned migrations and the schema-version check.
//!
//! The migrations are the SQL files in `idem-sqlite/migrations/`, compiled in with
//! `include_str!` and applied in order inside one `BEGIN IMMEDIATE` transaction. The
//! version reached is kept in `PRAGMA user_version` (a field of the database header,
//! written by the same transaction), so two processes migrating a fresh file at once apply
//! each migration exactly once: the second waits for the write lock, then sees the new
//! version.

use rusqlite::{Connection, TransactionBehavior};

use crate::error::Error;

/// One schema migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    /// `PRAGMA user_version` once this migration is applied (1, 2, ...).
    pub version: u32,
    /// The file name, e.g. `0001_records.sql`.
    pub name: &'static str,
    /// The SQL it runs.
    pub sql: &'static str,
}

/// Every migration, oldest first. [`crate::SqliteStore::migrate`] applies the ones newer
/// than the file's `user_version`; operators who manage schemas by hand can apply the same
/// SQL and set `user_version` to the migration's version.
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "0001_records.sql", sql: include_str!("../migrations/0001_records.sql") },
    Migration { version: 2, name: "0002_journal.sql", sql: include_str!("../migrations/0002_journal.sql") },
];

/// The schema version this build reads and writes.
pub const SCHEMA_VERSION: u32 = 2;

fn version(conn: &Connection) -> Result<i64, Error> {
    let found: i64 =
        conn.pragma_query_value(None, "user_version", |row| row.get(0)).map_err(Error::sqlite("read user_version"))?;
    if found > i64::from(SCHEMA_VERSION) {
        return Err(Error::SchemaTooNew { found, known: SCHEMA_VERSION });
    }
    Ok(found)
}

/// Brings `conn`'s file to [`SCHEMA_VERSION`]; returns how many migrations it applied.
pub(crate) fn migrate(conn: &mut Connection) -> Result<usize, Error> {
    let tx =
        conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(Error::sqlite("begin migration"))?;
    let found = version(&tx)?;
    let mut applied = 0;
    for m in MIGRATIONS.iter().filter(|m| i64::from(m.version) > found) {
        let failed = |source| Error::Migration { version: m.version, name: m.name, source };
        tx.execute_batch(m.sql).map_err(failed)?;
        tx.pragma_update(None, "user_version", m.version).map_err(failed)?;
        tracing::info!(version = m.version, name = m.name, "applied idem-sqlite migration");
        applied += 1;
    }
    tx.commit().map_err(Error::sqlite("commit migration"))?;
    Ok(applied)
}

/// Checks that `conn`'s file is at [`SCHEMA_VERSION`] without changing it.
pub(crate) fn check(conn: &Connection) -> Result<(), Error> {
    let found = version(conn)?;
    if found < i64::from(SCHEMA_VERSION) {
        return Err(Error::SchemaOutdated { found, required: SCHEMA_VERSION });
    }
    Ok(())
}
