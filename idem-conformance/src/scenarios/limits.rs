//! Keys and values at their limits: the longest key, every visible ASCII byte, non-ASCII
//! scope strings, every byte value in bodies and header values, empty and multi-MiB
//! bodies, many headers, compressed and not-retained bodies, trailers. Everything round-trips
//! byte-exact (`docs/contract.md#for-every-operation`).

use idem_core::{ClaimRequest, Endpoint, RecordState, Scope, StoredBody, StoredResponse};

use super::{LEASE, RETENTION, claim_req, claimed, completed, fp, get, key, must_claim};
use crate::Env;

/// Claims `key`, completes with `resp`, and checks get returns it byte-exact.
async fn round_trip(env: &Env, req: ClaimRequest, resp: StoredResponse) {
    let r = must_claim(env, req.clone()).await;
    assert_eq!((&r.scope, &r.key), (&req.scope().clone(), &req.key().clone()));
    let done = completed(env.store.as_ref(), &r, resp.clone()).await;
    assert_eq!(done.response.as_ref(), Some(&resp));
    let got = get(env.store.as_ref(), r.id).await.expect("record present");
    assert_eq!(got.state, RecordState::Completed);
    assert_eq!((&got.scope, &got.key), (&req.scope().clone(), &req.key().clone()));
    assert_eq!(got.response, Some(resp), "response differs after the round trip");
}

fn body_response(body: Vec<u8>) -> StoredResponse {
    StoredResponse::new(200, vec![("content-type".to_owned(), b"application/octet-stream".to_vec())], body)
}

/// A key of 255 bytes (the default maximum) is claimed and read back whole.
pub async fn key_of_255_bytes_round_trips(env: Env) {
    let k: String = (0..255).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
    round_trip(&env, claim_req(&env, "p", &k, b"body"), body_response(b"ok".to_vec())).await;
}

/// A key holding every visible ASCII byte (quotes, backslash, `%`, `*`, `:`) round-trips.
pub async fn key_with_every_visible_ascii_byte_round_trips(env: Env) {
    let k: String = (0x21u8..=0x7e).map(char::from).collect();
    let req = claim_req(&env, "p", &k, b"body");
    round_trip(&env, req, body_response(b"ok".to_vec())).await;
    let other = claim_req(&env, "p", "*", b"body");
    assert_eq!(get(env.store.as_ref(), other.id()).await, None, "a glob key matches nothing else");
}

/// Non-ASCII principal and endpoint bytes round-trip; NFC and NFD spellings are two scopes.
pub async fn non_ascii_principal_and_endpoint_round_trip(env: Env) {
    let nfc = Scope::new(env.principal("caf\u{e9}-注文-🙂"), Endpoint::new("POST", "/v1/注文/{id}/\u{e9}"))
        .expect("principal");
    let nfd = Scope::new(env.principal("cafe\u{301}-注文-🙂"), Endpoint::new("POST", "/v1/注文/{id}/e\u{301}"))
        .expect("principal");
    let a = ClaimRequest::new(nfc, key("K"), fp(b"b"), LEASE, RETENTION);
    let b = ClaimRequest::new(nfd, key("K"), fp(b"b"), LEASE, RETENTION);
    round_trip(&env, a.clone(), body_response(b"a".to_vec())).await;
    let rb = claimed(env.store.as_ref(), b.clone()).await;
    assert_ne!(rb.id, a.id(), "NFC and NFD are different principals");
    assert_eq!(get(env.store.as_ref(), b.id()).await.map(|r| r.scope), Some(b.scope().clone()));
}

/// A 2 KiB principal and a 2 KiB endpoint round-trip.
pub async fn long_principal_and_endpoint_round_trip(env: Env) {
    let scope = Scope::new(env.principal(&"p".repeat(2048)), Endpoint::new("POST", &format!("/{}", "e".repeat(2047))))
        .expect("principal");
    round_trip(&env, ClaimRequest::new(scope, key("K"), fp(b"b"), LEASE, RETENTION), body_response(vec![])).await;
}

/// A body holding each of the 256 byte values (and NUL runs) round-trips.
pub async fn body_with_every_byte_value_round_trips(env: Env) {
    let mut body: Vec<u8> = (0..=255u8).collect();
    body.extend((0..=255u8).rev());
    body.extend([0u8; 64]);
    round_trip(&env, claim_req(&env, "p", "k", b"body"), body_response(body)).await;
}

/// A UTF-8 body with non-ASCII text (CJK, emoji, combining marks) round-trips byte-exact.
pub async fn non_ascii_text_body_round_trips(env: Env) {
    let body =
        "{\"name\":\"注文-🙂\",\"nfc\":\"\u{e9}\",\"nfd\":\"e\u{301}\",\"rtl\":\"\u{5e9}\u{5dc}\u{5d5}\u{5dd}\"}";
    round_trip(&env, claim_req(&env, "p", "k", b"body"), body_response(body.as_bytes().to_vec())).await;
}

