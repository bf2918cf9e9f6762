//! The language-neutral test vectors in `docs/test-vectors.json` (explained in
//! `docs/test-vectors.md`): generated here from the real code and compared with the
//! checked-in file, so the file cannot drift from what idem computes. With
//! `IDEM_BLESS_VECTORS=1` the test rewrites the file instead.
//!
//! Each value is computed three ways that must agree: through the layer on a memory store
//! (what a request really gets: key parsing, route templates, the fingerprinted header
//! selection), through `idem-core`'s public functions, and by this file's own
//! re-implementation of `docs/test-vectors.md` (plain BLAKE3 and a hand-written postcard
//! encoder), which calls nothing of idem's. The last one keeps the document honest: it is
//! the algorithm as the document states it, so a code change the document does not follow
//! fails here even when the file is regenerated.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::routing::any;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::codec;
use idem_core::fingerprint::{FINGERPRINT_CONTEXT, canonical_json};
use idem_core::resume::SUBKEY_CONTEXT;
use idem_core::scope::RECORD_ID_CONTEXT;
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, FingerprintMode, IdempotencyKey, MemoryStore,
    Principal, Reconciled, Record, RecordId, RecordState, RequestParts, Resumable, Scope, StepError, Store, StoredBody,
    StoredResponse, SubKey, UnixMillis,
};
use idem_http::{BearerToken, IdempotencyContext, IdempotencyLayer};
use serde::Serialize;
use serde_json::Value;
use tower::ServiceExt;

/// The checked-in file.
const VECTORS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/test-vectors.json");

/// The environment variable that makes the test rewrite the file.
const BLESS: &str = "IDEM_BLESS_VECTORS";

/// Not exported by idem-http (it is an implementation detail of `BearerToken`); written out
/// here, and checked against `BearerToken::principal_for` below.
const BEARER_CONTEXT: &str = "idem-http 2026-11-30 bearer principal v1";

/// 2027-01-15T08:00:00Z, the `created_at` of the sub-key and record vectors.
const T0: i64 = 1_800_000_000_000;

#[tokio::test]
async fn the_checked_in_vectors_are_what_the_code_computes() {
    let generated = generate().await;
    let text = serde_json::to_string_pretty(&generated).expect("vectors serialise") + "\n";
    if std::env::var_os(BLESS).is_some_and(|v| v == "1") {
        std::fs::write(VECTORS, &text).expect("write docs/test-vectors.json");
        eprintln!("{BLESS}=1: rewrote {VECTORS}");
        return;
    }
    let stored = std::fs::read_to_string(VECTORS).expect("read docs/test-vectors.json");
    let want: Value = serde_json::from_str(&stored).expect("docs/test-vectors.json is JSON");
    let got = serde_json::to_value(&generated).expect("vectors serialise");
    let drift = differences(&want, &got);
    assert!(
        drift.is_empty(),
        "docs/test-vectors.json differs from what the code computes (file vs code):\n{}\n\
         If the change is intended (and stored records may change with it), regenerate with \
         {BLESS}=1 cargo test -p idem-http --test it test_vectors",
        drift.join("\n")
    );
    assert!(
        stored == text,
        "docs/test-vectors.json holds the right values but not in the generated layout; \
         regenerate with {BLESS}=1 cargo test -p idem-http --test it test_vectors"
    );
}

