//! The record and response codec through its public API: round trips, old formats, and
//! garbage refused with a typed error.

use idem_core::codec::{
    CodecError, FORMAT_VERSION, RESPONSE_FORMAT_VERSION, decode, decode_response, encode, encode_response,
};
use idem_core::{Record, StoredResponse};

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
    // 201, no headers, Identity(b"hi"), as every build before version 2 wrote it.
    let before = [1, 0xc9, 0x01, 0x00, 0x00, 0x02, b'h', b'i'];
    let old = decode_response(&before).expect("an old record decodes");
    assert_eq!(old, StoredResponse::new(201, vec![], b"hi".to_vec()));
    assert!(old.trailers.is_empty());
    let now = [RESPONSE_FORMAT_VERSION, 0xc9, 0x01, 0x00, 0x00, 0x02, b'h', b'i', 0x00];
    assert_eq!(encode_response(&old), now, "version 2: the same fields, then no trailers");

    let grpc = StoredResponse::new(200, vec![("content-type".into(), b"application/grpc".to_vec())], vec![0; 9])
        .with_trailers(vec![("grpc-status".into(), b"0".to_vec()), ("grpc-message".into(), vec![])]);
    let back = decode_response(&encode_response(&grpc)).expect("decodes");
    assert_eq!(back, grpc);
    assert_eq!(back.trailers[0], ("grpc-status".to_owned(), b"0".to_vec()));
    assert_eq!(back.body_bytes().expect("body").as_deref(), Some(&[0u8; 9][..]));
    let lz4 = StoredResponse::compressed_over(200, vec![], vec![7; 10_000], 16)
        .with_trailers(vec![("x-checksum".into(), b"abc".to_vec())]);
    assert_eq!(
        decode_response(&encode_response(&lz4)).expect("decodes").body_bytes().expect("body").map(|b| b.len()),
        Some(10_000)
    );
    // Hostile bytes that nest trailers a million deep are refused by the decoder at
    // the second level, never by a stack overflow: in version 1, where the body held
    // the trailers, and in version 2, where no body variant 3 exists.
    for version in [1, RESPONSE_FORMAT_VERSION] {
        let mut deep = vec![version, 0xc8, 0x01, 0x00];
        deep.extend(std::iter::repeat_n(3, 1_000_000));
        assert!(matches!(decode_response(&deep), Err(CodecError::Malformed(_))), "version {version}");
    }
    let nested = [1, 0xc8, 0x01, 0x00, 0x03, 0x03, 0x00, 0x00, 0x00, 0x00];
    assert!(matches!(decode_response(&nested), Err(CodecError::Malformed(_))));
}

/// gRPC trailers as the version-1 encoder wrote them (inside the body): content-type
/// header, Identity body, `grpc-status: 0`, empty `grpc-message`, `grpc-status: 0`.
const V1_GRPC: &[u8] = &[
    0x01, 0xc8, 0x01, 0x01, 0x0c, b'c', b'o', b'n', b't', b'e', b'n', b't', b'-', b't', b'y', b'p', b'e', 0x10, b'a',
    b'p', b'p', b'l', b'i', b'c', b'a', b't', b'i', b'o', b'n', b'/', b'g', b'r', b'p', b'c', 0x03, 0x00, 0x06, 0x00,
    0x00, 0x00, 0x00, 0x01, 0x07, 0x03, 0x0b, b'g', b'r', b'p', b'c', b'-', b's', b't', b'a', b't', b'u', b's', 0x01,
    b'0', 0x0c, b'g', b'r', b'p', b'c', b'-', b'm', b'e', b's', b's', b'a', b'g', b'e', 0x00, 0x0b, b'g', b'r', b'p',
    b'c', b'-', b's', b't', b'a', b't', b'u', b's', 0x01, b'0',
];

/// What [`V1_GRPC`] decodes to.
fn v1_grpc_decoded() -> StoredResponse {
    let status = ("grpc-status".to_owned(), b"0".to_vec());
    StoredResponse::new(200, vec![("content-type".into(), b"application/grpc".to_vec())], vec![0, 0, 0, 0, 1, 7])
        .with_trailers(vec![status.clone(), ("grpc-message".into(), vec![]), status])
}

/// A fresh claim of key `k` by principal `p` on `POST /w`.
fn claimed() -> Record {
    let scope = idem_core::Scope::new("p", idem_core::Endpoint::new("POST", "/w")).expect("scope");
    let key = idem_core::IdempotencyKey::parse(b"k").expect("key");
    let fingerprint = idem_core::Fingerprint::from_bytes([0; 32]);
    let req = idem_core::ClaimRequest::new(scope, key, fingerprint, Default::default(), Default::default());
    let (Some(claimed), _) = idem_core::transition::claim(None, &req, idem_core::UnixMillis(1)) else { unreachable!() };
    claimed
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect()
}

