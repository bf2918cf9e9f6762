//! The body of the `stored_redb` fuzz target (`fuzz/`), here so that its committed corpus
//! also replays on stable Rust (`tests/fuzz_corpus.rs`). Not part of the supported API.
//!
//! Input: a 32-byte record id, then the bytes a hostile writer left as the value of that
//! id in the records table. [`crate::table::decode_record`] must answer with a record of
//! that id or a typed [`StoreError::Corrupt`], never panic and never allocate without bound.

use idem_core::{Record, RecordId, StoreError, codec};

use crate::table::decode_record;

/// Panics only on a bug in the decoder (see the module docs).
pub fn stored_record(data: &[u8]) {
    let Some((id, bytes)) = data.split_first_chunk::<32>() else { return };
    let id = RecordId::from_bytes(*id);
    let first = decode_record(id, bytes);
    assert_eq!(format!("{first:?}"), format!("{:?}", decode_record(id, bytes)), "decoding is deterministic");
    match first {
        Ok(record) => {
            assert_eq!(record.id, id, "a record is only returned under its own id");
            if let Some(response) = &record.response {
                // A hostile compressed body: a typed error, bounded, never a panic.
                let _ = response.body_bytes();
            }
            let again = decode_record(id, &codec::encode(&record)).ok();
            assert_eq!(again.as_ref(), Some(&record), "an accepted record round-trips");
        }
        Err(e) => assert!(matches!(e, StoreError::Corrupt { id: Some(i), .. } if i == id), "untyped error {e:?}"),
    }
}

/// A seed input for `record`: its id, then its encoding.
#[must_use]
pub fn seed(record: &Record) -> Vec<u8> {
    let mut out = record.id.as_bytes().to_vec();
    out.extend_from_slice(&codec::encode(record));
    out
}
