//! A streamed or endless response (SSE, chunked progress) held the client's head until the
//! body ended and left its record in flight, so a retry after the lease ran the handler a
//! second time; trailers were dropped; and FailOpen ran the handler again over a completed
//! record that did not decode. Every response shape, with a clock the test controls (the
//! store's manual clock and tokio's paused clock, moved together, only through the lease
//! scenarios' `advance`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderMap, HeaderValue, Response, header};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, FingerprintMode, IdempotencyKey, RecordId, RecordState,
    RequestParts, Scope, StoredBody, StoredResponse,
};
use idem_http::{BearerToken, IdempotencyLayer, StoreFailureMode};
use tokio::task::JoinHandle;

use super::HttpEnv;
use super::fixtures::{Counter, Got, Req, policy, post as post_req};
use super::lease::{LEASE, advance, answer, settle, start};

const TOKEN: &str = "tok-p";

/// The record of `key` on `POST route` for the default bearer.
fn record_id(route: &str, key: &str) -> RecordId {
    let scope = Scope::new(BearerToken::principal_for(TOKEN.as_bytes()), Endpoint::new("POST", route)).unwrap();
    scope.record_id(&IdempotencyKey::parse(key.as_bytes()).unwrap())
}

fn layer(b: &HttpEnv) -> IdempotencyLayer {
    IdempotencyLayer::new(b.dyn_store()).with_policy(policy(|p| p.lease_ttl = LEASE))
}

/// A request whose response future is kept apart from its body, so the head can be seen
/// while the body never ends.
fn start_head(app: &Router, req: &Req) -> JoinHandle<Response<Body>> {
    let app = app.clone();
    let req = req.build();
    tokio::spawn(async move {
        use tower::ServiceExt;
        app.oneshot(req).await.unwrap()
    })
}

/// Deterministic bytes that neither compress nor form UTF-8.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// An endless stream: one first event, then nothing, forever. The head reaches the client
/// within a second; the record completes as not retained; a retry after the lease gets
/// the `response-not-retained` problem with the original status; the handler ran once.
pub async fn endless_stream_runs_once(b: HttpEnv, content_type: &'static str) {
    let runs = Counter::default();
    let app = endless_app(layer(&b), content_type, &runs);
    let req = post_req("/v1/exports").key("export-1").body("{}");
    let head = start_head(&app, &req);
    settle(&b).await;
    advance(&b, Duration::from_secs(1)).await;
    assert!(head.is_finished(), "{}: {content_type}: no head within a second", b.name);
    let res = head.await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()[header::CONTENT_TYPE], content_type);
    let mut body = res.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, Bytes::from_static(b"data: 1\n\n"), "the first bytes reach the client");

    let record = b.store.record(record_id("/v1/exports", "export-1")).await.unwrap();
    assert_eq!(record.state, RecordState::Completed, "{}: completed before streaming", b.name);
    let stored = record.response.unwrap();
    assert!(matches!(stored.body, StoredBody::NotRetained { .. }), "{:?}", stored.body);

    // After the lease, a retry replays the not-retained answer; it never reclaims.
    advance(&b, LEASE + Duration::from_secs(1)).await;
    let retry = start(&app, &req);
    settle(&b).await;
    let got = answer(retry).await;
    got.problem(200, "response-not-retained");
    assert!(got.replayed());
    assert_eq!(got.header("x-should-retry"), Some("false"));
    assert_eq!(runs.get(), 1, "{}: the handler ran again", b.name);
    drop(body);
}

/// The same endless stream with the streaming rules off: no head after a minute, and a
/// retry after the lease runs the handler a second time (the bug the rules fix).
pub async fn endless_stream_without_rules_holds_the_head(b: HttpEnv) {
    let runs = Counter::default();
    let rules_off = layer(&b).with_buffer_deadline(None).with_streaming_content_types(Vec::<String>::new());
    let app = endless_app(rules_off.with_lease_renewal(idem_http::LeaseRenewal::Off), "text/event-stream", &runs);
    let req = post_req("/v1/exports").key("export-1").body("{}");
    let head = start_head(&app, &req);
    settle(&b).await;
    advance(&b, Duration::from_secs(60)).await;
    assert!(!head.is_finished(), "the head came through although nothing streams");
    let retry = start_head(&app, &req);
    settle(&b).await;
    assert_eq!(runs.get(), 2, "the retry after the lease ran the handler again");
    head.abort();
    retry.abort();
}

