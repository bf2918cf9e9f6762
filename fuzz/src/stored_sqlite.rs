//! Target `stored_sqlite`: an `idem_records` row as a hostile writer with access to the file
//! could leave it, read back through the store.
//!
//! Input: twelve column values of the row (id, principal, endpoint, key, fingerprint,
//! state, token, created_at, started_at, lease_expires_at, expires_at, response: the
//! columns of idem-sqlite's documented schema), each a tag byte (NULL, INTEGER, REAL, TEXT
//! or BLOB: an SQLite column takes a value of any type) then its bytes. The body opens a
//! `SqliteStore` on a fresh file that [`SqliteStore::migrate`] created, writes the row with
//! rusqlite (CHECK constraints off, as `PRAGMA ignore_check_constraints` lets any writer;
//! a row that breaks a NOT NULL goes into a copy of the table without constraints, as a
//! writer who dropped them would leave it), then reads it with `get` and `list`. A read
//! answers with a record whose id is the id column, or an error, never a panic, never an
//! allocation without bound, the same answer twice; an accepted record round-trips through
//! its row.

use std::path::Path;
use std::sync::Arc;

use idem_core::codec::encode_response;
use idem_core::{ListFilter, ManualClock, Record, RecordId, Store};
use idem_sqlite::{Config, SqliteStore};
use rusqlite::Connection;
use rusqlite::types::Value;

use crate::{Input, NOW, push_field, runtime, same_read};

const INSERT: &str = "INSERT INTO idem_records (id, principal, endpoint, key, fingerprint, state, token, created_at, \
                      started_at, lease_expires_at, expires_at, response) \
                      VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)";

/// The records table without its constraints: same columns, same declared types (so the
/// same type affinities).
const UNCONSTRAINED: &str = "DROP TABLE idem_records;
    CREATE TABLE idem_records (id BLOB, principal TEXT, endpoint TEXT, key TEXT, fingerprint BLOB, state TEXT,
        token INTEGER, created_at INTEGER, started_at INTEGER, lease_expires_at INTEGER, expires_at INTEGER,
        response BLOB);";

fn value(input: &mut Input<'_>) -> Value {
    match input.byte() % 5 {
        0 => Value::Null,
        1 => Value::Integer(i64::from_le_bytes(input.field().try_into().unwrap_or_default())),
        2 => Value::Real(f64::from_le_bytes(input.field().try_into().unwrap_or_default())),
        3 => Value::Text(String::from_utf8_lossy(input.field()).into_owned()),
        _ => Value::Blob(input.field().to_vec()),
    }
}

/// Panics only on a bug in the store's read path (see the module docs).
pub fn stored_record(data: &[u8]) {
    let mut input = Input(data);
    let values: Vec<Value> = (0..12).map(|_| value(&mut input)).collect();
    // `get` looks a record up by its 32-byte id; another id column is never found.
    let id = match &values[0] {
        Value::Blob(b) => RecordId::from_bytes(b.as_slice().try_into().unwrap_or([0; 32])),
        _ => RecordId::from_bytes([0; 32]),
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("fuzz.sqlite");
    let config = || Config::default().with_clock(Arc::new(ManualClock::new(NOW)));
    SqliteStore::migrate(&path, &config()).expect("a fresh file migrates");
    let store = SqliteStore::open(&path, config()).expect("the store opens its fresh file");
    plant(&path, &values);

    let rt = runtime();
    let first = rt.block_on(store.get(id));
    if let Ok(Some(record)) = same_read(first, &rt.block_on(store.get(id))) {
        assert_eq!(Value::Blob(record.id.as_bytes().to_vec()), values[0], "the id is the id column");
        if let Some(response) = &record.response {
            let _ = response.body_bytes();
        }
        plant(&path, &columns(&record));
        let again = rt.block_on(store.get(id));
        assert_eq!(again.ok().flatten().as_ref(), Some(&record), "an accepted record round-trips");
        plant(&path, &values);
    }
    let first = rt.block_on(store.list(ListFilter::new(10)));
    let listed = rt.block_on(store.list(ListFilter::new(10)));
    assert_eq!(format!("{first:?}"), format!("{listed:?}"), "listing is deterministic");
    if let Ok(listing) = listed {
        for record in &listing.records {
            assert_eq!(Value::Blob(record.id.as_bytes().to_vec()), values[0], "the id is the id column");
        }
    }
}

/// Replaces every row of the records table with one row of `values`, as a hostile writer
/// with its own connection would.
fn plant(path: &Path, values: &[Value]) {
    let conn = Connection::open(path).expect("a second connection opens the file");
    conn.busy_timeout(std::time::Duration::from_secs(10)).expect("busy timeout");
    conn.pragma_update(None, "ignore_check_constraints", true).expect("CHECK constraints off");
    conn.execute("DELETE FROM idem_records", []).expect("delete");
    if conn.execute(INSERT, rusqlite::params_from_iter(values)).is_err() {
        // A NULL where the schema says NOT NULL (or an id the primary key refuses).
        conn.execute_batch(UNCONSTRAINED).expect("the table without constraints");
        conn.execute(INSERT, rusqlite::params_from_iter(values)).expect("a row of any values");
    }
}

/// The columns the store writes for `record` (idem-sqlite's `migrations/0001_records.sql`).
fn columns(r: &Record) -> Vec<Value> {
    vec![
        Value::Blob(r.id.as_bytes().to_vec()),
        Value::Text(r.scope.principal.as_str().to_owned()),
        Value::Text(r.scope.endpoint.as_str().to_owned()),
        Value::Text(r.key.as_str().to_owned()),
        Value::Blob(r.fingerprint.as_bytes().to_vec()),
        Value::Text(r.state.as_str().to_owned()),
        Value::Integer(i64::try_from(r.token.0).unwrap_or(-1)),
        Value::Integer(r.created_at.0),
        Value::Integer(r.started_at.0),
        Value::Integer(r.lease_expires_at.0),
        Value::Integer(r.expires_at.0),
        r.response.as_ref().map_or(Value::Null, |resp| Value::Blob(encode_response(resp))),
    ]
}

/// A seed input for `record`: its row as the store writes it.
#[must_use]
pub fn seed(record: &Record) -> Vec<u8> {
    let mut out = Vec::new();
    for value in columns(record) {
        let (tag, bytes) = match value {
            // A NULL is its tag alone, as `value` reads it.
            Value::Null => {
                out.push(0);
                continue;
            }
            Value::Integer(i) => (1, i.to_le_bytes().to_vec()),
            Value::Real(f) => (2, f.to_le_bytes().to_vec()),
            Value::Text(s) => (3, s.into_bytes()),
            Value::Blob(b) => (4, b),
        };
        out.push(tag);
        push_field(&mut out, &bytes);
    }
    out
}
