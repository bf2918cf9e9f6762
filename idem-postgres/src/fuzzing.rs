//! The body of the `stored_postgres` fuzz target (`fuzz/`), here so that its committed
//! corpus also replays on stable Rust (`tests/fuzz_corpus.rs`). Not part of the supported
//! API.
//!
//! Input: the twelve columns of a records row (in the store's `COLUMNS` order) as the
//! drivers hand them over, each a tag byte (NULL, bytes, text, bigint, boolean) then its
//! value: what a hostile writer with `UPDATE` on the table, or one that dropped its
//! constraints, could leave. The row decoder every statement goes through must answer with
//! a record or a typed error, never panic and never allocate without bound.

use idem_core::codec::encode_response;
use idem_core::{Record, RecordState};

use crate::driver::{Row, Value};
use crate::sql::record_at;

/// Reads the fuzzer's bytes.
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
            1 => Value::Bytes(self.field().to_vec()),
            2 => Value::Text(String::from_utf8_lossy(self.field()).into_owned()),
            3 => Value::I64(i64::from_le_bytes(self.field().try_into().unwrap_or_default())),
            _ => Value::Bool(self.byte() % 2 == 1),
        }
    }
}

/// Panics only on a bug in the decoder (see the module docs).
pub fn stored_record(data: &[u8]) {
    let mut input = Input(data);
    let row = Row((0..12).map(|_| input.value()).collect());
    let first = record_at(&row, 0, None);
    assert_eq!(format!("{first:?}"), format!("{:?}", record_at(&row, 0, None)), "decoding is deterministic");
    if let Ok(record) = first {
        assert_eq!(Value::Bytes(record.id.0.to_vec()), row.0[0], "the id is the id column");
        assert_eq!(record.response.is_some(), record.state == RecordState::Completed, "a response iff completed");
        if let Some(response) = &record.response {
            let _ = response.body_bytes();
        }
        let again = record_at(&Row(columns(&record)), 0, None);
        assert_eq!(again.ok().as_ref(), Some(&record), "an accepted record round-trips");
    }
}

/// The columns as the drivers return them for `record`.
fn columns(r: &Record) -> Vec<Value> {
    vec![
        Value::Bytes(r.id.0.to_vec()),
        Value::Bytes(r.scope.principal.0.as_bytes().to_vec()),
        Value::Bytes(r.scope.endpoint.0.as_bytes().to_vec()),
        Value::Text(r.key.as_str().to_owned()),
        Value::Bytes(r.fingerprint.0.to_vec()),
        Value::Text(r.state.as_str().to_owned()),
        Value::I64(i64::try_from(r.token.0).unwrap_or(-1)),
        r.response.as_ref().map_or(Value::Null, |resp| Value::Bytes(encode_response(resp))),
        Value::I64(r.created_at.0),
        Value::I64(r.started_at.0),
        Value::I64(r.lease_expires_at.0),
        Value::I64(r.expires_at.0),
    ]
}

/// A seed input for `record`: its row as the drivers return it.
#[must_use]
pub fn seed(record: &Record) -> Vec<u8> {
    let mut out = Vec::new();
    for value in columns(record) {
        let (tag, bytes) = match value {
            Value::Null => (0, Vec::new()),
            Value::Bytes(b) => (1, b),
            Value::Text(s) => (2, s.into_bytes()),
            Value::I64(i) => (3, i.to_le_bytes().to_vec()),
            Value::Bool(b) => {
                out.extend_from_slice(&[4, u8::from(b)]);
                continue;
            }
        };
        out.push(tag);
        out.extend_from_slice(&u16::try_from(bytes.len()).unwrap_or(u16::MAX).to_le_bytes());
        out.extend_from_slice(&bytes);
    }
    out
}
