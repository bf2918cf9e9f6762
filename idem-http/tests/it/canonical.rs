//! JSON formatting and the fingerprint through the layer
//! (`docs/failures.md#json-formatting-changes-the-fingerprint`): key order or whitespace
//! changed the fingerprint, so an honest retry was rejected as a mismatch (canonical mode),
//! while raw mode (the default) keeps every byte significant.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use idem_core::MemoryStore;
use idem_http::{FingerprintMode, IdempotencyLayer};
use tower::ServiceExt;

/// A layer with `mode`, or with the default mode when `None`.
fn app(mode: Option<FingerprintMode>, runs: Arc<AtomicUsize>) -> Router {
    let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()));
    let layer = match mode {
        Some(mode) => layer.with_fingerprint_mode(mode),
        None => layer,
    };
    Router::new()
        .route(
            "/v1/orders",
            post(move || {
                let runs = Arc::clone(&runs);
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    (StatusCode::CREATED, format!("order {n}"))
                }
            }),
        )
        .route_layer(layer)
}

async fn send(app: &Router, key: &str, body: &str) -> StatusCode {
    let req = Request::post("/v1/orders")
        .header("authorization", "Bearer t")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    app.clone().oneshot(req).await.unwrap().status()
}

#[tokio::test]
async fn canonical_mode_replays_reordered_json_and_still_rejects_real_differences() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(Some(FingerprintMode::CanonicalJson), Arc::clone(&runs));
    assert_eq!(send(&app, "k1", r#"{"a":1,"b":2}"#).await, StatusCode::CREATED);
    // Reordered members and pretty printing: the same request, replayed.
    assert_eq!(send(&app, "k1", r#"{"b":2, "a":1}"#).await, StatusCode::CREATED);
    assert_eq!(send(&app, "k1", "{\n  \"a\": 1,\n  \"b\": 2\n}").await, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Array order and null versus absent still make another request: mismatch.
    assert_eq!(send(&app, "k2", r#"{"x":[1,2]}"#).await, StatusCode::CREATED);
    assert_eq!(send(&app, "k2", r#"{"x":[2,1]}"#).await, StatusCode::CONFLICT);
    assert_eq!(send(&app, "k3", r#"{"a":null}"#).await, StatusCode::CREATED);
    assert_eq!(send(&app, "k3", r#"{}"#).await, StatusCode::CONFLICT);
    assert_eq!(send(&app, "k4", "").await, StatusCode::CREATED);
    assert_eq!(send(&app, "k4", "{}").await, StatusCode::CONFLICT);
    assert_eq!(send(&app, "k4", "null").await, StatusCode::CONFLICT);
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn raw_mode_is_the_default_and_rejects_reordered_json() {
    // Explicitly raw, and a layer left at its default: both keep every byte significant.
    for mode in [Some(FingerprintMode::Raw), None] {
        let runs = Arc::new(AtomicUsize::new(0));
        let app = app(mode, Arc::clone(&runs));
        assert_eq!(send(&app, "k1", r#"{"a":1,"b":2}"#).await, StatusCode::CREATED, "{mode:?}");
        assert_eq!(send(&app, "k1", r#"{"b":2,"a":1}"#).await, StatusCode::CONFLICT, "{mode:?}");
        assert_eq!(send(&app, "k1", r#"{"a":1,"b":2}"#).await, StatusCode::CREATED, "{mode:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{mode:?}");
    }
}