/// The comparison reports by vector: `kind/name: field: file X, code Y`.
#[test]
fn a_drifted_vector_is_named() {
    let want = serde_json::json!({"record_id": [{"name": "a", "record_id": "00"}, {"name": "b", "record_id": "11"}]});
    let got = serde_json::json!({"record_id": [{"name": "a", "record_id": "00"}, {"name": "b", "record_id": "12"}]});
    assert_eq!(differences(&want, &got), [r#"record_id/b: record_id: file "11", code "12""#]);
    let extra = serde_json::json!({"record_id": [{"name": "a", "record_id": "00"}]});
    assert_eq!(differences(&extra, &want), [r#"record_id/b: only in the code"#]);
}

/// Every difference between the file (`want`) and the code (`got`), one line each, named
/// by the vector's kind and name.
fn differences(want: &Value, got: &Value) -> Vec<String> {
    let (Value::Object(want), Value::Object(got)) = (want, got) else {
        return vec![format!("the file is not a JSON object: {want}")];
    };
    let mut out = Vec::new();
    let keys: std::collections::BTreeSet<&String> = want.keys().chain(got.keys()).collect();
    for key in keys {
        match (want.get(key), got.get(key)) {
            (Some(Value::Array(w)), Some(Value::Array(g))) => {
                let name = |v: &Value| v.get("name").and_then(Value::as_str).unwrap_or("?").to_owned();
                for g in g {
                    match w.iter().find(|w| name(w) == name(g)) {
                        None => out.push(format!("{key}/{}: only in the code", name(g))),
                        Some(w) => leaves(&format!("{key}/{}: ", name(g)), "", w, g, &mut out),
                    }
                }
                for w in w {
                    if !g.iter().any(|g| name(g) == name(w)) {
                        out.push(format!("{key}/{}: only in the file", name(w)));
                    }
                }
            }
            (w, g) if w != g => out.push(format!(
                "{key}: file {}, code {}",
                w.map_or("(absent)".into(), Value::to_string),
                g.map_or("(absent)".into(), Value::to_string)
            )),
            _ => {}
        }
    }
    out
}

/// The differing leaves of `want` and `got`, each as `{prefix}{path}: file X, code Y`, the
/// path in dots and indexes (`record.response.headers[1]`), so a nested change is named by
/// its own field rather than by the whole object around it.
fn leaves(prefix: &str, path: &str, want: &Value, got: &Value, out: &mut Vec<String>) {
    let join = |step: &str| if path.is_empty() { step.to_owned() } else { format!("{path}.{step}") };
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            let fields: std::collections::BTreeSet<&String> = w.keys().chain(g.keys()).collect();
            for f in fields {
                leaves(prefix, &join(f), w.get(f).unwrap_or(&Value::Null), g.get(f).unwrap_or(&Value::Null), out);
            }
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => {
            for (i, (w, g)) in w.iter().zip(g).enumerate() {
                leaves(prefix, &format!("{path}[{i}]"), w, g, out);
            }
        }
        (w, g) if w != g => out.push(format!("{prefix}{path}: file {w}, code {g}")),
        _ => {}
    }
}

// The file's shape. Field order here is the order in the file.

#[derive(Serialize)]
struct Vectors {
    about: &'static str,
    contexts: Contexts,
    record_format_version: u8,
    response_format_version: u8,
    bearer_principal: Vec<BearerVector>,
    record_id: Vec<RecordIdVector>,
    fingerprint: Vec<FingerprintVector>,
    sub_key: Vec<SubKeyVector>,
    journal: Vec<JournalVector>,
    record_encoding: Vec<RecordVector>,
}

#[derive(Serialize)]
struct Contexts {
    bearer_principal: &'static str,
    record_id: &'static str,
    fingerprint: &'static str,
    sub_key: &'static str,
}

#[derive(Serialize)]
struct BearerVector {
    name: &'static str,
    authorization: String,
    principal: String,
}

#[derive(Serialize)]
struct RecordIdVector {
    name: &'static str,
    note: &'static str,
    principal: String,
    method: &'static str,
    route: &'static str,
    endpoint: String,
    key_header: String,
    key: String,
    hashed_input_hex: String,
    record_id: String,
}

#[derive(Serialize)]
struct FingerprintVector {
    name: &'static str,
    note: &'static str,
    mode: &'static str,
    fingerprint_headers: Vec<&'static str>,
    method: &'static str,
    path: &'static str,
    query: Option<&'static str>,
    headers: Vec<[&'static str; 2]>,
    body_hex: String,
    body_text: Option<String>,
    canonical_body: Option<String>,
    fields: Vec<[String; 2]>,
    hashed_input_hex: String,
    fingerprint: String,
}

#[derive(Serialize)]
struct SubKeyVector {
    name: &'static str,
    note: &'static str,
    record_id: String,
    created_at: i64,
    step: String,
    hashed_input_hex: String,
    sub_key: String,
}

#[derive(Serialize)]
struct JournalVector {
    name: &'static str,
    note: &'static str,
    entry: String,
    value_hex: String,
}

#[derive(Serialize)]
struct RecordVector {
    name: &'static str,
    note: &'static str,
    record: RecordJson,
    encoded_hex: String,
    response_hex: Option<String>,
}

#[derive(Serialize)]
struct RecordJson {
    id: String,
    principal: String,
    endpoint: String,
    key: String,
    fingerprint: String,
    state: &'static str,
    /// Decimal text: a token is the claim time shifted left 16 bits, past 2^53, where a
    /// JSON reader that parses numbers as doubles would round it.
    token: String,
    response: Option<ResponseJson>,
    created_at: i64,
    started_at: i64,
    lease_expires_at: i64,
    expires_at: i64,
}

#[derive(Serialize)]
struct ResponseJson {
    status: u16,
    headers: Vec<[String; 2]>,
    body: BodyJson,
    trailers: Vec<[String; 2]>,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum BodyJson {
    Identity { hex: String },
    Lz4 { len: u64, data_hex: String, decoded_hex: String },
    NotRetained { len: Option<u64> },
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn generate() -> Vectors {
    let record_ids = record_id_vectors().await;
    let first_id = RecordId::from_hex(&record_ids[0].record_id).expect("hex");
    let fingerprints = fingerprint_vectors().await;
    let first_fingerprint = Fingerprint::from_bytes(unhex32(&fingerprints[0].fingerprint));
    Vectors {
        about: "idem's contract as test vectors: docs/test-vectors.md explains every field. \
                Generated by idem-http/tests/it/test_vectors.rs; regenerate with \
                IDEM_BLESS_VECTORS=1 cargo test -p idem-http --test it test_vectors",
        contexts: Contexts {
            bearer_principal: BEARER_CONTEXT,
            record_id: RECORD_ID_CONTEXT,
            fingerprint: FINGERPRINT_CONTEXT,
            sub_key: SUBKEY_CONTEXT,
        },
        record_format_version: codec::FORMAT_VERSION,
        response_format_version: codec::RESPONSE_FORMAT_VERSION,
        bearer_principal: bearer_vectors(),
        record_id: record_ids,
        fingerprint: fingerprints,
        sub_key: sub_key_vectors(first_id),
        journal: journal_vectors().await,
        record_encoding: record_vectors(first_id, first_fingerprint),
    }
}

fn unhex32(s: &str) -> [u8; 32] {
    RecordId::from_hex(s).map(|id| *id.as_bytes()).expect("64 hex digits")
}

// Bearer principals.

fn bearer_vectors() -> Vec<BearerVector> {
    [("plain-token", "Bearer sk_test_4eC39HqLyjWDarjtT1zdp7dc"), ("scheme-any-case", "bEaReR tok-1")]
        .into_iter()
        .map(|(name, authorization)| {
            let token = authorization.split_once(' ').expect("scheme and token").1;
            let principal = BearerToken::principal_for(token.as_bytes());
            // The document: "bearer:" and the hex of BLAKE3 derive_key over the token bytes.
            assert_eq!(principal, format!("bearer:{}", hex(&blake3::derive_key(BEARER_CONTEXT, token.as_bytes()))));
            let parts = Request::post("/").header("authorization", authorization).body(()).expect("request");
            let resolved = idem_http::PrincipalResolver::resolve(&BearerToken, &parts.into_parts().0);
            assert_eq!(resolved.as_deref(), Some(principal.as_str()), "{name}: the resolver reads the header");
            BearerVector { name, authorization: authorization.to_owned(), principal }
        })
        .collect()
}

// Record ids.

/// A visible-ASCII key of exactly 255 bytes (the default maximum), cycling from `#` to `~`
/// (`\` included; `"` left out, which a bare key may hold anywhere but first).
fn longest_key() -> String {
    (0..255u8).map(|i| char::from(0x23 + (i % 92))).collect()
}

/// The documented hash input of a record id: each part as a little-endian u64 length and
/// its bytes.
fn doc_record_id_input(principal: &str, endpoint: &str, key: &str) -> Vec<u8> {
    let mut input = Vec::new();
    for part in [principal, endpoint, key] {
        input.extend_from_slice(&(part.len() as u64).to_le_bytes());
        input.extend_from_slice(part.as_bytes());
    }
    input
}

async fn record_id_vectors() -> Vec<RecordIdVector> {
    let bearer = BearerToken::principal_for(b"sk_test_4eC39HqLyjWDarjtT1zdp7dc");
    let cases: Vec<(&'static str, &'static str, String, &'static str, &'static str, String)> = vec![
        (
            "bare-key",
            "a bare token, as Stripe sends it",
            "tenant-a".into(),
            "POST",
            "/v1/workers",
            "7c3f5d1e-91a4".into(),
        ),
        (
            "quoted-key",
            "the RFC 8941 sf-string form of bare-key: the same key, so the same record id",
            "tenant-a".into(),
            "POST",
            "/v1/workers",
            "\"7c3f5d1e-91a4\"".into(),
        ),
        (
            "quoted-key-with-escapes",
            "an sf-string with the two escapes RFC 8941 allows; the key is a\"b\\c",
            "tenant-a".into(),
            "POST",
            "/v1/workers",
            r#""a\"b\\c""#.into(),
        ),
        (
            "surrounding-whitespace",
            "optional whitespace around the field value is not part of the key",
            "tenant-a".into(),
            "POST",
            "/v1/workers",
            " \t7c3f5d1e-91a4 ".into(),
        ),
        (
            "max-length-key",
            "a 255-byte key, the default maximum",
            "tenant-a".into(),
            "POST",
            "/v1/workers",
            longest_key(),
        ),
        (
            "route-template-and-bearer-principal",
            "a BearerToken principal and a route template as the endpoint",
            bearer,
            "POST",
            "/v1/workers/{id}/reboot",
            "reboot-2027-01-15".into(),
        ),
        (
            "long-principal",
            "a 2,000-byte principal: longer than any buffer the hasher fills",
            "p".repeat(2000),
            "POST",
            "/v1/workers",
            "k-1".into(),
        ),
        (
            "non-ascii-principal",
            "a principal is any non-blank UTF-8 string; its UTF-8 bytes are hashed",
            "org:Zoë/Ωmega team".into(),
            "DELETE",
            "/v1/volumes/{volume}",
            "K".into(),
        ),
    ];
    let store = Arc::new(MemoryStore::new());
    let mut out = Vec::new();
    for (name, note, principal, method, route, key_header) in cases {
        let key = IdempotencyKey::parse(key_header.as_bytes()).expect("a valid key");
        let endpoint = Endpoint::new(method, route);
        let scope = Scope::new(principal.clone(), endpoint.clone()).expect("scope");
        let id = scope.record_id(&key);
        assert_eq!(id, RecordId::derive(&principal, endpoint.as_str(), key.as_str()));
        let input = doc_record_id_input(&principal, endpoint.as_str(), key.as_str());
        assert_eq!(
            id.as_bytes(),
            blake3::Hasher::new_derive_key(RECORD_ID_CONTEXT).update(&input).finalize().as_bytes(),
            "{name}: the record id is not what docs/test-vectors.md describes"
        );
        // Through the layer: the header as sent, the principal from a resolver, the
        // endpoint from axum's matched route; the record lands at exactly this id.
        let sub_key = send_through_layer(&store, &principal, method, route, &key_header).await;
        let record = store.get(id).await.expect("get").unwrap_or_else(|| panic!("{name}: no record at {id}"));
        assert_eq!((record.scope.principal.as_str(), record.key.as_str()), (principal.as_str(), key.as_str()));
        assert_eq!(
            sub_key,
            SubKey::derive(id, record.created_at, "allocate").as_str(),
            "{name}: the handler's sub-key"
        );
        out.push(RecordIdVector {
            name,
            note,
            principal,
            method,
            route,
            endpoint: endpoint.as_str().to_owned(),
            key_header,
            key: key.as_str().to_owned(),
            hashed_input_hex: hex(&input),
            record_id: id.to_hex(),
        });
    }
    assert_eq!(out[0].record_id, out[1].record_id, "a quoted key and its bare form name one record");
    assert_eq!(out[0].record_id, out[3].record_id, "whitespace around the key is not part of it");
    out
}

/// Sends one keyed request for `route` (its parameters filled in) through a layer on
/// `store` whose principal is `principal`; returns the sub-key `allocate` the handler saw.
async fn send_through_layer(store: &Arc<MemoryStore>, principal: &str, method: &str, route: &str, key: &str) -> String {
    let principal = principal.to_owned();
    let layer = IdempotencyLayer::new(store.clone())
        .with_principal_resolver(move |_: &http::request::Parts| Some(principal.clone()));
    let app = Router::new()
        .route(
            route,
            any(|axum::Extension(ctx): axum::Extension<IdempotencyContext>| async move {
                (StatusCode::CREATED, ctx.subkey("allocate").as_str().to_owned())
            }),
        )
        .route_layer(layer);
    let path = route.replace("{id}", "7").replace("{volume}", "vol-9");
    let req = Request::builder().method(method).uri(path).header("idempotency-key", key).body(Body::empty());
    let response = app.oneshot(req.expect("request")).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED, "{method} {route} with key {key:?}");
    let body = response.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8(body.to_vec()).expect("utf-8")
}

// Fingerprints.

struct FingerprintCase {
    name: &'static str,
    note: &'static str,
    canonical: bool,
    fingerprint_headers: Vec<&'static str>,
    method: &'static str,
    path: &'static str,
    query: Option<&'static str>,
    headers: Vec<[&'static str; 2]>,
    body: Vec<u8>,
    /// The RFC 8785 form, written by hand, for a body canonical mode hashes under `J`.
    canonical_body: Option<&'static str>,
}

fn fingerprint_cases() -> Vec<FingerprintCase> {
    let json = [["content-type", "application/json"]];
    let reordered = "{\"b\": [3, 1],\n \"a\": {\"z\": 1.0, \"y\": \"\\u00e9\", \"x\": 1e3}}";
    let base = |name, note| FingerprintCase {
        name,
        note,
        canonical: false,
        fingerprint_headers: vec!["content-type"],
        method: "POST",
        path: "/v1/workers",
        query: None,
        headers: json.to_vec(),
        body: br#"{"gpus":8}"#.to_vec(),
        canonical_body: None,
    };
    vec![
        base("default", "the default configuration: content-type fingerprinted, raw body"),
        FingerprintCase {
            query: Some(""),
            headers: vec![],
            body: vec![],
            method: "PUT",
            ..base("empty-body-empty-query", "an empty body, no configured header present, and `/v1/workers?`")
        },
        FingerprintCase {
            fingerprint_headers: vec!["content-type", "x-tenant", "x-region"],
            query: Some("dry_run=true&zone=eu-1"),
            headers: vec![
                ["X-Tenant", "blue"],
                ["Content-Type", "application/json"],
                ["X-Ignored", "not configured"],
                ["X-Tenant", "green"],
                ["X-Region", ""],
            ],
            ..base(
                "configured-headers",
                "configured order, then arrival order; every value of a repeated header; a present empty value counts",
            )
        },
        FingerprintCase { body: reordered.as_bytes().to_vec(), ..base("json-raw", "raw mode: the body bytes as sent") },
        FingerprintCase {
            canonical: true,
            body: reordered.as_bytes().to_vec(),
            canonical_body: Some("{\"a\":{\"x\":1000,\"y\":\"\u{e9}\",\"z\":1},\"b\":[3,1]}"),
            ..base("json-canonical", "canonical mode: the same body as json-raw hashed as its RFC 8785 form")
        },
        FingerprintCase {
            canonical: true,
            body: br#"{"id":9007199254740993}"#.to_vec(),
            ..base("canonical-big-integer-falls-back", "canonical mode: an integer beyond 2^53 keeps the raw bytes")
        },
        FingerprintCase {
            canonical: true,
            body: br#"{"id":18446744073709551616}"#.to_vec(),
            ..base(
                "canonical-beyond-64-bits-falls-back",
                "canonical mode: an integer past the 64-bit range (read as a double) keeps the raw bytes",
            )
        },
        FingerprintCase {
            canonical: true,
            headers: vec![],
            body: vec![],
            ..base("canonical-empty-body-falls-back", "canonical mode: an empty body keeps the raw (empty) bytes")
        },
        FingerprintCase {
            method: "PATCH",
            path: "/v1/blobs/b-1",
            headers: vec![["content-type", "application/octet-stream"]],
            body: vec![0x00, 0xff, 0x80, b'\n', 0x7f],
            ..base("binary-body", "a body that is not UTF-8")
        },
        FingerprintCase {
            headers: vec![],
            body: vec![b'x'; 5000],
            ..base("long-body", "a 5,000-byte body: longer than any buffer the hasher fills")
        },
    ]
}

/// The documented fields of a fingerprint, `(tag, bytes)` in order.
fn doc_fingerprint_fields(case: &FingerprintCase) -> Vec<(u8, Vec<u8>)> {
    let mut fields = vec![(b'M', case.method.as_bytes().to_vec()), (b'P', case.path.as_bytes().to_vec())];
    fields.push(match case.query {
        Some(q) => (b'Q', q.as_bytes().to_vec()),
        None => (b'q', Vec::new()),
    });
    for configured in &case.fingerprint_headers {
        for [name, value] in &case.headers {
            if name.eq_ignore_ascii_case(configured) {
                fields.push((b'H', configured.to_ascii_lowercase().into_bytes()));
                fields.push((b'V', value.as_bytes().to_vec()));
            }
        }
    }
    fields.push(match case.canonical_body {
        Some(canonical) => (b'J', canonical.as_bytes().to_vec()),
        None => (b'B', case.body.clone()),
    });
    fields
}

async fn fingerprint_vectors() -> Vec<FingerprintVector> {
    let mut out = Vec::new();
    for case in fingerprint_cases() {
        let mode = if case.canonical { FingerprintMode::CanonicalJson } else { FingerprintMode::Raw };
        let canonical = if case.canonical { canonical_json(&case.body) } else { None };
        assert_eq!(
            canonical.as_deref(),
            case.canonical_body.map(str::as_bytes),
            "{}: the canonical form is not the hand-written RFC 8785 form",
            case.name
        );
        let fields = doc_fingerprint_fields(&case);
        let mut input = Vec::new();
        for (tag, bytes) in &fields {
            input.push(*tag);
            input.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            input.extend_from_slice(bytes);
        }
        let documented = *blake3::Hasher::new_derive_key(FINGERPRINT_CONTEXT).update(&input).finalize().as_bytes();
        // The `H` fields and the `V` after each: what the layer hands idem-core.
        let selected: Vec<(&str, &[u8])> = fields
            .windows(2)
            .filter(|pair| pair[0].0 == b'H')
            .map(|pair| (std::str::from_utf8(&pair[0].1).expect("ascii"), pair[1].1.as_slice()))
            .collect();
        let parts = RequestParts {
            method: case.method,
            path: case.path,
            query: case.query,
            headers: &selected,
            body: &case.body,
        };
        let core = Fingerprint::of_mode(&parts, mode);
        let layer = fingerprint_through_layer(&case, mode).await;
        assert_eq!(layer, core, "{}: the layer's fingerprint is not idem-core's of the same parts", case.name);
        assert_eq!(*core.as_bytes(), documented, "{}: not what docs/test-vectors.md describes", case.name);
        out.push(FingerprintVector {
            name: case.name,
            note: case.note,
            mode: if case.canonical { "canonical-json" } else { "raw" },
            fingerprint_headers: case.fingerprint_headers.clone(),
            method: case.method,
            path: case.path,
            query: case.query,
            headers: case.headers.clone(),
            body_hex: hex(&case.body),
            body_text: String::from_utf8(case.body.clone()).ok(),
            canonical_body: case.canonical_body.map(str::to_owned),
            fields: fields.iter().map(|(tag, bytes)| [char::from(*tag).to_string(), hex(bytes)]).collect(),
            hashed_input_hex: hex(&input),
            fingerprint: hex(layer.as_bytes()),
        });
    }
    let by_name = |n: &str| out.iter().find(|v| v.name == n).map(|v| v.fingerprint.clone());
    assert_ne!(by_name("json-raw"), by_name("json-canonical"), "the two modes hash one body differently");
    out
}

/// The fingerprint the layer stores for `case`'s request.
async fn fingerprint_through_layer(case: &FingerprintCase, mode: FingerprintMode) -> Fingerprint {
    const PRINCIPAL: &str = "tenant-a";
    let store = Arc::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .with_principal_resolver(|_: &http::request::Parts| Some(PRINCIPAL.to_owned()))
        .with_fingerprint_headers(case.fingerprint_headers.iter().copied())
        .with_fingerprint_mode(mode);
    let app = Router::new().route(case.path, any(|| async { StatusCode::CREATED })).route_layer(layer);
    let uri = match case.query {
        Some(q) => format!("{}?{q}", case.path),
        None => case.path.to_owned(),
    };
    let mut req = Request::builder().method(case.method).uri(uri).header("idempotency-key", "fp");
    for [name, value] in &case.headers {
        req = req.header(*name, *value);
    }
    let response = app.oneshot(req.body(Body::from(case.body.clone())).expect("request")).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED, "{}", case.name);
    let scope = Scope::new(PRINCIPAL, Endpoint::new(case.method, case.path)).expect("scope");
    let id = scope.record_id(&IdempotencyKey::parse(b"fp").expect("key"));
    store.get(id).await.expect("get").expect("the request's record").fingerprint
}

// Sub-keys.

fn sub_key_vectors(id: RecordId) -> Vec<SubKeyVector> {
    let other = RecordId::derive("tenant-b", "POST /v1/workers", "7c3f5d1e-91a4");
    let cases: [(&'static str, &'static str, RecordId, i64, String); 6] = [
        ("step", "the record of record_id/bare-key, created at T0", id, T0, "allocate".into()),
        ("other-step", "another step of the same record", id, T0, "boot-vm".into()),
        ("next-generation", "the same key reused after retention: a new created_at", id, T0 + 1, "allocate".into()),
        ("other-principal", "the same key and step under another principal", other, T0, "allocate".into()),
        ("non-ascii-step", "a step name's UTF-8 bytes are hashed", id, T0, "réserver l'adresse".into()),
        ("longest-step", "a 250-byte step name, the most a step allows", id, T0, "s".repeat(250)),
    ];
    let out: Vec<SubKeyVector> = cases
        .into_iter()
        .map(|(name, note, record, created_at, step)| {
            let sub_key = SubKey::derive(record, UnixMillis(created_at), &step);
            let mut input = record.as_bytes().to_vec();
            input.extend_from_slice(&created_at.to_le_bytes());
            input.extend_from_slice(&(step.len() as u64).to_le_bytes());
            input.extend_from_slice(step.as_bytes());
            let digest = blake3::Hasher::new_derive_key(SUBKEY_CONTEXT).update(&input).finalize();
            let documented = format!("idem-{}", hex(&digest.as_bytes()[..24]));
            assert_eq!(sub_key.as_str(), documented, "{name}: not what docs/test-vectors.md describes");
            SubKeyVector {
                name,
                note,
                record_id: record.to_hex(),
                created_at,
                step,
                hashed_input_hex: hex(&input),
                sub_key: sub_key.as_str().to_owned(),
            }
        })
        .collect();
    assert_ne!(out[0].sub_key, out[2].sub_key, "a new generation gets new sub-keys");
    out
}

// Journal entries.

/// The entries a step and an intent leave in a record's journal, read back from the store.
async fn journal_vectors() -> Vec<JournalVector> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let scope = Scope::new("tenant-a", Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(b"7c3f5d1e-91a4").expect("key");
    let request = ClaimRequest::new(
        scope,
        key,
        Fingerprint::from_bytes([0; 32]),
        std::time::Duration::from_secs(300),
        std::time::Duration::from_secs(86_400),
    );
    let ClaimOutcome::Claimed(record) = store.claim(request).await.expect("claim") else { panic!("a fresh claim") };
    let run = Resumable::new(store.clone(), record.id, record.token, record.created_at);
    let entry = |name: &'static str| {
        let store = store.clone();
        async move { store.journal_get(record.id, name).await.expect("journal_get").expect("an entry") }
    };
    let mut out = Vec::new();
    // `documented` is the value as docs/test-vectors.md spells it (the encoders below).
    let mut push = |name, note, entry: &str, value: Vec<u8>, documented: Vec<u8>| {
        assert_eq!(value, documented, "{name}: not what docs/test-vectors.md describes");
        out.push(JournalVector { name, note, entry: entry.to_owned(), value_hex: hex(&value) });
    };
    let doc = |write: &dyn Fn(&mut Vec<u8>)| {
        let mut out = Vec::new();
        write(&mut out);
        out
    };

    let node: Result<String, StepError<Infallible>> = run.step("allocate", |_| async { Ok("node-7".to_owned()) }).await;
    assert_eq!(node.expect("step"), "node-7");
    push(
        "step-string",
        "a step whose value is the string node-7",
        "s:allocate",
        entry("s:allocate").await,
        doc(&|o| bytes(o, b"node-7")),
    );
    let gpus: Result<u64, StepError<Infallible>> = run.step("count", |_| async { Ok(300) }).await;
    assert_eq!(gpus.expect("step"), 300);
    push(
        "step-integer",
        "a step whose value is the unsigned integer 300",
        "s:count",
        entry("s:count").await,
        doc(&|o| varint(o, 300)),
    );

    // An issue that fails leaves the intent pending; the next attempt reconciles, finds
    // nothing, issues again and journals the id.
    let failed =
        run.intent("boot", |_| async { Err::<String, _>("timeout") }, |_| async { Ok(Reconciled::NotFound) }).await;
    assert!(matches!(failed, Err(StepError::Failed { .. })));
    push("intent-pending", "an intent whose call may have happened", "i:boot", entry("i:boot").await, vec![0]);
    let id = run
        .intent("boot", |_| async { Ok::<_, &str>("i-0abc".to_owned()) }, |_| async { Ok(Reconciled::NotFound) })
        .await;
    assert_eq!(id.expect("intent"), "i-0abc");
    let done = doc(&|o| {
        o.push(1);
        bytes(o, b"i-0abc");
    });
    push("intent-done", "an intent done, its call's id i-0abc", "i:boot", entry("i:boot").await, done);
    out
}

// Record encoding.

fn record_vectors(id: RecordId, fingerprint: Fingerprint) -> Vec<RecordVector> {
    let scope = Scope {
        principal: Principal::new("tenant-a").expect("principal"),
        endpoint: Endpoint::new("POST", "/v1/workers"),
    };
    let first = FencingToken::first_at(UnixMillis(T0));
    let claimed = Record {
        id,
        scope: scope.clone(),
        key: IdempotencyKey::parse(b"7c3f5d1e-91a4").expect("key"),
        fingerprint,
        state: RecordState::InFlight,
        token: first,
        response: None,
        created_at: UnixMillis(T0),
        started_at: UnixMillis(T0),
        lease_expires_at: UnixMillis(T0 + 300_000),
        expires_at: UnixMillis(T0 + 86_400_000),
    };
    let headers = vec![
        ("content-type".to_owned(), b"application/json".to_vec()),
        ("location".to_owned(), b"/v1/workers/7".to_vec()),
        ("x-raw".to_owned(), vec![0x00, 0xff]),
    ];
    let completed = Record {
        state: RecordState::Completed,
        response: Some(StoredResponse::new(201, headers, br#"{"id":7,"state":"booting"}"#.to_vec())),
        ..claimed.clone()
    };
    let compressed = StoredResponse::compressed_over(200, vec![], b"gpu-node ".repeat(40), 256)
        .with_trailers(vec![("grpc-status".to_owned(), b"0".to_vec())]);
    assert!(matches!(compressed.body, StoredBody::Lz4 { .. }), "the body compresses");
    let completed_lz4 = Record { state: RecordState::Completed, response: Some(compressed), ..claimed.clone() };
    let not_retained = StoredResponse {
        status: 200,
        headers: vec![("content-type".to_owned(), b"application/grpc".to_vec())],
        body: StoredBody::NotRetained { len: Some(1_048_577) },
        trailers: vec![("grpc-status".to_owned(), b"0".to_vec()), ("grpc-message".to_owned(), vec![])],
    };
    let completed_not_retained =
        Record { state: RecordState::Completed, response: Some(not_retained), ..claimed.clone() };
    let failed = Record {
        state: RecordState::Failed,
        token: first.next(),
        started_at: UnixMillis(T0 + 400_000),
        lease_expires_at: UnixMillis(T0 + 700_000),
        ..claimed.clone()
    };
    [
        ("in-flight", "a fresh claim: no response", claimed),
        ("completed", "a stored 201 with headers (one value not UTF-8) and a body", completed),
        ("completed-lz4-with-trailer", "a body over the compression threshold, and a trailer", completed_lz4),
        ("completed-not-retained", "a body too large to keep, and gRPC trailers", completed_not_retained),
        ("failed", "failed after one reclaim: the token is one more", failed),
    ]
    .into_iter()
    .map(|(name, note, record)| {
        let encoded = codec::encode(&record);
        assert_eq!(codec::decode(&encoded).expect("decodes"), record, "{name}: round trip");
        assert_eq!(encoded, doc_encode_record(&record), "{name}: not what docs/test-vectors.md describes");
        let response_hex = record.response.as_ref().map(|response| {
            let bytes = codec::encode_response(response);
            let mut documented = vec![codec::RESPONSE_FORMAT_VERSION];
            doc_response(&mut documented, response);
            assert_eq!(bytes, documented, "{name}: the response is not what docs/test-vectors.md describes");
            hex(&bytes)
        });
        RecordVector { name, note, record: record_json(&record), encoded_hex: hex(&encoded), response_hex }
    })
    .collect()
}

fn record_json(record: &Record) -> RecordJson {
    let fields = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, v)| [n.clone(), hex(v)]).collect();
    RecordJson {
        id: record.id.to_hex(),
        principal: record.scope.principal.as_str().to_owned(),
        endpoint: record.scope.endpoint.as_str().to_owned(),
        key: record.key.as_str().to_owned(),
        fingerprint: hex(record.fingerprint.as_bytes()),
        state: record.state.as_str(),
        token: record.token.0.to_string(),
        response: record.response.as_ref().map(|r| ResponseJson {
            status: r.status,
            headers: fields(&r.headers),
            body: match &r.body {
                StoredBody::Identity(bytes) => BodyJson::Identity { hex: hex(bytes) },
                StoredBody::Lz4 { len, data } => BodyJson::Lz4 {
                    len: *len,
                    data_hex: hex(data),
                    decoded_hex: hex(&r.body_bytes().expect("decompresses").expect("kept")),
                },
                StoredBody::NotRetained { len } => BodyJson::NotRetained { len: *len },
            },
            trailers: fields(&r.trailers),
        }),
        created_at: record.created_at.0,
        started_at: record.started_at.0,
        lease_expires_at: record.lease_expires_at.0,
        expires_at: record.expires_at.0,
    }
}

// The record encoding as docs/test-vectors.md states it, written without postcard.

/// Unsigned LEB128: seven bits a byte, least significant group first, high bit set on
/// every byte but the last.
fn varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// A signed integer: zigzag (0, -1, 1, -2, ... to 0, 1, 2, 3, ...), then [`varint`].
fn zigzag(out: &mut Vec<u8>, n: i64) {
    varint(out, ((n << 1) ^ (n >> 63)) as u64);
}

/// A string or byte string: its length as a varint, then the bytes.
fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn doc_fields(out: &mut Vec<u8>, fields: &[(String, Vec<u8>)]) {
    varint(out, fields.len() as u64);
    for (name, value) in fields {
        bytes(out, name.as_bytes());
        bytes(out, value);
    }
}

fn doc_response(out: &mut Vec<u8>, r: &StoredResponse) {
    varint(out, u64::from(r.status));
    doc_fields(out, &r.headers);
    match &r.body {
        StoredBody::Identity(b) => {
            out.push(0);
            bytes(out, b);
        }
        StoredBody::Lz4 { len, data } => {
            out.push(1);
            varint(out, *len);
            bytes(out, data);
        }
        StoredBody::NotRetained { len } => {
            out.push(2);
            match len {
                None => out.push(0),
                Some(len) => {
                    out.push(1);
                    varint(out, *len);
                }
            }
        }
    }
    doc_fields(out, &r.trailers);
}

fn doc_encode_record(r: &Record) -> Vec<u8> {
    let mut out = vec![2];
    out.extend_from_slice(r.id.as_bytes());
    bytes(&mut out, r.scope.principal.as_str().as_bytes());
    bytes(&mut out, r.scope.endpoint.as_str().as_bytes());
    bytes(&mut out, r.key.as_bytes());
    out.extend_from_slice(r.fingerprint.as_bytes());
    out.push(match r.state {
        RecordState::InFlight => 0,
        RecordState::Completed => 1,
        RecordState::Failed => 2,
    });
    varint(&mut out, r.token.0);
    match &r.response {
        None => out.push(0),
        Some(response) => {
            out.push(1);
            doc_response(&mut out, response);
        }
    }
    for t in [r.created_at, r.started_at, r.lease_expires_at, r.expires_at] {
        zigzag(&mut out, t.0);
    }
    out
}
