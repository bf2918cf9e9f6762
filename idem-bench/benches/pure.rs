//! Micro-benchmarks of the pure paths every request takes: key parse, fingerprint,
//! decision, record encode/decode.
//!
//! ```text
//! cargo bench -p idem-bench --bench pure
//! ```

use std::time::Duration;

use divan::{Bencher, black_box};
use idem_core::transition;
use idem_core::{
    ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Record, RequestParts, Scope, StoredResponse, UnixMillis,
    codec, decide,
};

fn main() {
    divan::main();
}

const NOW: UnixMillis = UnixMillis(1_800_000_000_000);

fn body(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

fn completed(body_len: usize) -> Record {
    let scope = Scope::new("token:ml-eval", Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(b"7c3f5d1e-91a4-4b1e-9f3a-2d4c5e6f7a8b").expect("key");
    let req = ClaimRequest::new(
        scope,
        key,
        Fingerprint::of_bytes(b"{}"),
        Duration::from_secs(300),
        Duration::from_secs(86_400),
    );
    let (Some(claimed), _) = transition::claim(None, &req, NOW) else { panic!("fresh claim") };
    let response = StoredResponse::new(
        201,
        vec![("content-type".into(), b"application/json".to_vec()), ("location".into(), b"/v1/workers/w-1".to_vec())],
        body(body_len),
    );
    transition::complete(Some(&claimed), claimed.id, claimed.token, response, NOW).expect("complete")
}

/// A 36-byte UUID key, as a bare token and as an RFC 8941 sf-string.
#[divan::bench(args = ["bare", "sf-string"])]
fn key_parse(form: &str) -> IdempotencyKey {
    let value: &[u8] = match form {
        "bare" => b"7c3f5d1e-91a4-4b1e-9f3a-2d4c5e6f7a8b",
        _ => b"\"7c3f5d1e-91a4-4b1e-9f3a-2d4c5e6f7a8b\"",
    };
    IdempotencyKey::parse(black_box(value)).expect("key")
}

#[divan::bench(args = [1024, 1024 * 1024])]
fn fingerprint(bencher: Bencher<'_, '_>, len: usize) {
    let body = body(len);
    let headers = [("content-type", &b"application/json"[..])];
    bencher.counter(divan::counter::BytesCount::new(len)).bench(|| {
        Fingerprint::of(black_box(&RequestParts {
            method: "POST",
            path: "/v1/workers",
            query: Some("zone=eu-west-4b"),
            headers: &headers,
            body: &body,
        }))
    });
}

#[divan::bench]
fn decide_replay(bencher: Bencher<'_, '_>) {
    let record = completed(256);
    let fp = record.fingerprint;
    bencher.bench(|| decide(black_box(Some(&record)), black_box(&fp), black_box(NOW)));
}

#[divan::bench]
fn decide_absent(bencher: Bencher<'_, '_>) {
    let fp = Fingerprint::of_bytes(b"{}");
    bencher.bench(|| decide(black_box(None), black_box(&fp), black_box(NOW)));
}

#[divan::bench(args = [256, 1024, 100 * 1024])]
fn record_encode(bencher: Bencher<'_, '_>, body_len: usize) {
    let record = completed(body_len);
    bencher.bench(|| codec::encode(black_box(&record)));
}

#[divan::bench(args = [256, 1024, 100 * 1024])]
fn record_decode(bencher: Bencher<'_, '_>, body_len: usize) {
    let bytes = codec::encode(&completed(body_len));
    bencher.bench(|| codec::decode(black_box(&bytes)).expect("decode"));
}
