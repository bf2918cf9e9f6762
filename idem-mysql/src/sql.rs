//! The SQL of the store: the table prefix, the shipped migrations and how they run, the
//! text of every statement, and how a returned row becomes a record.
//!
//! Migrations are SQL files in `migrations/`, compiled in with `include_str!`, naming the
//! table prefix as `{prefix}`. Applied versions are recorded in
//! `<prefix>_schema_migrations`; [`migrate`] applies only what is missing, under a named
//! lock (`GET_LOCK`). DDL commits implicitly on MySQL and MariaDB, so a migration is not
//! transactional: each is written to be run again after a crash part-way.

use idem_core::codec::{CodecError, decode_response};
use idem_core::{
    Endpoint, FencingToken, Fingerprint, IdempotencyKey, Principal, Record, RecordId, RecordState, Scope, StoreError,
    UnixMillis,
};
use sqlx::mysql::MySqlRow;
use sqlx::{MySql, MySqlConnection, MySqlPool, Row as _};

use crate::error::{Error, code, number};

/// One versioned migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

impl Migration {
    /// Version, starting at 1, strictly increasing.
    #[must_use]
    pub const fn version(&self) -> i32 {
        self.version
    }

    /// Short name (the file name without the number).
    #[must_use]
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The SQL for `prefix` (a prefix [`validate_prefix`] accepts), one statement. A team
    /// running its own migration tool applies it, then records `(version, name)` in
    /// `<prefix>_schema_migrations` (created by [`crate::MySqlStore::migrate`], or by hand:
    /// `version INT PRIMARY KEY, name VARCHAR(64) NOT NULL, applied_at TIMESTAMP(3) NOT
    /// NULL DEFAULT CURRENT_TIMESTAMP(3)`), so that stores built without auto-migration find
    /// it.
    #[must_use]
    pub fn sql_for(&self, prefix: &str) -> String {
        self.sql.replace("{prefix}", prefix)
    }
}

/// Every migration this build ships, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "records", sql: include_str!("../migrations/0001_records.sql") },
    Migration { version: 2, name: "journal", sql: include_str!("../migrations/0002_journal.sql") },
    Migration { version: 3, name: "key_length", sql: include_str!("../migrations/0003_key_length.sql") },
];

/// The version this build's statements need: the last of [`MIGRATIONS`].
pub(crate) const KNOWN_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The table prefix used when none is configured.
pub const DEFAULT_PREFIX: &str = "idem";

/// Longest prefix: MySQL names are at most 64 bytes, and the longest name built from the
/// prefix is the constraint `<prefix>_records_token_positive` (23 bytes more).
const MAX_PREFIX_LEN: usize = 40;

/// Checks a table prefix: 1 to 40 bytes, a lower-case ASCII letter or `_` first, then
/// lower-case ASCII letters, digits or `_`. Lower case only, because whether MySQL table
/// names are case-sensitive depends on the server's `lower_case_table_names` and file
/// system: a lower-case name means the same table everywhere. The name is still always
/// quoted in SQL.
///
/// # Errors
/// [`Error::InvalidPrefix`] naming the broken rule.
pub fn validate_prefix(name: &str) -> Result<(), Error> {
    let bad = |reason| Err(Error::InvalidPrefix { name: name.to_owned(), reason });
    let bytes = name.as_bytes();
    let Some(&first) = bytes.first() else {
        return bad("it is empty");
    };
    if bytes.len() > MAX_PREFIX_LEN {
        return bad("it is longer than 40 bytes");
    }
    if !(first.is_ascii_lowercase() || first == b'_') {
        return bad("it must start with a lower-case ASCII letter or '_'");
    }
    if !bytes.iter().all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return bad("only lower-case ASCII letters, digits and '_' are allowed");
    }
    Ok(())
}

/// The name of the bookkeeping table.
fn migrations_table(prefix: &str) -> String {
    format!("`{prefix}_schema_migrations`")
}

/// The highest migration recorded for `prefix` (0 when there is none, or no bookkeeping
/// table), read without changing anything; refuses tables migrated by a newer build.
async fn applied_version(conn: &mut MySqlConnection, prefix: &str) -> Result<i32, Error> {
    const OP: &str = "reading the tables' migration version";
    let sql = format!("SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM {}", migrations_table(prefix));
    let found: i64 = match sqlx::query_scalar(&sql).fetch_one(&mut *conn).await {
        Ok(v) => v,
        Err(e) if number(&e) == Some(code::NO_SUCH_TABLE) => return Ok(0),
        Err(e) => return Err(Error::mysql(OP)(e)),
    };
    let found = i32::try_from(found).unwrap_or(i32::MAX);
    if found > KNOWN_VERSION {
        return Err(Error::SchemaTooNew { prefix: prefix.to_owned(), found, known: KNOWN_VERSION });
    }
    Ok(found)
}

