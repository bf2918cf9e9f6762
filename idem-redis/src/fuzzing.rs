//! The body of the `stored_redis` fuzz target (`fuzz/`), here so that its committed corpus
//! also replays on stable Rust (`tests/fuzz_corpus.rs`). Not part of the supported API.
//!
//! Input: a 32-byte record id, then the hash fields `h` (header and scope) and `r` (the
//! response) of that record's hash as a hostile writer with `HSET` could leave them, each a
//! presence byte, a length and bytes. The decoder every read goes through must answer with
//! a record that lives at that id or a typed error, never panic and never allocate without
//! bound.

use idem_core::codec::encode_response;
use idem_core::{Record, RecordId, RecordState};

use crate::script::{HEADER_FORMAT, STATE_COMPLETED, STATE_FAILED, STATE_IN_FLIGHT, decode_fields, encode_scope};

/// Reads the fuzzer's bytes.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        b
    }

    /// A hash field: absent when the presence byte is even.
    fn field(&mut self) -> Option<Vec<u8>> {
        let present = self.byte() % 2 == 1;
        let len = usize::from(u16::from_le_bytes([self.byte(), self.byte()])).min(self.0.len());
        let (field, rest) = self.0.split_at(len);
        self.0 = rest;
        present.then(|| field.to_vec())
    }
}

/// Panics only on a bug in the decoder (see the module docs).
pub fn stored_record(data: &[u8]) {
    let Some((id, rest)) = data.split_first_chunk::<32>() else { return };
    let id = RecordId(*id);
    let mut input = Input(rest);
    let (h, r) = (input.field(), input.field());
    let first = decode_fields(id, h.clone(), r.clone());
    assert_eq!(format!("{first:?}"), format!("{:?}", decode_fields(id, h, r)), "decoding is deterministic");
    if let Ok(record) = first {
        assert_eq!(record.id, id);
        let derived = RecordId::derive(&record.scope.principal.0, &record.scope.endpoint.0, record.key.as_str());
        assert_eq!(derived, id, "a record is only returned at the id its scope and key hash to");
        assert_eq!(record.response.is_some(), record.state == RecordState::Completed, "a response iff completed");
        if let Some(response) = &record.response {
            let _ = response.body_bytes();
        }
        let (h, r) = fields(&record);
        assert_eq!(decode_fields(id, Some(h), r).ok().as_ref(), Some(&record), "an accepted record round-trips");
    }
}

/// Fields `h` and `r` as the scripts write them for `record`.
fn fields(r: &Record) -> (Vec<u8>, Option<Vec<u8>>) {
    let state = match r.state {
        RecordState::InFlight => STATE_IN_FLIGHT,
        RecordState::Completed => STATE_COMPLETED,
        RecordState::Failed => STATE_FAILED,
    };
    let mut h = vec![HEADER_FORMAT, state];
    for v in
        [r.token.0, r.created_at.0 as u64, r.started_at.0 as u64, r.lease_expires_at.0 as u64, r.expires_at.0 as u64]
    {
        h.extend_from_slice(&v.to_be_bytes());
    }
    h.extend_from_slice(&r.fingerprint.0);
    h.extend_from_slice(&encode_scope(&r.scope, &r.key));
    (h, r.response.as_ref().map(encode_response))
}

/// A seed input for `record`: its id and hash fields as the scripts write them.
#[must_use]
pub fn seed(record: &Record) -> Vec<u8> {
    let (h, r) = fields(record);
    let mut out = record.id.0.to_vec();
    for field in [Some(h), r] {
        out.push(u8::from(field.is_some()));
        let field = field.unwrap_or_default();
        out.extend_from_slice(&u16::try_from(field.len()).unwrap_or(u16::MAX).to_le_bytes());
        out.extend_from_slice(&field);
    }
    out
}
