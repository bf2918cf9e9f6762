//! What the SQLite columns hold: idempotency keys as stored and response bytes, read back
//! exactly, with bad bytes refused as typed errors.

use idem_core::codec::{CodecError, RESPONSE_FORMAT_VERSION, decode_response, encode_response};
use idem_core::{IdempotencyKey, StoredResponse};

#[test]
fn keys_that_look_quoted_round_trip_through_the_key_column() {
    for stored in ["abc", "\"abc", "a\\b", "\"", "\\", "x\"y\"", "~!@#$%^&*()_+"] {
        let key = IdempotencyKey::from_stored(stored).expect(stored);
        assert_eq!(key.as_str(), stored);
    }
    assert!(IdempotencyKey::from_stored("has space").is_none());
    assert!(IdempotencyKey::from_stored("").is_none());
}

#[test]
fn responses_round_trip_through_the_response_column_and_bad_bytes_are_typed_errors() {
    let r = StoredResponse::new(201, vec![("location".into(), b"/t/42".to_vec())], b"{}".to_vec());
    assert_eq!(decode_response(&encode_response(&r)).expect("decode"), r);
    assert!(matches!(decode_response(&[]), Err(CodecError::Empty)));
    assert!(matches!(decode_response(&[9, 1, 2]), Err(CodecError::UnknownVersion(9))));
    assert!(matches!(decode_response(&[RESPONSE_FORMAT_VERSION, 0xff]), Err(CodecError::Malformed(_))));
    let mut long = encode_response(&r);
    long.push(0);
    assert!(matches!(decode_response(&long), Err(CodecError::Trailing(1))));
}