/// Checks, without changing anything, that the tables are at exactly this build's
/// migration: the start-up check of a store built without auto-migration.
pub(crate) async fn check_migrated(pool: &MySqlPool, prefix: &str) -> Result<(), Error> {
    let mut conn = pool.acquire().await.map_err(Error::connection("reading the tables' migration version"))?;
    match applied_version(&mut conn, prefix).await? {
        KNOWN_VERSION => Ok(()),
        found => Err(Error::NotMigrated { prefix: prefix.to_owned(), found, known: KNOWN_VERSION }),
    }
}

/// How long a migration waits for another process's migration of the same prefix.
const MIGRATION_LOCK_WAIT_S: i64 = 60;

/// Applies the missing migrations for `prefix`; returns how many ran. Tables already at
/// this build's migration are left alone after one read, so starting a store on them needs
/// no privilege beyond using the tables.
pub(crate) async fn migrate(pool: &MySqlPool, prefix: &str) -> Result<usize, Error> {
    let mut conn = pool.acquire().await.map_err(Error::connection("migrating"))?;
    if applied_version(&mut conn, prefix).await? == KNOWN_VERSION {
        return Ok(0);
    }
    // A named lock serialises replicas starting together (both servers have GET_LOCK; DDL
    // cannot run inside a transaction, so no row lock would do). It belongs to the
    // session: released below, and the connection is closed if that fails.
    let lock = format!("idem-mysql migrate {prefix}");
    let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
        .bind(&lock)
        .bind(MIGRATION_LOCK_WAIT_S)
        .fetch_one(&mut *conn)
        .await
        .map_err(Error::mysql("taking the migration lock"))?;
    if got != Some(1) {
        return Err(Error::Contention { operation: "taking the migration lock" });
    }
    let applied = apply(&mut conn, prefix).await;
    let released = sqlx::query("SELECT RELEASE_LOCK(?)").bind(&lock).execute(&mut *conn).await;
    if released.is_err() {
        conn.close_on_drop();
    }
    applied
}

async fn apply(conn: &mut MySqlConnection, prefix: &str) -> Result<usize, Error> {
    let bookkeeping = format!(
        "CREATE TABLE IF NOT EXISTS {} (
             version    INT          NOT NULL PRIMARY KEY,
             name       VARCHAR(64)  NOT NULL,
             applied_at TIMESTAMP(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3)
         ) ENGINE = InnoDB",
        migrations_table(prefix)
    );
    sqlx::query(&bookkeeping).execute(&mut *conn).await.map_err(Error::mysql("creating the bookkeeping table"))?;
    // Read again under the lock: another process may have migrated meanwhile.
    let found = applied_version(conn, prefix).await?;
    let record = format!("INSERT INTO {} (version, name) VALUES (?, ?)", migrations_table(prefix));
    let mut applied = 0;
    for m in MIGRATIONS.iter().filter(|m| m.version > found) {
        tracing::debug!(
            backend = "mysql",
            prefix,
            version = m.version,
            name = m.name,
            "idem-mysql: applying migration"
        );
        // Unprepared (text protocol): MySQL cannot prepare every DDL statement.
        sqlx::Executor::execute(&mut *conn, sqlx::raw_sql(&m.sql_for(prefix)))
            .await
            .map_err(Error::mysql("applying a migration"))?;
        sqlx::query(&record)
            .bind(m.version)
            .bind(m.name)
            .execute(&mut *conn)
            .await
            .map_err(Error::mysql("recording a migration"))?;
        applied += 1;
    }
    Ok(applied)
}

/// The server's clock in whole milliseconds since the epoch (UTC). `UTC_TIMESTAMP` and
/// plain arithmetic, not `UNIX_TIMESTAMP(NOW(3))`: the latter converts through the
/// session's time zone, which is ambiguous for an hour at each daylight-saving change.
/// The same text on MySQL 8 and MariaDB.
pub(crate) const SERVER_NOW_MS: &str =
    "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)";

/// The record columns, in the order [`record_at`] reads them.
pub(crate) const COLUMNS: [&str; 12] = [
    "id",
    "principal",
    "endpoint",
    "idem_key",
    "fingerprint",
    "state",
    "token",
    "response",
    "created_at",
    "started_at",
    "lease_expires_at",
    "expires_at",
];