/// `POST /v1/exports`: one event, then an endless wait, as `content_type`.
fn endless_app(layer: IdempotencyLayer, content_type: &'static str, runs: &Counter) -> Router {
    let r = runs.clone();
    Router::new()
        .route(
            "/v1/exports",
            post(move || {
                let r = r.clone();
                async move {
                    r.bump();
                    let first =
                        futures::stream::once(async { Ok::<_, Infallible>(Bytes::from_static(b"data: 1\n\n")) });
                    let endless = first.chain(futures::stream::pending());
                    ([(header::CONTENT_TYPE, content_type)], Body::from_stream(endless))
                }
            }),
        )
        .layer(layer)
}

/// A 5 MiB chunked body and a binary (invalid UTF-8) body replay byte-identical with the
/// same content type.
pub async fn large_and_binary_bodies_replay_byte_identical(b: HttpEnv) {
    let runs = Counter::default();
    let big = Arc::new(noise(5 << 20, 7));
    let binary = Bytes::from(vec![0xff, 0xfe, 0x00, 0xc3, 0x28, 0x80, 0x7f]);
    let (r1, r2, big2, bin2) = (runs.clone(), runs.clone(), Arc::clone(&big), binary.clone());
    let app = Router::new()
        .route(
            "/v1/exports",
            post(move || {
                let (r, big) = (r1.clone(), Arc::clone(&big2));
                async move {
                    r.bump();
                    let chunks: Vec<Result<Bytes, Infallible>> =
                        big.chunks(64 << 10).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
                    ([(header::CONTENT_TYPE, "text/csv")], Body::from_stream(futures::stream::iter(chunks)))
                }
            }),
        )
        .route(
            "/v1/images",
            post(move || {
                let (r, bin) = (r2.clone(), bin2.clone());
                async move {
                    r.bump();
                    ([(header::CONTENT_TYPE, "image/png")], bin)
                }
            }),
        )
        .layer(IdempotencyLayer::new(b.dyn_store()).with_policy(policy(|p| {
            (p.lease_ttl, p.max_stored_body) = (LEASE, 8 << 20);
        })));
    for (path, ct, expected) in
        [("/v1/exports", "text/csv", Bytes::from(big.to_vec())), ("/v1/images", "image/png", binary)]
    {
        let req = post_req(path).key("k-bytes").body("{}");
        let mut answers = Vec::new();
        for _ in 0..2 {
            let attempt = start(&app, &req);
            settle(&b).await;
            let got = answer(attempt).await;
            assert_eq!(got.status, 200, "{}: {path}", b.name);
            assert_eq!(got.header("content-type"), Some(ct));
            assert!(got.body == expected, "{}: {path}: {} bytes differ", b.name, got.body.len());
            answers.push(got.replayed());
        }
        assert_eq!(answers, [false, true], "{}: {path}", b.name);
    }
    assert_eq!(runs.get(), 2);
}

/// A 3 MiB body over a 1 MiB limit streams through whole, the record completes without
/// it, and a retry gets the not-retained problem with the original status and `Location`.
pub async fn over_the_limit_streams_and_is_not_retained(b: HttpEnv) {
    let runs = Counter::default();
    let r = runs.clone();
    let body = Arc::new(noise(3 << 20, 11));
    let body2 = Arc::clone(&body);
    let app = Router::new()
        .route(
            "/v1/exports",
            post(move || {
                let (r, body) = (r.clone(), Arc::clone(&body2));
                async move {
                    r.bump();
                    let chunks: Vec<Result<Bytes, Infallible>> =
                        body.chunks(32 << 10).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
                    (
                        http::StatusCode::CREATED,
                        [(header::LOCATION, "/v1/exports/9"), (header::CONTENT_TYPE, "application/octet-stream")],
                        Body::from_stream(futures::stream::iter(chunks)),
                    )
                }
            }),
        )
        .layer(layer(&b));
    let req = post_req("/v1/exports").key("k-big").body("{}");
    let first = start(&app, &req);
    settle(&b).await;
    let got = answer(first).await;
    assert_eq!(got.status, 201);
    assert!(got.body[..] == body[..], "{}: the streamed body arrives whole", b.name);
    let stored = b.store.record(record_id("/v1/exports", "k-big")).await.unwrap().response.unwrap();
    assert!(matches!(stored.body, StoredBody::NotRetained { .. }));
    let retry = start(&app, &req);
    settle(&b).await;
    let got = answer(retry).await;
    got.problem(201, "response-not-retained");
    assert_eq!(got.header("location"), Some("/v1/exports/9"));
    assert_eq!(runs.get(), 1);
}

