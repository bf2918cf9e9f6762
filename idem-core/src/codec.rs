//! The byte form of a record for stores that keep opaque values (redb, SQLite blobs,
//! files): one format-version byte, then postcard.
//!
//! postcard replaces bincode, whose final crates.io release is a deliberate compile error.
//! Decoding arbitrary bytes returns a typed [`CodecError`], never panics, and never
//! allocates more than the input can justify (postcard reads lengths against the
//! remaining input; compressed bodies are bounded by [`crate::record::MAX_DECODED_BODY`]).
//!
//! Version 2 keeps a response's trailers in their own field after the body. Version 1
//! kept them inside the body (a fourth body variant); it is still read, into the same
//! shape, but never written.

use serde::Deserialize;

pub use crate::corrupt::CodecError;
use crate::record::{Record, StoredResponse};

/// The current format version, the first byte of every encoded record.
pub const FORMAT_VERSION: u8 = 2;

/// Encodes a record: `[FORMAT_VERSION] ++ postcard(record)`.
#[must_use]
pub fn encode(record: &Record) -> Vec<u8> {
    // Serialising plain data into a Vec cannot fail; fall back to the version byte alone
    // (which decodes to a typed error) rather than panic if it ever did.
    postcard::to_extend(record, vec![FORMAT_VERSION]).unwrap_or_else(|_| vec![FORMAT_VERSION])
}

/// Decodes bytes written by [`encode`], of this format version or version 1.
///
/// # Errors
/// [`CodecError`] for empty, unknown-version, malformed or trailing input.
pub fn decode(bytes: &[u8]) -> Result<Record, CodecError> {
    match bytes.split_first().ok_or(CodecError::Empty)? {
        (&FORMAT_VERSION, rest) => exactly(rest),
        (1, rest) => {
            let (
                id,
                scope,
                key,
                fingerprint,
                state,
                token,
                response,
                created_at,
                started_at,
                lease_expires_at,
                expires_at,
            ) = exactly::<v1::Record>(rest)?;
            let response = response.map(v1::response);
            Ok(Record {
                id,
                scope,
                key,
                fingerprint,
                state,
                token,
                response,
                created_at,
                started_at,
                lease_expires_at,
                expires_at,
            })
        }
        (&version, _) => Err(CodecError::UnknownVersion(version)),
    }
}

/// One postcard value that is all of `bytes`.
fn exactly<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    let (value, tail) = postcard::take_from_bytes::<T>(bytes).map_err(CodecError::Malformed)?;
    if !tail.is_empty() {
        return Err(CodecError::Trailing(tail.len()));
    }
    Ok(value)
}

/// Version 1, read only. postcard writes a struct or a variant as its fields in order,
/// so tuples of the same types read what the structs of version 1 wrote.
mod v1 {
    use serde::Deserialize;

    use crate::record::{FencingToken, RecordState, StoredBody, StoredResponse};
    use crate::{Fingerprint, IdempotencyKey, RecordId, Scope, UnixMillis};

    type Fields = Vec<(String, Vec<u8>)>;

    /// [`crate::Record`]'s fields in order, its response in the version-1 layout.
    pub(super) type Record = (
        RecordId,
        Scope,
        IdempotencyKey,
        Fingerprint,
        RecordState,
        FencingToken,
        Option<Response>,
        UnixMillis,
        UnixMillis,
        UnixMillis,
        UnixMillis,
    );

    /// Status, headers, body.
    pub(super) type Response = (u16, Fields, Body);

