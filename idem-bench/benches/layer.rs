//! CPU cost of `idem_http::IdempotencyLayer` per request without sockets: one axum
//! handler called through `tower::ServiceExt::oneshot`, bare and behind the layer with a
//! `MemoryStore` (a first-time claim per request, and a replay).
//!
//! ```text
//! cargo bench -p idem-bench --bench layer
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use divan::Bencher;
use idem_core::MemoryStore;
use idem_http::IdempotencyLayer;
use tower::ServiceExt;

fn main() {
    divan::main();
}

fn router() -> Router {
    Router::new().route(
        "/v1/workers",
        post(|body: axum::body::Bytes| async move {
            // Reads the request body, as any real POST handler does (a bare handler that
            // ignores it would skip hyper's body channel, which the layer must always read).
            let _ = body;
            (StatusCode::CREATED, [("location", "/v1/workers/7")], r#"{"id":7}"#)
        }),
    )
}

fn request(key: u64) -> Request<Body> {
    Request::post("/v1/workers")
        .header("authorization", "Bearer bench-token")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("k-{key}"))
        .body(Body::from(r#"{"gpus":8}"#))
        .expect("request")
}

fn run(bencher: Bencher<'_, '_>, app: Router, fresh: bool) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let next = AtomicU64::new(0);
    bencher.bench_local(|| {
        let key = if fresh { next.fetch_add(1, Ordering::Relaxed) } else { 0 };
        rt.block_on(async {
            let resp = app.clone().oneshot(request(key)).await.expect("infallible");
            let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.expect("body");
            divan::black_box(body);
        });
    });
}

#[divan::bench]
fn bare(bencher: Bencher<'_, '_>) {
    // `with_state(())`: handlers become services once (as `axum::serve` does), not per
    // `oneshot`, which would run `Layer::layer` for every request.
    run(bencher, router().with_state(()), true);
}

#[divan::bench]
fn layer_memory_first(bencher: Bencher<'_, '_>) {
    run(bencher, router().layer(IdempotencyLayer::new(Arc::new(MemoryStore::new()))).with_state(()), true);
}

#[divan::bench]
fn layer_memory_replay(bencher: Bencher<'_, '_>) {
    run(bencher, router().layer(IdempotencyLayer::new(Arc::new(MemoryStore::new()))).with_state(()), false);
}