/// A body with trailers replays the same body and the same trailers.
pub async fn trailers_are_replayed(b: HttpEnv) {
    let runs = Counter::default();
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/v1/checks",
            post(move || {
                let r = r.clone();
                async move {
                    r.bump();
                    let mut trailers = HeaderMap::new();
                    trailers.insert("x-checksum", HeaderValue::from_static("sha256:abc"));
                    trailers.insert("grpc-status", HeaderValue::from_static("0"));
                    let frames = vec![
                        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"part one;"))),
                        Ok(Frame::data(Bytes::from_static(b"part two"))),
                        Ok(Frame::trailers(trailers)),
                    ];
                    Response::new(Body::new(StreamBody::new(futures::stream::iter(frames))))
                }
            }),
        )
        .layer(layer(&b));
    let req = post_req("/v1/checks").key("k-trailers").body("{}");
    for replayed in [false, true] {
        let head = start_head(&app, &req);
        settle(&b).await;
        let res = answer_head(head).await;
        assert_eq!(res.headers().get("idempotent-replayed").is_some(), replayed);
        let collected = res.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().unwrap_or_default();
        assert_eq!(collected.to_bytes(), Bytes::from_static(b"part one;part two"), "{}", b.name);
        assert_eq!(trailers.get("x-checksum").unwrap(), "sha256:abc", "{}: replayed={replayed}", b.name);
        assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    }
    assert_eq!(runs.get(), 1);
}

async fn answer_head<T>(head: JoinHandle<T>) -> T {
    assert!(head.is_finished(), "the attempt is still running");
    head.await.expect("attempt task")
}

/// FailOpen, and a completed record that does not decode (a body that does not
/// decompress, written through the store; with the backend's raw access also garbage in
/// the stored response, twice, and in one other field, written behind the store's back):
/// 503, never a second run.
pub async fn fail_open_never_reruns_a_corrupt_record(b: HttpEnv) {
    let runs = Counter::default();
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/v1/orders",
            post(move || {
                let r = r.clone();
                async move {
                    r.bump();
                    (http::StatusCode::CREATED, "created")
                }
            }),
        )
        .layer(layer(&b).with_store_failure_mode(StoreFailureMode::FailOpen));

    // A completed record whose compressed body does not decompress.
    let req = post_req("/v1/orders").key("k-lz4").body("{}");
    let claim = claim_for("k-lz4");
    let store = b.dyn_store();
    let ClaimOutcome::Claimed(record) = store.claim(claim).await.unwrap() else { panic!("claimed") };
    let bad = StoredResponse {
        status: 201,
        headers: vec![],
        body: StoredBody::Lz4 { len: 64, data: vec![0xff; 8] },
        trailers: vec![],
    };
    store.complete(record.id, record.token, bad).await.unwrap();
    expect_503_without_a_run(&b, &app, &req, &runs).await;

    // Raw garbage behind the store's back, in the response and in another field.
    for case in ["unknown-version", "truncated", "field"] {
        let key = format!("k-raw-{case}");
        let id = record_id("/v1/orders", &key);
        let req = post_req("/v1/orders").key(&key).body("{}");
        let first = start(&app, &req);
        settle(&b).await;
        assert_eq!(answer(first).await.status, 201);
        let ran = runs.get();
        if !corrupt(&b, id, case).await {
            b.report(&format!("no raw access: the corrupt record ({case}) is not checked"));
            continue;
        }
        let err = b.dyn_store().get(id).await.unwrap_err();
        assert!(err.is_corrupt(), "{}: {case}: one error kind for a record that does not decode: {err:?}", b.name);
        expect_503_without_a_run(&b, &app, &req, &runs).await;
        assert_eq!(runs.get(), ran, "{}: {case}", b.name);
    }
}

