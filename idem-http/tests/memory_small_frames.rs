//! Memory not bounded by `max_stored_body`: the layer kept every frame it read as its own
//! `Bytes` in a `Vec`, so a body of one-byte frames cost ~64 bytes of heap per byte read
//! (the `Vec` slot plus each frame's allocation): 1 MiB read under a 1 MiB limit held
//! ~64 MiB. The only test in its binary, so no other test's allocations count.

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

/// `POST /v1/progress`: `total` bytes, one freshly allocated byte per frame (a progress
/// ticker that flushes every character).
fn app(layer: IdempotencyLayer, total: usize) -> Router {
    Router::new()
        .route(
            "/v1/progress",
            post(move || async move {
                let frames = (0..total).map(|i| Ok::<_, Infallible>(Bytes::from(vec![(i % 251) as u8])));
                ([("content-type", "text/plain")], Body::from_stream(futures::stream::iter(frames)))
            }),
        )
        .layer(layer)
}

#[test]
fn one_byte_frames_grow_memory_by_less_than_twice_max_stored_body() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let limit = MIB;
        // Over the limit by one frame: the layer reads all `limit + 1` bytes, then streams.
        // No buffering deadline, so how fast this build produces frames does not matter.
        let total = limit + 1;
        let layer = || {
            let mut policy = Policy::default();
            policy.max_stored_body = limit;
            IdempotencyLayer::new(Arc::new(MemoryStore::new())).with_policy(policy).with_buffer_deadline(None)
        };
        let bounded = app(layer(), total);
        assert_eq!(drain_post(&bounded, "/v1/progress", "warm-up").await, total);
        let start = current_rss();
        take_peak();
        assert_eq!(drain_post(&bounded, "/v1/progress", "progress-1").await, total);
        let grew = take_peak().saturating_sub(start);
        eprintln!("peak RSS growth over the limit: {} KiB", grew / 1024);
        assert!(grew < 2 * limit, "peak RSS grew by {} KiB, over 2 x max_stored_body", grew / 1024);

        // Within the limit (stored whole): the same bound.
        let within = app(layer(), limit);
        assert_eq!(drain_post(&within, "/v1/progress", "warm-up").await, limit);
        let start = current_rss();
        take_peak();
        assert_eq!(drain_post(&within, "/v1/progress", "progress-2").await, limit);
        let grew = take_peak().saturating_sub(start);
        eprintln!("peak RSS growth within the limit: {} KiB", grew / 1024);
        assert!(grew < 3 * limit, "peak RSS grew by {} KiB, over 3 x max_stored_body", grew / 1024);
    });
}
