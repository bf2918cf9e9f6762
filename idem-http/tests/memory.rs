//! The layer read the whole response body into memory before `max_stored_body` applied, so
//! a POST streaming a large export held all of it in RAM per request. A 100 MiB response
//! through the layer must leave the process's peak resident memory less than twice
//! `max_stored_body` above where it started (Linux: `VmHWM`, reset through
//! `/proc/self/clear_refs`). The only test in its binary, so no other test's allocations
//! count.

#![cfg(target_os = "linux")]

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use idem_core::MemoryStore;
use idem_http::{IdempotencyLayer, Policy};

mod rss;

use rss::{current_rss, drain_post, take_peak};

const MIB: usize = 1 << 20;
const CHUNK: usize = 64 << 10;

/// `POST /v1/exports`: `total` bytes in fresh 64 KiB chunks, as a handler that produces
/// its export piece by piece would send them.
fn app(layer: IdempotencyLayer, total: usize) -> Router {
    Router::new()
        .route(
            "/v1/exports",
            post(move || async move {
                let chunks = (0..total / CHUNK).map(|i| Ok::<_, Infallible>(Bytes::from(vec![(i % 251) as u8; CHUNK])));
                ([("content-type", "application/octet-stream")], Body::from_stream(futures::stream::iter(chunks)))
            }),
        )
        .layer(layer)
}

#[test]
fn a_100_mib_response_grows_memory_by_less_than_twice_max_stored_body() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let total = 100 * MIB;
        let limit = 4 * MIB;
        let mut policy = Policy::default();
        policy.max_stored_body = limit;
        let bounded = app(IdempotencyLayer::new(Arc::new(MemoryStore::new())).with_policy(policy), total);
        // Warm up: allocator arenas, the runtime, the router.
        assert_eq!(drain_post(&bounded, "/v1/exports", "warm-up").await, total);
        let start = current_rss();
        take_peak();
        assert_eq!(drain_post(&bounded, "/v1/exports", "export-1").await, total);
        let grew = take_peak().saturating_sub(start);
        assert!(grew < 2 * limit, "peak RSS grew by {} KiB, over 2 x max_stored_body", grew / 1024);

        // The measurement can see buffering: with a limit above the body, the layer keeps
        // the whole 100 MiB (it is stored), and the peak must show it.
        let mut policy = Policy::default();
        (policy.max_stored_body, policy.compress_over) = (2 * total, usize::MAX);
        let whole = app(IdempotencyLayer::new(Arc::new(MemoryStore::new())).with_policy(policy), total);
        let start = current_rss();
        take_peak();
        assert_eq!(drain_post(&whole, "/v1/exports", "export-2").await, total);
        let grew_whole = take_peak().saturating_sub(start);
        assert!(grew_whole > total, "a stored 100 MiB body grew the peak by only {} KiB", grew_whole / 1024);
        eprintln!("peak RSS growth: bounded {} KiB, whole body stored {} KiB", grew / 1024, grew_whole / 1024);
    });
}
