//! The byte form of a record for stores that keep opaque values (redb, SQLite blobs,
//! files): one format-version byte, then postcard.
//!
//! postcard replaces bincode, whose final crates.io release is a deliberate compile error.
//! Decoding arbitrary bytes returns a typed [`CodecError`], never panics, and never
//! allocates more than the input can justify (postcard reads lengths against the
//! remaining input; compressed bodies are bounded by [`crate::record::MAX_DECODED_BODY`]).

pub use crate::corrupt::CodecError;
use crate::record::{Record, StoredResponse};

/// The current format version, the first byte of every encoded record.
pub const FORMAT_VERSION: u8 = 1;

/// Encodes a record: `[FORMAT_VERSION] ++ postcard(record)`.
#[must_use]
pub fn encode(record: &Record) -> Vec<u8> {
    let out = vec![FORMAT_VERSION];
    // Serialising plain data into a Vec cannot fail; fall back to the version byte alone
    // (which decodes to a typed error) rather than panic if it ever did.
    match postcard::to_extend(record, out) {
        Ok(v) => v,
        Err(_) => vec![FORMAT_VERSION],
    }
}

/// Decodes bytes written by [`encode`].
///
/// # Errors
/// [`CodecError`] for empty, unknown-version, malformed or trailing input.
pub fn decode(bytes: &[u8]) -> Result<Record, CodecError> {
    let (&version, rest) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != FORMAT_VERSION {
        return Err(CodecError::UnknownVersion(version));
    }
    let (record, tail) = postcard::take_from_bytes::<Record>(rest).map_err(CodecError::Malformed)?;
    if !tail.is_empty() {
        return Err(CodecError::Trailing(tail.len()));
    }
    Ok(record)
}

/// Format version of a stored response kept apart from its record (a Redis hash field,
/// a Postgres or SQLite `response` column): the first byte, then postcard.
pub const RESPONSE_FORMAT_VERSION: u8 = 1;

/// Encodes a stored response on its own: `[RESPONSE_FORMAT_VERSION] ++ postcard(response)`.
/// Headers and body bytes round-trip exactly.
#[must_use]
pub fn encode_response(response: &StoredResponse) -> Vec<u8> {
    // Serialising plain data into a Vec cannot fail; the bare version byte (which decodes
    // to a typed error) is the fallback rather than a panic.
    postcard::to_extend(response, vec![RESPONSE_FORMAT_VERSION]).unwrap_or_else(|_| vec![RESPONSE_FORMAT_VERSION])
}

/// Decodes bytes written by [`encode_response`].
///
/// # Errors
/// [`CodecError`] for empty, unknown-version, malformed or trailing input.
pub fn decode_response(bytes: &[u8]) -> Result<StoredResponse, CodecError> {
    let (&version, rest) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != RESPONSE_FORMAT_VERSION {
        return Err(CodecError::UnknownVersion(version));
    }
    let (response, tail) = postcard::take_from_bytes::<StoredResponse>(rest).map_err(CodecError::Malformed)?;
    if !tail.is_empty() {
        return Err(CodecError::Trailing(tail.len()));
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_round_trip_byte_exact_and_reject_garbage() {
        let r = StoredResponse::new(201, vec![("location".into(), b"/t/42".to_vec())], vec![0, 255, 1]);
        assert_eq!(decode_response(&encode_response(&r)).expect("decodes"), r);
        let all_bytes = StoredResponse::new(200, vec![("etag".into(), vec![0, 0xff, b'"'])], (0..=255u8).collect());
        assert_eq!(decode_response(&encode_response(&all_bytes)).expect("decodes"), all_bytes);
        assert!(matches!(decode_response(&[]), Err(CodecError::Empty)));
        assert!(matches!(decode_response(&[9, 1]), Err(CodecError::UnknownVersion(9))));
        assert!(matches!(decode_response(&[RESPONSE_FORMAT_VERSION, 0xff, 0xff, 0xff]), Err(CodecError::Malformed(_))));
        let mut long = encode_response(&r);
        long.push(0);
        assert!(matches!(decode_response(&long), Err(CodecError::Trailing(1))));
    }

    /// Storing trailers changed the bytes of responses without trailers, so records
    /// written before trailers existed no longer decoded (or decoded differently).
    #[test]
    fn trailers_round_trip_and_records_from_before_trailers_still_decode() {
        // 201, no headers, Identity(b"hi"), as every earlier build wrote it.
        let before = [RESPONSE_FORMAT_VERSION, 0xc9, 0x01, 0x00, 0x00, 0x02, b'h', b'i'];
        let old = decode_response(&before).expect("an old record decodes");
        assert_eq!(old, StoredResponse::new(201, vec![], b"hi".to_vec()));
        assert!(old.trailers().is_empty());
        assert_eq!(encode_response(&old), before, "no trailers: the same bytes as before");

        let grpc = StoredResponse::new(200, vec![("content-type".into(), b"application/grpc".to_vec())], vec![0; 9])
            .with_trailers(vec![("grpc-status".into(), b"0".to_vec()), ("grpc-message".into(), vec![])]);
        let back = decode_response(&encode_response(&grpc)).expect("decodes");
        assert_eq!(back, grpc);
        assert_eq!(back.trailers()[0], ("grpc-status".to_owned(), b"0".to_vec()));
        assert_eq!(back.body_bytes().expect("body").as_deref(), Some(&[0u8; 9][..]));
        let lz4 = StoredResponse::compressed_over(200, vec![], vec![7; 10_000], 16)
            .with_trailers(vec![("x-checksum".into(), b"abc".to_vec())]);
        assert_eq!(
            decode_response(&encode_response(&lz4)).expect("decodes").body_bytes().expect("body").map(|b| b.len()),
            Some(10_000)
        );
        let nested = StoredResponse {
            status: 200,
            headers: vec![],
            body: crate::StoredBody::WithTrailers {
                body: Box::new(crate::StoredBody::WithTrailers {
                    body: Box::new(crate::StoredBody::Identity(vec![])),
                    trailers: vec![],
                }),
                trailers: vec![],
            },
        };
        assert!(matches!(nested.body_bytes(), Err(CodecError::NestedTrailers)));
        // Hostile bytes that nest trailers a million deep are refused by the decoder at
        // the second level, never by a stack overflow.
        let mut deep = vec![RESPONSE_FORMAT_VERSION, 0xc8, 0x01, 0x00];
        deep.extend(std::iter::repeat_n(3, 1_000_000));
        assert!(matches!(decode_response(&deep), Err(CodecError::Malformed(_))));
        assert!(matches!(decode_response(&encode_response(&nested)), Err(CodecError::Malformed(_))));
    }
}
