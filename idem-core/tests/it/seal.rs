//! Sealed responses through the public API (`idem_core::seal::Sealing`): what a reader of
//! the store sees, what fails to open (moved, altered, relabelled, plain), key rotation,
//! and the bytes, checked against RustCrypto's XChaCha20-Poly1305 both ways with the
//! associated data built as `idem_core::seal`'s documentation lays it out.

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use idem_core::codec::{decode_response, encode_response};
use idem_core::seal::{NONCE_LEN, SEALED_HEADER, SEALED_STATUS, Sealing, SealingKeys};
use idem_core::{
    ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, Record, RecordId, Scope, StoredBody,
    StoredResponse, UnixMillis,
};

const A: RecordId = RecordId::from_bytes([1; 32]);
const B: RecordId = RecordId::from_bytes([2; 32]);

fn response() -> StoredResponse {
    StoredResponse::new(201, vec![("location".into(), b"/w/1".to_vec())], b"{\"token\":\"s3cret\"}".to_vec())
}

/// A record `id` claimed under `token` holding `response` as stored.
fn record(id: RecordId, token: u64, response: StoredResponse) -> Record {
    let scope = Scope::new("p", Endpoint::new("POST", "/w")).expect("scope");
    let req = ClaimRequest::new(
        scope,
        IdempotencyKey::parse(b"k").expect("key"),
        Fingerprint::from_bytes([0; 32]),
        Default::default(),
        Default::default(),
    );
    let (Some(claimed), _) = idem_core::transition::claim(None, &req, UnixMillis(1)) else { unreachable!() };
    Record { id, token: FencingToken(token), response: Some(response), ..claimed }
}

/// What `sealing` makes of `stored` on record `id` under `token`: the opened response,
/// or `None` when it does not open.
fn open(sealing: &Sealing, id: RecordId, token: u64, stored: StoredResponse) -> Option<StoredResponse> {
    match sealing.open(record(id, token, stored)) {
        Ok(record) => record.response,
        Err(e) => {
            assert!(e.is_corrupt(), "a response that does not open is Corrupt: {e}");
            None
        }
    }
}

fn sealing(keys: SealingKeys) -> Sealing {
    Sealing::new(keys)
}

#[test]
fn seals_round_trip_and_hide_the_plaintext() {
    let s = sealing(SealingKeys::new(1, [7; 32]));
    let sealed = s.seal(A, FencingToken(5), &response());
    assert_eq!(sealed.status, SEALED_STATUS);
    assert_eq!(sealed.header(SEALED_HEADER), Some(&b"v1;1"[..]));
    let bytes = encode_response(&sealed);
    assert!(!bytes.windows(6).any(|w| w == b"s3cret"), "plaintext in the sealed bytes");
    assert!(!bytes.windows(4).any(|w| w == b"/w/1"), "a header value in the sealed bytes");
    assert_eq!(open(&s, A, 5, decode_response(&bytes).expect("decodes")), Some(response()));
}

/// A sealed response moved to another record or to another claim of the same record
/// opened (and was replayed) when the associated data did not bind id and token.
#[test]
fn a_moved_or_altered_seal_does_not_open() {
    // Accepting plain responses too: what fails below is a broken seal, not a plain one.
    let s = sealing(SealingKeys::new(1, [7; 32])).accept_unsealed(true);
    let sealed = s.seal(A, FencingToken(5), &response());
    assert_eq!(open(&s, B, 5, sealed.clone()), None, "moved to another record");
    assert_eq!(open(&s, A, 6, sealed.clone()), None, "moved to another claim");
    let StoredBody::Identity(body) = &sealed.body else { unreachable!() };
    for at in [0, NONCE_LEN, body.len() - 1] {
        let mut flipped = sealed.clone();
        let StoredBody::Identity(b) = &mut flipped.body else { unreachable!() };
        b[at] ^= 1;
        assert_eq!(open(&s, A, 5, flipped), None, "byte {at}");
    }
    // A relabelled key id is authenticated too.
    let mut relabelled = sealed.clone();
    relabelled.headers[0].1 = b"v1;2".to_vec();
    let both = sealing(SealingKeys::new(1, [7; 32]).with_key(2, [7; 32])).accept_unsealed(true);
    assert_eq!(open(&both, A, 5, relabelled), None);
    let mut half = sealed;
    half.status = 200;
    assert_eq!(open(&s, A, 5, half), None, "a sealed body under a real status");
}

