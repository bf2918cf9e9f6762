//! Response bodies at the edges of `max_stored_body`, read by the layer frame by frame.

use crate::common;

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::routing::post as route_post;
use bytes::Bytes;
use common::{Counter, Env, post, send};
use http_body::{Frame, SizeHint};
use idem_http::IdempotencyLayer;

const LIMIT: usize = 64;

/// A body that sends `data` in `frames` equal frames and reports `hint` as its exact size.
struct Framed {
    chunks: Vec<Bytes>,
    hint: Option<u64>,
}

impl Framed {
    fn new(data: &[u8], frame_len: usize, hint: Option<u64>) -> Self {
        let mut chunks: Vec<Bytes> = data.chunks(frame_len).map(Bytes::copy_from_slice).collect();
        chunks.reverse();
        Self { chunks, hint }
    }
}

impl http_body::Body for Framed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.chunks.pop().map(|c| Ok(Frame::data(c))))
    }

    fn size_hint(&self) -> SizeHint {
        self.hint.map_or_else(SizeHint::new, SizeHint::with_exact)
    }
}

fn data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 256) as u8).collect()
}

fn app(env: &Env, runs: &Counter, len: usize, frame_len: usize, hint: Option<u64>) -> Router {
    let runs = runs.clone();
    Router::new()
        .route(
            "/v1/blobs",
            route_post(move || {
                let runs = runs.clone();
                async move {
                    runs.bump();
                    let body = Body::new(Framed::new(&data(len), frame_len, hint));
                    ([("content-type", "application/octet-stream")], body)
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(env.dyn_store())
                .with_policy(common::policy(|p| p.max_stored_body = LIMIT))
                .with_buffer_deadline(None),
        )
}

#[tokio::test]
async fn a_body_of_exactly_max_stored_body_is_stored_in_any_framing() {
    for frame_len in [1, 7, LIMIT] {
        for hint in [None, Some(LIMIT as u64)] {
            let env = Env::new();
            let runs = Counter::default();
            let app = app(&env, &runs, LIMIT, frame_len, hint);
            let req = post("/v1/blobs").key("k").body("{}");
            let first = send(&app, &req).await;
            assert_eq!(first.body.as_ref(), data(LIMIT).as_slice(), "frames of {frame_len}, hint {hint:?}");
            let replay = send(&app, &req).await;
            assert!(replay.replayed());
            assert_eq!(replay.body.as_ref(), data(LIMIT).as_slice(), "frames of {frame_len}, hint {hint:?}");
            assert_eq!(runs.get(), 1);
        }
    }
}

#[tokio::test]
async fn a_body_one_byte_over_max_stored_body_reaches_the_client_whole_and_is_not_retained() {
    for frame_len in [1, 7, LIMIT + 1] {
        let env = Env::new();
        let runs = Counter::default();
        let app = app(&env, &runs, LIMIT + 1, frame_len, None);
        let req = post("/v1/blobs").key("k").body("{}");
        let first = send(&app, &req).await;
        assert_eq!(first.body.as_ref(), data(LIMIT + 1).as_slice(), "frames of {frame_len}");
        let replay = send(&app, &req).await;
        replay.problem(200, "response-not-retained");
        assert_eq!(runs.get(), 1);
    }
}

#[tokio::test]
async fn a_size_hint_that_undercounts_is_not_recorded_as_the_length() {
    // A body whose exact size hint said 4 bytes while it sent 100 was recorded as "not
    // retained (4 bytes)": the replay stated a length the response never had.
    let env = Env::new();
    let runs = Counter::default();
    let app = app(&env, &runs, 100, 10, Some(4));
    let req = post("/v1/blobs").key("k").body("{}");
    let first = send(&app, &req).await;
    assert_eq!(first.body.len(), 100);
    let replay = send(&app, &req).await;
    let problem = replay.problem(200, "response-not-retained");
    let detail = problem["detail"].as_str().unwrap();
    assert!(!detail.contains("(4 bytes)"), "the replay states the lying hint as the length: {detail}");
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_grpc_web_unavailable_is_not_replayed() {
    // A gRPC-Web UNAVAILABLE (HTTP 200, trailers-only) was stored and replayed to every
    // retry: the transient failure became the operation's lasting outcome.
    let env = Env::new();
    let runs = Counter::default();
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/v1/blobs",
            route_post(move || {
                let r = r.clone();
                async move {
                    let status = if r.bump() == 1 { "14" } else { "0" };
                    ([("content-type", "application/grpc-web+proto"), ("grpc-status", status)], "")
                }
            }),
        )
        .layer(IdempotencyLayer::new(env.dyn_store()));
    let req = post("/v1/blobs").key("k").body("{}");
    assert_eq!(send(&app, &req).await.header("grpc-status"), Some("14"));
    let retry = send(&app, &req).await;
    assert!(!retry.replayed(), "the UNAVAILABLE answer was replayed");
    assert_eq!(retry.header("grpc-status"), Some("0"));
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn an_unbounded_max_stored_body_stores_a_body_of_many_frames() {
    // `max_stored_body(usize::MAX)` ("keep everything") overflowed `limit + 1` while the
    // layer grew its buffer for a second frame: a panic in the handler's work.
    let env = Env::new();
    let runs = Counter::default();
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/v1/blobs",
            route_post(move || {
                let r = r.clone();
                async move {
                    r.bump();
                    Body::new(Framed::new(&data(100), 10, None))
                }
            }),
        )
        .layer(IdempotencyLayer::new(env.dyn_store()).with_policy(common::policy(|p| p.max_stored_body = usize::MAX)));
    let req = post("/v1/blobs").key("k").body("{}");
    assert_eq!(send(&app, &req).await.body.as_ref(), data(100).as_slice());
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.body.as_ref(), data(100).as_slice());
    assert_eq!(runs.get(), 1);
}
