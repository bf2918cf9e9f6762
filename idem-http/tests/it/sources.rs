//! Where the key comes from (`KeySource`), what of the body the fingerprint covers
//! (`FingerprintBody`) and what the application hears (`with_events`), on the memory store;
//! the scenario that runs on every backend is idem-conformance's
//! `keys_and_fingerprints_from_the_body`.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{HeaderName, Request, StatusCode};
use idem_http::{DecisionKind, FingerprintBody, IdempotencyLayer, KeyRequirement, KeySource, Outcome, Step};
use tower::ServiceExt;

use crate::common::{Counter, Env, Got};

/// An app whose handler answers `{"run":n,"body":…}` (the body it got), 500 for `fail`.
fn router(layer: IdempotencyLayer, runs: &Counter) -> Router {
    let runs = runs.clone();
    let handler = move |body: String| {
        let runs = runs.clone();
        async move {
            let status = if body == "fail" { StatusCode::INTERNAL_SERVER_ERROR } else { StatusCode::CREATED };
            (status, format!("{{\"run\":{},\"body\":{body:?}}}", runs.bump()))
        }
    };
    Router::new().route("/v1/deploys", post(handler)).layer(layer)
}

async fn send(app: &Router, headers: &[(&str, &str)], body: &str) -> Got {
    let mut req = Request::post("/v1/deploys").header("authorization", "Bearer tok");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    Got::read(app.clone().oneshot(req.body(Body::from(body.to_owned())).unwrap()).await.unwrap()).await
}

/// A key in another header field was not read, or a second field of it was accepted.
#[tokio::test]
async fn a_key_from_another_header_field() {
    let (env, runs) = (Env::new(), Counter::default());
    let source = KeySource::header(HeaderName::from_static("x-request-id"));
    let app = router(IdempotencyLayer::new(env.dyn_store()).with_key_source(source), &runs);
    assert_eq!(send(&app, &[("x-request-id", "r-1")], "a").await.status, 201);
    assert!(send(&app, &[("x-request-id", "r-1")], "a").await.replayed());
    let p = send(&app, &[("idempotency-key", "r-2")], "a").await.problem(400, "missing-idempotency-key");
    assert!(p["detail"].as_str().unwrap().contains("x-request-id"), "{p}");
    send(&app, &[("x-request-id", "r-3"), ("x-request-id", "r-3")], "a")
        .await
        .problem(400, "duplicate-idempotency-key");
    send(&app, &[("x-request-id", "r 4")], "a").await.problem(400, "invalid-idempotency-key");
    assert_eq!(runs.get(), 1);
}

/// Under an optional key read from the body, a body without it reached the handler changed
/// (or not at all); a key from a function was not read.
#[tokio::test]
async fn body_keys_optional_and_from_a_function() {
    let (env, runs) = (Env::new(), Counter::default());
    let layer = IdempotencyLayer::new(env.dyn_store())
        .with_key_source(KeySource::json_field("/request_id"))
        .with_key_requirement(KeyRequirement::Optional);
    let app = router(layer, &runs);
    let body = r#"{"image":"v1"}"#;
    for run in 1..=2 {
        let got = send(&app, &[], body).await;
        assert_eq!(got.text(), format!("{{\"run\":{run},\"body\":{body:?}}}"), "keyless: runs each time");
    }
    let from_query = KeySource::from_fn(|parts, _| parts.uri.query()?.strip_prefix("op=").map(str::to_owned));
    let app = router(IdempotencyLayer::new(env.dyn_store()).with_key_source(from_query), &runs);
    let req = || Request::post("/v1/deploys?op=o-1").header("authorization", "Bearer tok").body(Body::from("x"));
    let first = Got::read(app.clone().oneshot(req().unwrap()).await.unwrap()).await;
    let again = Got::read(app.clone().oneshot(req().unwrap()).await.unwrap()).await;
    assert_eq!((first.status.as_u16(), again.replayed(), again.text()), (201, true, first.text()));
    assert_eq!(runs.get(), 3);
}

/// A fingerprint of chosen fields still saw the others, or a function's fingerprint was not used.
#[tokio::test]
async fn fingerprints_of_chosen_fields_and_of_a_function() {
    let (env, runs) = (Env::new(), Counter::default());
    let fields = IdempotencyLayer::new(env.dyn_store()).with_fingerprint_body(FingerprintBody::json_fields(["/image"]));
    let app = router(fields, &runs);
    let key = [("idempotency-key", "k-1")];
    assert_eq!(send(&app, &key, r#"{"image":"v1","note":"a"}"#).await.status, 201);
    assert!(send(&app, &key, r#"{ "note":"b", "image":"v1" }"#).await.replayed());
    send(&app, &key, r#"{"image":"v2","note":"a"}"#).await.problem(409, "mismatch");
    // Not JSON: the body enters whole.
    assert_eq!(send(&app, &[("idempotency-key", "k-2")], "plain").await.status, 201);
    send(&app, &[("idempotency-key", "k-2")], "plain!").await.problem(409, "mismatch");
    let lower = FingerprintBody::from_fn(|_, body| body.to_ascii_lowercase());
    let app = router(IdempotencyLayer::new(env.dyn_store()).with_fingerprint_body(lower), &runs);
    let key = [("idempotency-key", "k-3")];
    assert_eq!(send(&app, &key, "ABC").await.status, 201);
    assert!(send(&app, &key, "abc").await.replayed());
    assert_eq!(runs.get(), 3);
}

/// The application missed a failed attempt or an in-flight answer, or heard of a keyless request.
#[tokio::test]
async fn events_name_failed_attempts() {
    let (env, runs) = (Env::new(), Counter::default());
    let steps = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&steps);
    let layer = IdempotencyLayer::new(env.dyn_store())
        .with_key_requirement(KeyRequirement::Optional)
        .with_events(move |e| seen.lock().unwrap().push((e.step, e.endpoint.to_owned())));
    let app = router(layer, &runs);
    assert_eq!(send(&app, &[("idempotency-key", "k-f")], "fail").await.status, 500);
    assert_eq!(send(&app, &[], "b").await.status, 201);
    let endpoint = "POST /v1/deploys".to_owned();
    let expected = vec![
        (Step::Decided(DecisionKind::Claimed), endpoint.clone()),
        (Step::Ended(Outcome::Failed), endpoint.clone()),
        (Step::Decided(DecisionKind::Skipped), endpoint),
    ];
    assert_eq!(*steps.lock().unwrap(), expected);
}
