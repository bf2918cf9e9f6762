//! Limits on what a client controls that reaches the fingerprint: a request
//! with thousands of `content-type` fields, or one huge one, made the layer hash all of
//! it; now it is a 431 problem, nothing claimed, no handler run.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use idem_core::{Endpoint, IdempotencyKey, MemoryStore, Scope, Store};
use idem_http::{BearerToken, IdempotencyLayer};
use tower::{Layer, ServiceExt};

async fn send(layer: &IdempotencyLayer, content_types: &[&str], runs: &Arc<AtomicUsize>) -> (u16, serde_json::Value) {
    let handler = tower::service_fn({
        let runs = runs.clone();
        move |_: Request<Full<Bytes>>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
        }
    });
    let mut req = Request::post("/v1/workers").header("idempotency-key", "k1").header("authorization", "Bearer t");
    for ct in content_types {
        req = req.header("content-type", *ct);
    }
    let res = layer.layer(handler).oneshot(req.body(Full::new(Bytes::from_static(b"{}"))).unwrap()).await.unwrap();
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or_default())
}

/// Pins: too many fingerprinted header fields, or too many bytes in them, are a 431
/// `headers-too-large` problem before anything is claimed; at the limit, the request runs.
#[tokio::test]
async fn fingerprint_headers_over_the_field_or_byte_limit_are_431_and_claim_nothing() {
    let record = Scope::new(BearerToken::principal_for(b"t"), Endpoint::new("POST", "/v1/workers"))
        .unwrap()
        .record_id(&IdempotencyKey::parse(b"k1").unwrap());
    let long = "a".repeat(100);
    for (fields, over) in [
        (vec!["application/json"; 3], true),
        (vec![long.as_str()], true),
        (vec!["application/json"; 2], false),
        (vec![&long[..50]], false),
    ] {
        let store = Arc::new(MemoryStore::new());
        // Two fields; 12 bytes of "content-type" plus 50 of value, at most.
        let layer = IdempotencyLayer::new(store.clone()).with_max_fingerprint_headers(2, 62);
        let runs = Arc::new(AtomicUsize::new(0));
        let (status, problem) = send(&layer, &fields, &runs).await;
        if over {
            assert_eq!(status, 431, "{fields:?}");
            assert_eq!(problem["type"], idem_http::ProblemKind::HeadersTooLarge.type_uri());
            assert_eq!(problem["status"], 431);
            assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran");
            assert_eq!(store.get(record).await.unwrap(), None, "a record was claimed");
        } else {
            assert_eq!((status, runs.load(Ordering::SeqCst)), (200, 1), "{fields:?}");
        }
    }
    // The defaults: 32 fields, 16 KiB.
    let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    assert_eq!(send(&layer, &["x"; 33], &runs).await.0, 431);
    assert_eq!(send(&layer, &["x"; 32], &runs).await.0, 200);
}