    /// The body with its trailers inside. The first three variants are [`StoredBody`]'s; a
    /// body inside `WithTrailers` is read as a [`StoredBody`], which has no fourth variant,
    /// so hostile bytes cannot nest trailers and exhaust the decoder's stack.
    #[derive(Deserialize)]
    pub(super) enum Body {
        Identity(#[serde(with = "serde_bytes")] Vec<u8>),
        Lz4(u64, #[serde(with = "serde_bytes")] Vec<u8>),
        NotRetained(Option<u64>),
        WithTrailers(StoredBody, Fields),
    }

    /// A version-1 response in the current shape: trailers moved out of the body.
    pub(super) fn response((status, headers, body): Response) -> StoredResponse {
        let (body, trailers) = match body {
            Body::Identity(bytes) => (StoredBody::Identity(bytes), Vec::new()),
            Body::Lz4(len, data) => (StoredBody::Lz4 { len, data }, Vec::new()),
            Body::NotRetained(len) => (StoredBody::NotRetained { len }, Vec::new()),
            Body::WithTrailers(body, trailers) => (body, trailers),
        };
        StoredResponse { status, headers, body, trailers }
    }
}

/// Format version of a stored response kept apart from its record (a Redis hash field,
/// a Postgres or SQLite `response` column): the first byte, then postcard. Versions as
/// for records: 2 is written, 1 is still read.
pub const RESPONSE_FORMAT_VERSION: u8 = 2;

/// Encodes a stored response on its own: `[RESPONSE_FORMAT_VERSION] ++ postcard(response)`.
/// Headers, body and trailer bytes round-trip exactly.
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

/// Decodes bytes written by [`encode_response`], of this format version or version 1.
///
/// # Errors
/// [`CodecError`] for empty, unknown-version, malformed or trailing input.
pub fn decode_response(bytes: &[u8]) -> Result<StoredResponse, CodecError> {
    match bytes.split_first().ok_or(CodecError::Empty)? {
        (&RESPONSE_FORMAT_VERSION, rest) => exactly(rest),
        (1, rest) => exactly(rest).map(v1::response),
        (&version, _) => Err(CodecError::UnknownVersion(version)),
    }
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
    /// any other variant, or version 1, fails here and takes the general path.
    #[derive(serde::Deserialize)]
    struct Borrowed<'a> {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        #[serde(borrow)]
        body: IdentityOnly<'a>,
        trailers: Vec<(String, Vec<u8>)>,
    }
    #[derive(serde::Deserialize)]
    enum IdentityOnly<'a> {
        Identity(#[serde(borrow)] &'a [u8]),
    }
    let Some(bytes) = buf.get(range.clone()) else {
        return Err(CodecError::Empty);
    };
    if let Some((&RESPONSE_FORMAT_VERSION, rest)) = bytes.split_first()
        && let Ok((Borrowed { status, headers, body: IdentityOnly::Identity(body), trailers }, [])) =
            postcard::take_from_bytes::<Borrowed<'_>>(rest)
    {
        let start = body.as_ptr().addr() - buf.as_ptr().addr();
        let end = start + body.len();
        buf.truncate(end);
        buf.drain(..start);
        return Ok(StoredResponse { status, headers, body: crate::record::StoredBody::Identity(buf), trailers });
    }
    decode_response(&buf[range])
}

#[cfg(test)]
pub(crate) mod tests {
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
            StoredResponse {
                status: 200,
                headers: vec![],
                body: StoredBody::NotRetained { len: Some(9) },
                trailers: vec![],
            },
            StoredResponse::new(200, vec![], b"x".to_vec()).with_trailers(vec![("grpc-status".into(), b"0".to_vec())]),
        ];
        for r in responses {
            let mut buf = vec![7; 5];
            buf.extend(encode_response(&r));
            let end = buf.len();
            buf.extend([9; 3]);
            assert_eq!(decode_response_reusing(buf, 5..end).expect("decodes"), r);
        }
        let v1 = V1_GRPC.to_vec();
        assert_eq!(decode_response_reusing(v1, 0..V1_GRPC.len()).expect("version 1 decodes"), v1_grpc_decoded());
        let mut bad = encode_response(&StoredResponse::new(200, vec![], b"abc".to_vec()));
        bad.push(0);
        let n = bad.len();
        assert!(decode_response_reusing(bad, 0..n).is_err(), "trailing bytes");
        assert!(decode_response_reusing(vec![RESPONSE_FORMAT_VERSION], 0..1).is_err());
        assert!(decode_response_reusing(vec![], 0..1).is_err());
    }

    /// gRPC trailers as the version-1 encoder wrote them (inside the body): content-type
    /// header, Identity body, `grpc-status: 0`, empty `grpc-message`, `grpc-status: 0`.
    pub(crate) const V1_GRPC: &[u8] = &[
        0x01, 0xc8, 0x01, 0x01, 0x0c, b'c', b'o', b'n', b't', b'e', b'n', b't', b'-', b't', b'y', b'p', b'e', 0x10,
        b'a', b'p', b'p', b'l', b'i', b'c', b'a', b't', b'i', b'o', b'n', b'/', b'g', b'r', b'p', b'c', 0x03, 0x00,
        0x06, 0x00, 0x00, 0x00, 0x00, 0x01, 0x07, 0x03, 0x0b, b'g', b'r', b'p', b'c', b'-', b's', b't', b'a', b't',
        b'u', b's', 0x01, b'0', 0x0c, b'g', b'r', b'p', b'c', b'-', b'm', b'e', b's', b's', b'a', b'g', b'e', 0x00,
        0x0b, b'g', b'r', b'p', b'c', b'-', b's', b't', b'a', b't', b'u', b's', 0x01, b'0',
    ];

    /// What [`V1_GRPC`] decodes to.
    pub(crate) fn v1_grpc_decoded() -> StoredResponse {
        let status = ("grpc-status".to_owned(), b"0".to_vec());
        StoredResponse::new(200, vec![("content-type".into(), b"application/grpc".to_vec())], vec![0, 0, 0, 0, 1, 7])
            .with_trailers(vec![status.clone(), ("grpc-message".into(), vec![]), status])
    }
}
