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
    encode_response_into(response, Vec::new())
}

/// [`encode_response`] appended to `out` (which keeps its bytes in front): lets a caller
/// reserve room around the encoding, as sealing does for its nonce and tag.
#[must_use]
pub(crate) fn encode_response_into(response: &StoredResponse, mut out: Vec<u8>) -> Vec<u8> {
    let start = out.len();
    out.push(RESPONSE_FORMAT_VERSION);
    postcard::to_extend(response, out).unwrap_or_else(|_| {
        // Unreachable for plain data; the caller's prefix plus the bare version byte
        // (which decodes to a typed error) rather than a panic.
        let mut v = vec![0; start];
        v.push(RESPONSE_FORMAT_VERSION);
        v
    })
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

/// [`decode_response`] of `buf[range]`, handing `buf` itself over as the body's bytes when
/// the body is stored as is (the common case): no second allocation and no copy beyond
/// moving the body to the front. Any other body decodes as [`decode_response`] does.
///
/// # Errors
/// As [`decode_response`].
#[cfg(feature = "seal")]
pub(crate) fn decode_response_reusing(
    mut buf: Vec<u8>,
    range: std::ops::Range<usize>,
) -> Result<StoredResponse, CodecError> {
    /// The fields of a [`StoredResponse`] with an `Identity` body, the body borrowed.
    /// Variant 0 is `StoredBody::Identity` in both enums, so postcard reads the same bytes;
    /// any other variant fails here and takes the general path.
    #[derive(serde::Deserialize)]
    struct Borrowed<'a> {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        #[serde(borrow)]
        body: IdentityOnly<'a>,
    }
    #[derive(serde::Deserialize)]
    enum IdentityOnly<'a> {
        Identity(#[serde(borrow)] &'a [u8]),
    }
    let Some(bytes) = buf.get(range.clone()) else {
        return Err(CodecError::Empty);
    };
    if let Some((&RESPONSE_FORMAT_VERSION, rest)) = bytes.split_first()
        && let Ok((Borrowed { status, headers, body: IdentityOnly::Identity(body) }, [])) =
            postcard::take_from_bytes::<Borrowed<'_>>(rest)
    {
        let start = body.as_ptr().addr() - buf.as_ptr().addr();
        let end = start + body.len();
        buf.truncate(end);
        buf.drain(..start);
        return Ok(StoredResponse { status, headers, body: crate::record::StoredBody::Identity(buf) });
    }
    decode_response(&buf[range])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-place decode reads what `decode_response` reads, for every body form.
    #[cfg(feature = "seal")]
    #[test]
    fn decoding_in_place_matches_decoding_by_copy() {
        use crate::record::StoredBody;
        let responses = [
            StoredResponse::new(201, vec![("location".into(), b"/w/1".to_vec())], b"{\"id\":1}".to_vec()),
            StoredResponse::new(204, vec![], vec![]),
            StoredResponse::compressed_over(200, vec![], vec![b'a'; 4096], 16),
            StoredResponse { status: 200, headers: vec![], body: StoredBody::NotRetained { len: Some(9) } },
            StoredResponse::new(200, vec![], b"x".to_vec()).with_trailers(vec![("grpc-status".into(), b"0".to_vec())]),
        ];
        for r in responses {
            let mut buf = vec![7; 5];
            buf.extend(encode_response(&r));
            let end = buf.len();
            buf.extend([9; 3]);
            assert_eq!(decode_response_reusing(buf, 5..end).expect("decodes"), r);
        }
        let mut bad = encode_response(&StoredResponse::new(200, vec![], b"abc".to_vec()));
        bad.push(0);
        let n = bad.len();
        assert!(decode_response_reusing(bad, 0..n).is_err(), "trailing bytes");
        assert!(decode_response_reusing(vec![RESPONSE_FORMAT_VERSION], 0..1).is_err());
        assert!(decode_response_reusing(vec![], 0..1).is_err());
    }

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
