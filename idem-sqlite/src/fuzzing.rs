//! The body of the `stored_sqlite` fuzz target (`fuzz/`), here so that its committed corpus
//! also replays on stable Rust (`tests/fuzz_corpus.rs`). Not part of the supported API.
//!
//! Input: twelve column values of an `idem_records` row as a hostile writer could leave
//! them (SQLite columns take a value of any type: NULL, INTEGER, REAL, TEXT or BLOB), each
//! a tag byte then its bytes. The store's row decoder must answer with a record or a typed
//! error, never panic and never allocate without bound.

use std::cell::RefCell;

use idem_core::codec::encode_response;
use idem_core::{Record, StoreError};
use rusqlite::Connection;
use rusqlite::types::Value;

const SELECT: &str = "SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12";

thread_local! {
    static CONN: RefCell<Option<Connection>> = const { RefCell::new(None) };
}

/// Reads the fuzzer's bytes: a tag byte, then a value.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        b
    }

    fn field(&mut self) -> &'a [u8] {
        let len = usize::from(u16::from_le_bytes([self.byte(), self.byte()])).min(self.0.len());
        let (field, rest) = self.0.split_at(len);
        self.0 = rest;
        field
    }

    fn value(&mut self) -> Value {
        match self.byte() % 5 {
            0 => Value::Null,
            1 => Value::Integer(i64::from_le_bytes(self.field().try_into().unwrap_or_default())),
            2 => Value::Real(f64::from_le_bytes(self.field().try_into().unwrap_or_default())),
            3 => Value::Text(String::from_utf8_lossy(self.field()).into_owned()),
            _ => Value::Blob(self.field().to_vec()),
        }
    }
}

fn decode(values: &[Value]) -> Result<Record, StoreError> {
    CONN.with(|conn| {
        let mut conn = conn.borrow_mut();
        let conn = match &mut *conn {
            Some(c) => c,
            slot => slot.insert(Connection::open_in_memory().expect("an in-memory SQLite database opens")),
        };
        let mut stmt = conn.prepare_cached(SELECT).expect("the SELECT prepares");
        let row = stmt.query_row(rusqlite::params_from_iter(values), |row| Ok(crate::table::from_row(row)));
        row.expect("a SELECT of parameters returns one row")
    })
}

/// Panics only on a bug in the decoder (see the module docs).
pub fn stored_record(data: &[u8]) {
    let mut input = Input(data);
    let values: Vec<Value> = (0..12).map(|_| input.value()).collect();
    let first = decode(&values);
    assert_eq!(format!("{first:?}"), format!("{:?}", decode(&values)), "decoding is deterministic");
    if let Ok(record) = first {
        assert_eq!(Value::Blob(record.id.as_bytes().to_vec()), values[0], "the id is the id column");
        if let Some(response) = &record.response {
            let _ = response.body_bytes();
        }
        let again = decode(&columns(&record));
        assert_eq!(again.ok().as_ref(), Some(&record), "an accepted record round-trips");
    }
}

/// The columns the store writes for `record`.
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
            Value::Null => (0, Vec::new()),
            Value::Integer(i) => (1, i.to_le_bytes().to_vec()),
            Value::Real(f) => (2, f.to_le_bytes().to_vec()),
            Value::Text(s) => (3, s.into_bytes()),
            Value::Blob(b) => (4, b),
        };
        out.push(tag);
        out.extend_from_slice(&u16::try_from(bytes.len()).unwrap_or(u16::MAX).to_le_bytes());
        out.extend_from_slice(&bytes);
    }
    out
}