/// The text of every statement for one table prefix. Each operation is a short
/// transaction of these (see `src/store.rs` for the order and why it is atomic).
#[derive(Clone, Debug)]
pub(crate) struct Statements {
    /// `?` id. The record columns, locking the row (exclusive) until the transaction ends.
    pub(crate) lock: String,
    /// `?` id. The record columns, unlocked (a consistent read of the last commit).
    pub(crate) read: String,
    /// The record columns as `?` in [`COLUMNS`] order: a new row.
    pub(crate) insert: String,
    /// Every column but the id as `?` in [`COLUMNS`] order, then `?` id: the whole row.
    pub(crate) update: String,
    /// The record columns of every row; `list` appends its `WHERE`, order and limit.
    pub(crate) scan: String,
    /// `?` id: deletes every journal entry of the record (a claim replacing a generation).
    pub(crate) journal_clear: String,
    /// `?` id, `?` name: the entry's value (the caller holds the record's lock).
    pub(crate) journal_read: String,
    /// `?` id, `?` name, `?` value, `?` value again: writes the entry, over an old one.
    pub(crate) journal_write: String,
    /// `?` id, `?` name, `?` now: the entry's value if its record is live.
    pub(crate) journal_get: String,
    /// `?` now, `?` limit: the ids of expired records, oldest expiry first, locked.
    pub(crate) sweep: String,
    /// Followed by `(?, ...)`: deletes the journal entries of these records.
    pub(crate) journal_of: String,
    /// Followed by `(?, ...)`: deletes these records.
    pub(crate) records_of: String,
    /// `?` now: whether any expired record is left.
    pub(crate) expired_left: String,
}

impl Statements {
    pub(crate) fn for_prefix(prefix: &str) -> Self {
        let table = format!("`{prefix}_records`");
        let journal = format!("`{prefix}_journal`");
        let cols = COLUMNS.join(", ");
        let marks = vec!["?"; COLUMNS.len()].join(", ");
        let sets = COLUMNS[1..].iter().map(|c| format!("{c} = ?")).collect::<Vec<_>>().join(", ");
        Self {
            lock: format!("SELECT {cols} FROM {table} WHERE id = ? FOR UPDATE"),
            read: format!("SELECT {cols} FROM {table} WHERE id = ?"),
            scan: format!("SELECT {cols} FROM {table}"),
            insert: format!("INSERT INTO {table} ({cols}) VALUES ({marks})"),
            update: format!("UPDATE {table} SET {sets} WHERE id = ?"),
            journal_clear: format!("DELETE FROM {journal} WHERE id = ?"),
            journal_read: format!("SELECT value FROM {journal} WHERE id = ? AND name = ?"),
            // `= ?` rather than `VALUES(value)`, deprecated in MySQL 8.0.20.
            journal_write: format!(
                "INSERT INTO {journal} (id, name, value) VALUES (?, ?, ?) ON DUPLICATE KEY UPDATE value = ?"
            ),
            // One consistent read: the entry and its record's liveness in one snapshot.
            journal_get: format!(
                "SELECT j.value FROM {table} AS r JOIN {journal} AS j ON j.id = r.id
                 WHERE r.id = ? AND j.name = ? AND r.expires_at > ?"
            ),
            // Single-table DELETE with ORDER BY and LIMIT: the same on both servers.
            sweep: format!("SELECT id FROM {table} WHERE expires_at <= ? ORDER BY expires_at LIMIT ? FOR UPDATE"),
            journal_of: format!("DELETE FROM {journal} WHERE id IN "),
            records_of: format!("DELETE FROM {table} WHERE id IN "),
            expired_left: format!("SELECT EXISTS (SELECT 1 FROM {table} WHERE expires_at <= ?)"),
        }
    }
}

/// A token as the BIGINT column holds it. Tokens above `i64::MAX` cannot exist in the
/// table, so they map to -1, which matches no row.
pub(crate) fn token_param(t: FencingToken) -> i64 {
    i64::try_from(t.0).unwrap_or(-1)
}

/// A value the table's constraints should have excluded: the one "does not decode" kind
/// every backend reports ([`CodecError::BadField`]).
pub(crate) fn corrupt(id: Option<RecordId>, column: &'static str, reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt { id, source: CodecError::BadField { field: column, reason: reason.into() } }
}

/// A column of `row` as `T`; a value of another type (or `NULL` where none may be) is
/// [`StoreError::Corrupt`].
fn get<'r, T: sqlx::Decode<'r, MySql> + sqlx::Type<MySql>>(
    row: &'r MySqlRow,
    idx: usize,
    id: Option<RecordId>,
    column: &'static str,
) -> Result<T, StoreError> {
    row.try_get(idx).map_err(|e| corrupt(id, column, e.to_string()))
}