/// Trailers moved from the body to their own field in version 2; version-1 bytes of
/// every kind (pinned from the version-1 encoder) decode into that shape, and what
/// they decode to is written as version 2 and reads back the same.
#[test]
fn version_1_trailers_decode_into_the_trailers_field() {
    use idem_core::record::StoredBody;
    #[rustfmt::skip]
    const V1_LZ4: &[u8] = &[
        0x01, 0xc8, 0x01, 0x00, 0x03, 0x01, 0x40, 0x0c, 0x1f, 0x07, 0x01, 0x00, 0x26, 0x60, 0x07, 0x07, 0x07, 0x07,
        0x07, 0x07, 0x01, 0x0a, b'x', b'-', b'c', b'h', b'e', b'c', b'k', b's', b'u', b'm', 0x03, b'a', b'b', b'c',
    ];
    let lz4 = decode_response(V1_LZ4).expect("decodes");
    assert!(matches!(lz4.body, StoredBody::Lz4 { len: 64, .. }));
    assert_eq!(lz4.trailers, [("x-checksum".to_owned(), b"abc".to_vec())]);
    assert_eq!(lz4.body_bytes().expect("body").as_deref(), Some(&[7u8; 64][..]));
    let grpc = decode_response(V1_GRPC).expect("decodes");
    assert_eq!(grpc, v1_grpc_decoded());
    assert_eq!(decode_response(&encode_response(&grpc)).expect("decodes"), grpc);

    // A record completed by a gRPC stream whose body was not retained: id [1; 32],
    // scope ("p", "POST /w"), key "k", fingerprint [2; 32], token 3, times 10..13.
    let v1 = unhex(concat!(
        "01",
        "0101010101010101010101010101010101010101010101010101010101010101",
        "017007504f5354202f77016b",
        "0202020202020202020202020202020202020202020202020202020202020202",
        "0103",
        "01c80100",
        "030201ac02",
        "010b677270632d7374617475730135",
        "1416181a",
    ));
    let record = decode(&v1).expect("a version-1 record decodes");
    let response = record.response.as_ref().expect("completed");
    assert_eq!(
        (record.id, record.fingerprint),
        (idem_core::RecordId::from_bytes([1; 32]), idem_core::Fingerprint::from_bytes([2; 32]))
    );
    assert_eq!((record.token.0, record.expires_at.0, response.status), (3, 13, 200));
    assert_eq!(response.body, StoredBody::NotRetained { len: Some(300) });
    assert_eq!(response.trailers, [("grpc-status".to_owned(), b"5".to_vec())]);
    let v2 = encode(&record);
    assert_eq!(v2[0], FORMAT_VERSION);
    assert_eq!(decode(&v2).expect("decodes"), record);
    // The same record truncated or extended anywhere is refused with a typed error.
    for cut in 0..v1.len() {
        assert!(decode(&v1[..cut]).is_err(), "cut at {cut}");
    }
    assert!(matches!(decode(&[&v1[..], &[0]].concat()), Err(CodecError::Trailing(1))));
}

/// The trailers field is read as strictly as the rest: truncated anywhere, a count or
/// a length past the end, a name that is not UTF-8, or a byte left over is a typed
/// error, and none allocates what the input cannot hold.
#[test]
fn a_truncated_or_garbled_trailers_field_is_a_typed_error() {
    let r = StoredResponse::new(200, vec![], b"ok".to_vec())
        .with_trailers(vec![("grpc-status".into(), b"0".to_vec()), ("grpc-status".into(), b"1".to_vec())]);
    let bytes = encode_response(&r);
    // 200, no headers, Identity(b"ok"), then the trailers: two pairs, repeats kept.
    let head = [RESPONSE_FORMAT_VERSION, 0xc8, 0x01, 0x00, 0x00, 0x02, b'o', b'k'];
    assert_eq!(bytes[..head.len()], head);
    assert_eq!(bytes[head.len()], 2, "the trailer count");
    assert_eq!(decode_response(&bytes).expect("decodes"), r);
    for cut in head.len()..bytes.len() {
        assert!(matches!(decode_response(&bytes[..cut]), Err(CodecError::Malformed(_))), "cut at {cut}");
    }
    let with = |at: usize, new: &[u8]| [&bytes[..at], new, &bytes[at + 1..]].concat();
    let huge_count = with(head.len(), &[0xff, 0xff, 0xff, 0xff, 0x0f]);
    assert!(matches!(decode_response(&huge_count), Err(CodecError::Malformed(_))));
    let long_name = with(head.len() + 1, &[0xff, 0xff, 0xff, 0x7f]);
    assert!(matches!(decode_response(&long_name), Err(CodecError::Malformed(_))));
    let not_utf8 = with(head.len() + 2, &[0xff]);
    assert!(matches!(decode_response(&not_utf8), Err(CodecError::Malformed(_))));
    let bad_count = with(head.len(), &[0x80]);
    assert!(matches!(decode_response(&bad_count), Err(CodecError::Malformed(_))));
    assert!(matches!(decode_response(&[&bytes[..], &[0]].concat()), Err(CodecError::Trailing(1))));

    // The same in a whole record.
    let record = Record { response: Some(r), ..claimed() };
    let bytes = encode(&record);
    assert_eq!(decode(&bytes).expect("decodes"), record);
    for cut in 1..bytes.len() {
        assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
}
