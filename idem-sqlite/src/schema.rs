//! The schema: versioned migrations, and how a [`Record`] maps to a row.
//!
//! The migrations are the SQL files in `idem-sqlite/migrations/`, compiled in with
//! `include_str!` and applied in order on open inside one `BEGIN IMMEDIATE` transaction.
//! The version reached is kept in `PRAGMA user_version` (a field of the database header,
//! written by the same transaction), so two processes opening a fresh file at once apply
//! each migration exactly once: the second waits for the write lock, then sees the new
//! version.

use idem_core::codec::CodecError;
use idem_core::{
    Endpoint, FencingToken, Fingerprint, IdempotencyKey, Principal, Record, RecordId, RecordState, Scope, StoreError,
    StoredResponse, UnixMillis,
};
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Row, TransactionBehavior, params};

use crate::error::Error;

/// One schema migration, as shipped in `idem-sqlite/migrations/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    /// `PRAGMA user_version` once this migration is applied (1, 2, ...).
    pub version: u32,
    /// The file name, e.g. `0001_records.sql`.
    pub name: &'static str,
    /// The SQL it runs.
    pub sql: &'static str,
}

/// Every migration, oldest first. The store applies the ones newer than the file's
/// `user_version` on open; operators who manage schemas by hand can apply the same SQL.
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "0001_records.sql", sql: include_str!("../migrations/0001_records.sql") },
    Migration { version: 2, name: "0002_journal.sql", sql: include_str!("../migrations/0002_journal.sql") },
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: u32 = 2;

/// Brings `conn`'s file to [`SCHEMA_VERSION`].
pub(crate) fn migrate(conn: &mut Connection) -> Result<(), Error> {
    let tx =
        conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(Error::sqlite("begin migration"))?;
    let found: i64 =
        tx.pragma_query_value(None, "user_version", |row| row.get(0)).map_err(Error::sqlite("read user_version"))?;
    if found > i64::from(SCHEMA_VERSION) {
        return Err(Error::SchemaTooNew { found, known: SCHEMA_VERSION });
    }
    for m in MIGRATIONS.iter().filter(|m| i64::from(m.version) > found) {
        let failed = |source| Error::Migration { version: m.version, name: m.name, source };
        tx.execute_batch(m.sql).map_err(failed)?;
        tx.pragma_update(None, "user_version", m.version).map_err(failed)?;
        tracing::info!(version = m.version, name = m.name, "applied idem-sqlite migration");
    }
    tx.commit().map_err(Error::sqlite("commit migration"))
}

const COLUMNS: &str = "id, principal, endpoint, key, fingerprint, state, token, created_at, started_at, \
                       lease_expires_at, expires_at, response";

/// Reads one record by id (expired or not: the caller decides with its `now`).
pub(crate) fn select(conn: &Connection, id: RecordId) -> Result<Option<Record>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM idem_records WHERE id = ?1");
    let mut stmt = conn.prepare_cached(&sql).map_err(Error::sqlite("prepare read"))?;
    let row = stmt.query_row([&id.0[..]], |row| Ok(from_row(row))).optional().map_err(Error::sqlite("read record"))?;
    row.transpose()
}

/// Inserts `record`, or overwrites the row with its id (a replaced expired record, a
/// reclaim, a completion, a failure). Callers computed `record` from the row they read in
/// the same write transaction.
pub(crate) fn upsert(conn: &Connection, record: &Record) -> Result<(), StoreError> {
    let sql = format!(
        "INSERT INTO idem_records ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12) \
         ON CONFLICT (id) DO UPDATE SET principal = excluded.principal, endpoint = excluded.endpoint, \
         key = excluded.key, fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token, \
         created_at = excluded.created_at, started_at = excluded.started_at, \
         lease_expires_at = excluded.lease_expires_at, expires_at = excluded.expires_at, response = excluded.response"
    );
    let token = i64::try_from(record.token.0)
        .map_err(|_| Error::invalid_record(record.id, "token", format!("{} does not fit an INTEGER", record.token)))?;
    let response = record.response.as_ref().map(encode_response);
    let mut stmt = conn.prepare_cached(&sql).map_err(Error::sqlite("prepare write"))?;
    stmt.execute(params![
        &record.id.0[..],
        record.scope.principal.0,
        record.scope.endpoint.0,
        record.key.as_str(),
        &record.fingerprint.0[..],
        state_name(record.state),
        token,
        record.created_at.0,
        record.started_at.0,
        record.lease_expires_at.0,
        record.expires_at.0,
        response,
    ])
    .map_err(Error::sqlite("write record"))?;
    Ok(())
}