/// An empty body is stored as an empty body, not as "no body" or "not retained".
pub async fn empty_body_round_trips(env: Env) {
    round_trip(&env, claim_req(&env, "p", "k", b""), StoredResponse::new(204, vec![], vec![])).await;
    let got = get(env.store.as_ref(), claim_req(&env, "p", "k", b"").id()).await.expect("present");
    assert_eq!(got.response.expect("response").body, StoredBody::Identity(vec![]));
}

/// A 4 MiB body round-trips.
pub async fn multi_mib_body_round_trips(env: Env) {
    let body: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    round_trip(&env, claim_req(&env, "p", "k", b"body"), body_response(body)).await;
}

/// 200 headers round-trip in order.
pub async fn two_hundred_headers_round_trip(env: Env) {
    let headers = (0..200).map(|i| (format!("x-header-{i:03}"), format!("value {i}").into_bytes())).collect();
    round_trip(&env, claim_req(&env, "p", "k", b"body"), StoredResponse::new(200, headers, b"ok".to_vec())).await;
}

/// Header values with obs-text bytes (0x80-0xFF), tabs and an empty value round-trip.
pub async fn header_values_with_non_utf8_bytes_round_trip(env: Env) {
    let headers = vec![
        ("x-latin1".to_owned(), vec![b'c', b'a', b'f', 0xe9]),
        ("x-high".to_owned(), (0x80..=0xffu8).collect()),
        ("x-tab".to_owned(), b"a\tb".to_vec()),
        ("x-empty".to_owned(), vec![]),
    ];
    round_trip(&env, claim_req(&env, "p", "k", b"body"), StoredResponse::new(200, headers, b"ok".to_vec())).await;
}

/// An LZ4-compressed body stays compressed and decompresses to the original bytes.
pub async fn compressed_body_round_trips(env: Env) {
    let original = b"{\"items\":[".iter().chain(b"{\"a\":1},".repeat(4096).iter()).copied().collect::<Vec<u8>>();
    let resp = StoredResponse::compressed_over(200, vec![], original.clone(), 1024);
    assert!(matches!(resp.body, StoredBody::Lz4 { .. }), "the test body compresses");
    round_trip(&env, claim_req(&env, "p", "k", b"body"), resp).await;
    let got = get(env.store.as_ref(), claim_req(&env, "p", "k", b"body").id()).await.expect("present");
    let body = got.response.expect("response").body_bytes().expect("decompresses").expect("retained").into_owned();
    assert_eq!(body, original);
}

/// A not-retained body keeps its status, `Location` and original length (or its absence).
pub async fn not_retained_body_round_trips(env: Env) {
    let resp = StoredResponse {
        status: 201,
        headers: vec![("location".to_owned(), b"/images/9".to_vec())],
        body: StoredBody::NotRetained { len: Some(64 * 1024 * 1024) },
        trailers: vec![],
    };
    round_trip(&env, claim_req(&env, "p", "k1", b"body"), resp).await;
    let unknown =
        StoredResponse { status: 200, headers: vec![], body: StoredBody::NotRetained { len: None }, trailers: vec![] };
    round_trip(&env, claim_req(&env, "p", "k2", b"body"), unknown).await;
}

/// Trailers round-trip in order with repeats and raw bytes kept, after a kept body and
/// after a not-retained one (a gRPC stream's `grpc-status`).
pub async fn trailers_round_trip(env: Env) {
    let trailers = vec![
        ("grpc-status".to_owned(), b"0".to_vec()),
        ("grpc-message".to_owned(), vec![]),
        ("x-raw".to_owned(), vec![0, 0xff, b'\n']),
        ("grpc-status".to_owned(), b"0".to_vec()),
    ];
    let kept = body_response(b"ok".to_vec()).with_trailers(trailers.clone());
    round_trip(&env, claim_req(&env, "p", "k1", b"body"), kept).await;
    let body = StoredBody::NotRetained { len: Some(1 << 20) };
    let streamed = StoredResponse { status: 200, headers: vec![], body, trailers };
    round_trip(&env, claim_req(&env, "p", "k2", b"body"), streamed).await;
}

/// Principal and endpoint strings holding control characters (NUL, newline, tab, DEL) round-trip.
pub async fn control_characters_in_principal_and_endpoint_round_trip(env: Env) {
    let scope = Scope::new(env.principal("nul\u{0}-nl\n-tab\t-del\u{7f}-end"), Endpoint::new("POST", "/a\u{0}b\r\nc"))
        .expect("principal");
    let req = ClaimRequest::new(scope.clone(), key("K"), fp(b"b"), LEASE, RETENTION);
    round_trip(&env, req, body_response(b"ok".to_vec())).await;
    let plain = Scope::new(env.principal("nul-nl-tab-del-end"), Endpoint::new("POST", "/abc")).expect("principal");
    let other = ClaimRequest::new(plain, key("K"), fp(b"b"), LEASE, RETENTION);
    assert_eq!(get(env.store.as_ref(), other.id()).await, None, "control characters are not dropped");
}