/// Reads the record whose columns are the row's, in [`COLUMNS`] order.
pub(crate) fn record_at(row: &MySqlRow) -> Result<Record, StoreError> {
    let raw_id: Vec<u8> = get(row, 0, None, "id")?;
    let id = RecordId::from_bytes(raw_id.as_slice().try_into().map_err(|_| corrupt(None, "id", "not 32 bytes"))?);
    let bad = |column, why: &str| corrupt(Some(id), column, why);
    let text = |idx, column| {
        String::from_utf8(get::<Vec<u8>>(row, idx, Some(id), column)?).map_err(|_| bad(column, "not UTF-8"))
    };
    let principal = Principal::new(text(1, "principal")?).map_err(|_| bad("principal", "blank"))?;
    let endpoint = Endpoint::from(text(2, "endpoint")?);
    let key = IdempotencyKey::from_stored(&text(3, "key")?).ok_or_else(|| bad("key", "not a valid key"))?;
    let fingerprint: Vec<u8> = get(row, 4, Some(id), "fingerprint")?;
    let fingerprint =
        Fingerprint::from_bytes(fingerprint.as_slice().try_into().map_err(|_| bad("fingerprint", "not 32 bytes"))?);
    let state: String = get(row, 5, Some(id), "state")?;
    let state = RecordState::from_name(&state).ok_or_else(|| bad("state", "unknown state"))?;
    let token = u64::try_from(get::<i64>(row, 6, Some(id), "token")?).map_err(|_| bad("token", "negative"))?;
    let response = match get::<Option<Vec<u8>>>(row, 7, Some(id), "response")? {
        Some(b) => Some(decode_response(&b).map_err(|source| StoreError::Corrupt { id: Some(id), source })?),
        None => None,
    };
    if response.is_some() != (state == RecordState::Completed) {
        return Err(bad("response", "a response without the completed state, or none with it"));
    }
    let scope = Scope { principal, endpoint };
    // A row whose scope and key hash to another id (copied between rows by something with
    // write access to the table) would replay one tenant's response under another's key.
    if scope.record_id(&key) != id {
        return Err(bad("id", "the scope and key name another record"));
    }
    let ms = |idx, column| get::<i64>(row, idx, Some(id), column).map(UnixMillis);
    Ok(Record {
        id,
        scope,
        key,
        fingerprint,
        state,
        token: FencingToken(token),
        response,
        created_at: ms(8, "created_at")?,
        started_at: ms(9, "started_at")?,
        lease_expires_at: ms(10, "lease_expires_at")?,
        expires_at: ms(11, "expires_at")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        for ok in ["idem", "_x", "a1_b2", &"a".repeat(40)] {
            assert!(validate_prefix(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Idem", "1a", "a-b", "a b", "a`b", "é", &"a".repeat(41), "a;drop"] {
            assert!(matches!(validate_prefix(bad), Err(Error::InvalidPrefix { .. })), "{bad}");
        }
    }

    #[test]
    fn the_longest_prefix_keeps_every_name_within_64_bytes() {
        let sql = MIGRATIONS[0].sql_for(&"a".repeat(MAX_PREFIX_LEN));
        for name in sql.split('`').skip(1).step_by(2) {
            assert!(name.len() <= 64, "{name}");
        }
    }

    #[test]
    fn statements_name_the_prefixed_table() {
        let s = Statements::for_prefix("idem_x");
        assert!(s.lock.contains("`idem_x_records`") && s.lock.ends_with("FOR UPDATE"));
        assert!(!s.read.contains("FOR UPDATE"));
        assert_eq!(s.insert.matches('?').count(), COLUMNS.len());
        assert_eq!(s.update.matches('?').count(), COLUMNS.len());
        assert!(s.update.starts_with("UPDATE `idem_x_records` SET principal = ?"));
        assert!(s.sweep.contains("ORDER BY expires_at LIMIT ? FOR UPDATE"));
        assert!(s.journal_of.starts_with("DELETE FROM `idem_x_journal`") && s.records_of.contains("`idem_x_records`"));
    }

    #[test]
    fn migrations_are_ordered_and_name_the_prefix() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version(), i32::try_from(i + 1).unwrap());
            assert!(m.sql.contains("{prefix}"));
        }
        assert_eq!(KNOWN_VERSION, 3);
        assert!(MIGRATIONS[1].sql_for("idem").contains("CREATE TABLE IF NOT EXISTS `idem_journal`"));
        assert_eq!(MIGRATIONS[0].name(), "records");
        let sql = MIGRATIONS[0].sql_for("idem");
        assert!(sql.contains("`idem_records`") && sql.contains("KEY `idem_records_expires_at` (expires_at)"));
    }

    #[test]
    fn tokens_beyond_the_column_match_nothing() {
        assert_eq!(token_param(FencingToken(7)), 7);
        assert_eq!(token_param(FencingToken(u64::MAX)), -1);
    }
}