fn claim_for(key: &str) -> ClaimRequest {
    ClaimRequest::new(
        Scope::new(BearerToken::principal_for(TOKEN.as_bytes()), Endpoint::new("POST", "/v1/orders")).unwrap(),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
        Fingerprint::of_mode(
            &RequestParts {
                method: "POST",
                path: "/v1/orders",
                query: None,
                headers: &[("content-type", b"application/json")],
                body: b"{}",
            },
            FingerprintMode::Raw,
        ),
        LEASE,
        Duration::from_secs(3_600),
    )
}

async fn expect_503_without_a_run(b: &HttpEnv, app: &Router, req: &Req, runs: &Counter) {
    let before = runs.get();
    let retry = start(app, req);
    settle(b).await;
    let got: Got = answer(retry).await;
    got.problem(503, "store-unavailable");
    assert_eq!(got.header("x-should-retry"), Some("false"), "retrying cannot mend the record");
    assert_eq!(runs.get(), before, "{}: the handler ran over a completed record", b.name);
}

/// Writes garbage into one part of record `id`, behind the store's back, with the
/// backend's raw access; false if it has none. `unknown-version` and `truncated` replace
/// the stored response (or, where the backend keeps the record as one value, that value);
/// `field` spoils another part of the record (the backend's [`crate::Backend::corrupt_stored`]).
async fn corrupt(b: &HttpEnv, id: RecordId, case: &'static str) -> bool {
    if case == "field" {
        return b.corrupt_stored(id).await;
    }
    let Some(stored) = b.read_stored(id).await else { return false };
    let whole = super::whole_record(&stored, id).is_some();
    let garbage = match (case, whole) {
        ("unknown-version", _) => vec![0x09, 0xff],
        (_, true) => vec![idem_core::codec::FORMAT_VERSION, 0xff, 0xff, 0xff],
        (_, false) => vec![0x01, 0xff, 0xff, 0xff, 0xff],
    };
    assert!(b.overwrite_stored(id, garbage).await, "{}: read_stored works but overwrite_stored does not", b.name);
    true
}

/// A server error is stored only on purpose (`Policy::cacheable_5xx`,
/// `ResponseCaching::StoreServerError`) and then replayed like any stored response; an
/// allowlist (`Policy::header_allow_list`) stores only the headers it names.
pub async fn server_errors_are_stored_only_on_purpose(b: HttpEnv) {
    let runs = Counter::default();
    let route = |status: u16, marked: bool| {
        let runs = runs.clone();
        post(move || {
            let runs = runs.clone();
            async move {
                let n = runs.bump();
                let mut res = Response::new(Body::from(format!("{{\"run\":{n}}}")));
                *res.status_mut() = http::StatusCode::from_u16(status).expect("status");
                for (name, value) in [("location", "/v1/flashes/7"), ("etag", "\"v1\""), ("x-request-id", "r-1")] {
                    res.headers_mut().insert(name, HeaderValue::from_static(value));
                }
                if marked {
                    res.extensions_mut().insert(idem_http::ResponseCaching::StoreServerError);
                }
                res
            }
        })
    };
    let plain =
        Router::new().route("/v1/plain", route(500, false)).route("/v1/marked", route(503, true)).layer(layer(&b));
    let listed = Router::new().route("/v1/listed", route(504, false)).layer(
        IdempotencyLayer::new(b.dyn_store()).with_policy(policy(|p| {
            p.lease_ttl = LEASE;
            p.cacheable_5xx = vec![504];
            p.header_allow_list = Some(vec!["Location".into(), "x-request-id".into()]);
        })),
    );
    let mut seen = Vec::new();
    for (app, path) in [(&plain, "/v1/plain"), (&plain, "/v1/marked"), (&listed, "/v1/listed")] {
        let req = post_req(path).key("k-5xx").body("{}");
        for _ in 0..2 {
            let attempt = start(app, &req);
            settle(&b).await;
            let got = answer(attempt).await;
            seen.push((path, got.status.as_u16(), got.replayed(), got.text().to_owned(), got.header("etag").is_some()));
        }
    }
    let expected = [
        // Not opted in: failed, the retry runs again.
        ("/v1/plain", 500, false, "{\"run\":1}", true),
        ("/v1/plain", 500, false, "{\"run\":2}", true),
        // Marked by the handler: stored and replayed.
        ("/v1/marked", 503, false, "{\"run\":3}", true),
        ("/v1/marked", 503, true, "{\"run\":3}", true),
        // Listed in the policy: stored; the replay keeps only the allowed headers.
        ("/v1/listed", 504, false, "{\"run\":4}", true),
        ("/v1/listed", 504, true, "{\"run\":4}", false),
    ];
    let expected: Vec<_> = expected.iter().map(|(p, s, r, t, e)| (*p, *s, *r, (*t).to_owned(), *e)).collect();
    assert_eq!(seen, expected, "{}", b.name);
    let attempt = start(&listed, &post_req("/v1/listed").key("k-5xx").body("{}"));
    settle(&b).await;
    let replay = answer(attempt).await;
    assert_eq!(replay.header("location"), Some("/v1/flashes/7"));
    assert_eq!(replay.header("x-request-id"), Some("r-1"));
    assert_eq!(runs.get(), 4);
}