/// The sealed bytes are XChaCha20-Poly1305's as `chacha20poly1305` computes them, both
/// ways, with the associated data of the module's documentation: `idem-seal/v1`, the
/// record id, the token (big endian) and the key id (big endian).
#[test]
fn the_construction_is_xchacha20_poly1305() {
    let key = [0x42; 32];
    let s = sealing(SealingKeys::new(3, key));
    let reference = XChaCha20Poly1305::new(&key.into());
    let aad = |id: RecordId, token: u64, key_id: u32| {
        [&b"idem-seal/v1"[..], id.as_bytes(), &token.to_be_bytes(), &key_id.to_be_bytes()].concat()
    };
    for len in [0usize, 1, 63, 64, 65, 1024, 4099] {
        let r = StoredResponse::new(200, vec![("etag".into(), b"x".to_vec())], (0..len).map(|i| i as u8).collect());
        let sealed = s.seal(A, FencingToken(9), &r);
        let StoredBody::Identity(body) = &sealed.body else { unreachable!() };
        let (nonce, ct) = body.split_at(NONCE_LEN);
        let aad = aad(A, 9, 3);
        let plain = reference.decrypt(XNonce::from_slice(nonce), Payload { msg: ct, aad: &aad }).expect("opens");
        assert_eq!(plain, encode_response(&r), "len {len}");
        let again = reference.encrypt(XNonce::from_slice(nonce), Payload { msg: &plain, aad: &aad }).expect("seals");
        assert_eq!(again, ct, "len {len}");
    }
    // And the other way: a response sealed by the reference opens here.
    let nonce = [7u8; NONCE_LEN];
    let msg = encode_response(&response());
    let ct = reference.encrypt(XNonce::from_slice(&nonce), Payload { msg: &msg, aad: &aad(B, 2, 3) }).expect("seals");
    let sealed =
        StoredResponse::new(SEALED_STATUS, vec![(SEALED_HEADER.into(), b"v1;3".to_vec())], [&nonce[..], &ct].concat());
    assert_eq!(open(&s, B, 2, sealed), Some(response()));
}

/// Trailers are sealed with the rest of the response; trailers beside a seal were put
/// there by someone else, and are refused rather than replayed or dropped.
#[test]
fn trailers_are_sealed_and_trailers_outside_a_seal_are_refused() {
    let s = sealing(SealingKeys::new(1, [7; 32]));
    let grpc = response().with_trailers(vec![("grpc-status".into(), b"0".to_vec())]);
    let sealed = s.seal(A, FencingToken(5), &grpc);
    assert!(sealed.trailers.is_empty());
    assert!(!encode_response(&sealed).windows(11).any(|w| w == b"grpc-status"), "a trailer name in the seal");
    assert_eq!(open(&s, A, 5, sealed.clone()), Some(grpc));
    let added = sealed.with_trailers(vec![("grpc-status".into(), b"13".to_vec())]);
    assert_eq!(open(&s, A, 5, added), None);
}

#[test]
fn two_seals_of_one_response_differ() {
    let s = sealing(SealingKeys::new(1, [7; 32]));
    assert_ne!(s.seal(A, FencingToken(1), &response()), s.seal(A, FencingToken(1), &response()));
}

#[test]
fn the_highest_key_seals_every_configured_key_opens_a_removed_one_does_not() {
    let by_old = sealing(SealingKeys::new(1, [1; 32])).seal(A, FencingToken(1), &response());
    let rotated = sealing(SealingKeys::new(1, [1; 32]).with_key(2, [2; 32]));
    let by_new = rotated.seal(A, FencingToken(1), &response());
    assert_eq!(by_new.header(SEALED_HEADER), Some(&b"v1;2"[..]));
    assert_eq!(open(&rotated, A, 1, by_old.clone()), Some(response()));
    let removed = sealing(SealingKeys::new(2, [2; 32]));
    assert_eq!(open(&removed, A, 1, by_new), Some(response()));
    assert_eq!(open(&removed, A, 1, by_old), None);
}

/// A plain response under sealing was replayed, so a writer to the store could swap a
/// sealed response for one of its choosing; or a migration could not replay old ones.
#[test]
fn a_plain_response_is_refused_unless_accepted() {
    let s = sealing(SealingKeys::new(1, [7; 32]));
    let sealed = s.seal(A, FencingToken(5), &response());
    assert_eq!(open(&s, A, 5, sealed), Some(response()));
    assert_eq!(open(&s, A, 5, response()), None);
    assert_eq!(open(&s.accept_unsealed(true), A, 5, response()), Some(response()));
}

#[test]
fn debug_never_prints_key_bytes() {
    let keys = SealingKeys::new(3, [0xab; 32]);
    let shown = format!("{keys:?} {:?}", Sealing::new(keys.clone()));
    assert!(!shown.contains("171") && !shown.to_lowercase().contains("ab, "), "{shown}");
    assert!(shown.contains("ids: [3]"));
}