/// Deletes every journal entry of record `id` (a claim replacing an expired record starts
/// with an empty journal).
pub(crate) fn delete_journal(conn: &Connection, id: RecordId) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM idem_journal WHERE record_id = ?1")
        .and_then(|mut stmt| stmt.execute([&id.0[..]]))
        .map_err(Error::sqlite("delete journal"))?;
    Ok(())
}

/// Reads journal entry `name` of record `id` in the writer's transaction.
pub(crate) fn journal_entry(conn: &Connection, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
    let value = conn
        .prepare_cached("SELECT value FROM idem_journal WHERE record_id = ?1 AND name = ?2")
        .and_then(|mut stmt| stmt.query_row(params![&id.0[..], name], |row| row.get(0)).optional())
        .map_err(Error::sqlite("read journal"))?;
    Ok(value)
}

/// Writes (or replaces) journal entry `name` of record `id`.
pub(crate) fn put_journal_entry(conn: &Connection, id: RecordId, name: &str, value: &[u8]) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO idem_journal (record_id, name, value) VALUES (?1, ?2, ?3) \
         ON CONFLICT (record_id, name) DO UPDATE SET value = excluded.value",
    )
    .and_then(|mut stmt| stmt.execute(params![&id.0[..], name, value]))
    .map_err(Error::sqlite("write journal"))?;
    Ok(())
}

/// Reads journal entry `name` of record `id` on a read connection, checking in the same
/// statement (one snapshot) that the record is live at `now`.
pub(crate) fn journal_lookup(
    conn: &Connection,
    id: RecordId,
    name: &str,
    now: UnixMillis,
) -> Result<Option<Vec<u8>>, StoreError> {
    let value = conn
        .prepare_cached(
            "SELECT j.value FROM idem_records AS r \
             JOIN idem_journal AS j ON j.record_id = r.id AND j.name = ?2 WHERE r.id = ?1 AND r.expires_at > ?3",
        )
        .and_then(|mut stmt| stmt.query_row(params![&id.0[..], name, now.0], |row| row.get(0)).optional())
        .map_err(Error::sqlite("read journal"))?;
    Ok(value)
}

/// Deletes up to `limit` records with `expires_at <= now`, oldest first; returns how many
/// went and whether expired records remain. Their journal entries go with them (trigger
/// `idem_records_delete_journal`).
pub(crate) fn sweep(conn: &Connection, now: UnixMillis, limit: usize) -> Result<(u64, bool), StoreError> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let removed = conn
        .prepare_cached(
            "DELETE FROM idem_records WHERE id IN \
             (SELECT id FROM idem_records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)",
        )
        .and_then(|mut stmt| stmt.execute(params![now.0, limit]))
        .map_err(Error::sqlite("sweep"))?;
    let more: bool = conn
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM idem_records WHERE expires_at <= ?1)")
        .and_then(|mut stmt| stmt.query_row([now.0], |row| row.get(0)))
        .map_err(Error::sqlite("sweep"))?;
    Ok((removed as u64, more))
}

fn state_name(state: RecordState) -> &'static str {
    match state {
        RecordState::InFlight => "in_flight",
        RecordState::Completed => "completed",
        RecordState::Failed => "failed",
    }
}

/// Format byte in front of a postcard-encoded [`StoredResponse`].
const RESPONSE_FORMAT: u8 = 1;

fn encode_response(response: &StoredResponse) -> Vec<u8> {
    // Serialising plain data into a Vec cannot fail; a lone format byte (which decodes to
    // a typed error) is written rather than panicking if it ever did.
    postcard::to_extend(response, vec![RESPONSE_FORMAT]).unwrap_or_else(|_| vec![RESPONSE_FORMAT])
}

fn decode_response(bytes: &[u8]) -> Result<StoredResponse, CodecError> {
    let (&format, rest) = bytes.split_first().ok_or(CodecError::Empty)?;
    if format != RESPONSE_FORMAT {
        return Err(CodecError::UnknownVersion(format));
    }
    let (response, tail) = postcard::take_from_bytes::<StoredResponse>(rest).map_err(CodecError::Malformed)?;
    if !tail.is_empty() {
        return Err(CodecError::Trailing(tail.len()));
    }
    Ok(response)
}