/// A key read from a JSON body field and a fingerprint without a volatile field: a retry
/// that reorders the body and changes only that field replays, a changed operation is a
/// mismatch, a body without the field gets the missing-key problem (a header key is not
/// read), and the application hears every step (`with_events`) and may edit a replay's head.
pub async fn keys_and_fingerprints_from_the_body(b: HttpEnv) {
    use idem_http::{DecisionKind, FingerprintBody, KeySource, Outcome, Step};
    let runs = Counter::default();
    let steps = Arc::new(std::sync::Mutex::new(Vec::new()));
    let counted = runs.clone();
    let handler = post(move || {
        let runs = counted.clone();
        async move { (http::StatusCode::CREATED, format!("{{\"run\":{}}}", runs.bump())) }
    });
    let seen = Arc::clone(&steps);
    let app = Router::new().route("/v1/deploys", handler).layer(
        layer(&b)
            .with_key_source(KeySource::json_field("/request_id"))
            .with_fingerprint_body(FingerprintBody::json_without(["/sent_at"]))
            .with_events(move |event| seen.lock().unwrap().push((event.step, event.record.is_some())))
            .with_replay_edit(|head| drop(head.headers.insert("x-replay-note", HeaderValue::from_static("edited")))),
    );
    let send_req = |req: Req| {
        let attempt = start(&app, &req);
        async {
            settle(&b).await;
            answer(attempt).await
        }
    };
    let send = |body: &'static str| send_req(post_req("/v1/deploys").body(body));
    let first = send(r#"{"request_id":"r-1","image":"v1","sent_at":1}"#).await;
    assert_eq!((first.status.as_u16(), first.text()), (201, r#"{"run":1}"#), "{}", b.name);
    let retry = send(r#"{"sent_at":2,  "image":"v1", "request_id":"r-1"}"#).await;
    assert!(retry.replayed(), "{}: a retry that differs only in sent_at and order replays", b.name);
    assert_eq!((retry.text(), retry.header("x-replay-note")), (r#"{"run":1}"#, Some("edited")));
    send(r#"{"request_id":"r-1","image":"v2","sent_at":3}"#).await.problem(409, "mismatch");
    let other = send(r#"{"request_id":42,"image":"v1"}"#).await;
    assert_eq!((other.status.as_u16(), other.text(), other.header("x-replay-note")), (201, r#"{"run":2}"#, None));
    let missing = send(r#"{"image":"v1"}"#).await.problem(400, "missing-idempotency-key");
    assert!(missing["detail"].as_str().unwrap().contains("/request_id"), "{missing}");
    let keyed = post_req("/v1/deploys").key("k-header").body(r#"{"image":"v1"}"#);
    send_req(keyed).await.problem(400, "missing-idempotency-key");
    assert_eq!(runs.get(), 2, "{}", b.name);
    let (claimed, completed) = (Step::Decided(DecisionKind::Claimed), Step::Ended(Outcome::Completed));
    let rejected = (Step::Decided(DecisionKind::Rejected), false);
    let expected = vec![
        (claimed, true),
        (completed, true),
        (Step::Decided(DecisionKind::Replayed), true),
        (Step::Decided(DecisionKind::Mismatch), true),
        (claimed, true),
        (completed, true),
        rejected,
        rejected,
    ];
    assert_eq!(*steps.lock().unwrap(), expected, "{}", b.name);
}