/// Rebuilds a key from its stored (unquoted) form. A stored key is visible ASCII and may
/// itself start with `"`, so it is re-quoted as an RFC 8941 sf-string, which `parse`
/// unquotes byte-exact.
fn key_from_column(stored: &str) -> Option<IdempotencyKey> {
    let mut quoted = String::with_capacity(stored.len() + 2);
    quoted.push('"');
    for c in stored.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    IdempotencyKey::parse_with_limit(quoted.as_bytes(), usize::MAX).ok().filter(|k| k.as_str() == stored)
}

fn bytes32(id: &[u8], column: &'static str, value: &[u8]) -> Result<[u8; 32], Error> {
    value.try_into().map_err(|_| Error::invalid_row(id, column, format!("{} bytes, expected 32", value.len())))
}

fn from_row(row: &Row<'_>) -> Result<Record, StoreError> {
    // A value of the wrong SQL type is reported by rusqlite (kept as the source).
    let read = Error::sqlite("read record");
    let raw_id: Vec<u8> = row.get(0).map_err(read)?;
    let id = RecordId(bytes32(&raw_id, "id", &raw_id)?);
    let get = |i: usize| row.get_ref(i).map_err(Error::sqlite("read record"));
    let text = |i: usize| row.get::<_, String>(i).map_err(Error::sqlite("read record"));
    let int = |i: usize| row.get::<_, i64>(i).map_err(Error::sqlite("read record"));

    let key_text = text(3)?;
    let key =
        key_from_column(&key_text).ok_or_else(|| Error::invalid_row(&raw_id, "key", "not a valid idempotency key"))?;
    let fingerprint: Vec<u8> = row.get(4).map_err(Error::sqlite("read record"))?;
    let fingerprint = Fingerprint(bytes32(&raw_id, "fingerprint", &fingerprint)?);
    let state = match text(5)?.as_str() {
        "in_flight" => RecordState::InFlight,
        "completed" => RecordState::Completed,
        "failed" => RecordState::Failed,
        other => return Err(Error::invalid_row(&raw_id, "state", format!("unknown state {other:?}")).into()),
    };
    let token = u64::try_from(int(6)?).map_err(|_| Error::invalid_row(&raw_id, "token", "negative"))?;
    let response = match get(11)? {
        ValueRef::Null => None,
        ValueRef::Blob(bytes) => {
            Some(decode_response(bytes).map_err(|source| StoreError::Corrupt { id: Some(id), source })?)
        }
        _ => return Err(Error::invalid_row(&raw_id, "response", "neither a blob nor NULL").into()),
    };
    Ok(Record {
        id,
        scope: Scope { principal: Principal(text(1)?), endpoint: Endpoint(text(2)?) },
        key,
        fingerprint,
        state,
        token: FencingToken(token),
        response,
        created_at: UnixMillis(int(7)?),
        started_at: UnixMillis(int(8)?),
        lease_expires_at: UnixMillis(int(9)?),
        expires_at: UnixMillis(int(10)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_look_quoted_round_trip() {
        for stored in ["abc", "\"abc", "a\\b", "\"", "\\", "x\"y\"", "~!@#$%^&*()_+"] {
            let key = key_from_column(stored).expect(stored);
            assert_eq!(key.as_str(), stored);
        }
        assert!(key_from_column("has space").is_none());
        assert!(key_from_column("").is_none());
    }

    #[test]
    fn responses_round_trip_and_bad_bytes_are_typed_errors() {
        let r = StoredResponse::new(201, vec![("location".into(), b"/t/42".to_vec())], b"{}".to_vec());
        assert_eq!(decode_response(&encode_response(&r)).expect("decode"), r);
        assert!(matches!(decode_response(&[]), Err(CodecError::Empty)));
        assert!(matches!(decode_response(&[9, 1, 2]), Err(CodecError::UnknownVersion(9))));
        assert!(matches!(decode_response(&[RESPONSE_FORMAT, 0xff]), Err(CodecError::Malformed(_))));
        let mut long = encode_response(&r);
        long.push(0);
        assert!(matches!(decode_response(&long), Err(CodecError::Trailing(1))));
    }

    #[test]
    fn migrations_are_numbered_in_order_and_end_at_the_schema_version() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version as usize, i + 1);
            assert!(m.name.starts_with(&format!("{:04}_", m.version)));
        }
        assert_eq!(MIGRATIONS.last().map(|m| m.version), Some(SCHEMA_VERSION));
    }
}
