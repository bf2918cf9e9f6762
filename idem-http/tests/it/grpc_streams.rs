//! A streamed gRPC response that ended UNAVAILABLE was stored as done, and every retry got ALREADY_EXISTS.
//!
//! A gRPC stream sends its `grpc-status` last, after a body longer than `max_stored_body`:
//! the layer completed the record as not retained when the body started to stream, before
//! the status existed. Now the claim is held (and renewed) until the stream ends; a lasting
//! status completes the record, anything else fails it. No sockets: `tower::ServiceExt::oneshot`.

use crate::common;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use common::{Counter, Env};
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use idem_core::{FencingToken, Record, RecordState, StoreError, StoredBody};
use idem_http::IdempotencyLayer;
use tokio::sync::mpsc;
use tower::ServiceExt;

const LIMIT: usize = 64;
const PATH: &str = "/idem.test.Exports/Export";
const ENDPOINT: &str = "POST /idem.test.Exports/Export";

/// How one run of the handler ends its stream.
#[derive(Clone, Copy, Debug)]
enum End {
    /// Trailers with this `grpc-status`.
    Status(&'static str),
    /// No trailers at all: the status never came.
    Bare,
    /// The body fails after its data.
    Error,
}

/// The body one run streams: `3 * LIMIT` bytes in frames of `LIMIT`, then `end`.
fn stream(end: End) -> Body {
    let mut frames: Vec<Result<Frame<Bytes>, std::io::Error>> =
        (0..3).map(|i| Ok(Frame::data(Bytes::from(vec![i; LIMIT])))).collect();
    match end {
        End::Status(code) => frames.push(Ok(Frame::trailers(status(code)))),
        End::Bare => {}
        End::Error => frames.push(Err(std::io::Error::other("the stream broke"))),
    }
    Body::new(StreamBody::new(futures::stream::iter(frames)))
}

fn status(code: &'static str) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static(code));
    trailers
}

/// A server-streaming RPC behind the layer; run `n` (from 1) streams what `body(n)` gives.
fn app(env: &Env, runs: &Counter, body: impl Fn(usize) -> Body + Clone + Send + Sync + 'static) -> Router {
    let runs = runs.clone();
    Router::new()
        .route(
            PATH,
            post(move || {
                let (runs, body) = (runs.clone(), body.clone());
                async move {
                    let n = runs.bump();
                    let mut res = Response::new(body(n));
                    res.headers_mut().insert("content-type", HeaderValue::from_static("application/grpc"));
                    res
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(env.dyn_store())
                .with_policy(common::policy(|p| (p.max_stored_body, p.lease_ttl) = (LIMIT, Duration::from_secs(3))))
                .with_buffer_deadline(None),
        )
}

/// The RPC with idempotency key `k`, as a gRPC client sends it.
fn call() -> Request<Body> {
    Request::post(PATH)
        .header("content-type", "application/grpc")
        .header("authorization", "Bearer tok-p")
        .header("idempotency-key", "k")
        .body(Body::from(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap()
}

/// A call's answer read to its end: its body length and its `grpc-status` (trailers first,
/// then the headers of a trailers-only answer).
async fn send(app: &Router) -> (usize, String) {
    let res = app.clone().oneshot(call()).await.unwrap();
    let (head, body) = res.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let code = trailers.get("grpc-status").or_else(|| head.headers.get("grpc-status")).map(|v| v.to_str().unwrap());
    let code = code.expect("every gRPC answer has a status").to_owned();
    (collected.to_bytes().len(), code)
}

async fn record(env: &Env) -> Record {
    env.record("tok-p", ENDPOINT, "k").await.expect("the call left a record")
}

/// Lets spawned tasks (a guard's `fail`) run until `record` is in `state`.
async fn until_state(env: &Env, state: RecordState) {
    for _ in 0..1000 {
        if record(env).await.state == state {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the record never became {state:?}: {:?}", record(env).await.state);
}

#[tokio::test]
async fn a_stream_that_ended_unavailable_runs_again_on_retry() {
    let env = Env::new();
    let runs = Counter::default();
    let app = app(&env, &runs, |n| stream(End::Status(if n == 1 { "14" } else { "0" })));
    assert_eq!(send(&app).await, (3 * LIMIT, "14".to_owned()));
    // The trailers went out after the record was written: no yield needed to see it.
    let state = record(&env).await.state;
    assert_eq!(send(&app).await, (3 * LIMIT, "0".to_owned()), "the retry ran the call again, not ALREADY_EXISTS");
    assert_eq!(runs.get(), 2);
    assert_eq!(state, RecordState::Failed, "an UNAVAILABLE stream is not done");
    // The second run ended OK: done for good, its reply not retained.
    assert_eq!(send(&app).await, (0, "6".to_owned()), "ALREADY_EXISTS");
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn a_stream_that_ended_with_a_lasting_status_replays_as_done() {
    for code in ["0", "5"] {
        let env = Env::new();
        let runs = Counter::default();
        let app = app(&env, &runs, move |_| stream(End::Status(code)));
        assert_eq!(send(&app).await, (3 * LIMIT, code.to_owned()));
        let stored = record(&env).await;
        assert_eq!(stored.state, RecordState::Completed, "{code}: written before the trailers went out");
        let stored = stored.response.unwrap();
        assert_eq!(stored.body, StoredBody::NotRetained { len: Some(3 * LIMIT as u64) }, "{code}");
        assert_eq!(stored.trailers, [("grpc-status".to_owned(), code.as_bytes().to_vec())], "{code}");
        assert_eq!(send(&app).await, (0, "6".to_owned()), "{code}: ALREADY_EXISTS, never a second run");
        assert_eq!(runs.get(), 1, "{code}");
        assert_eq!(env.store.fails.load(std::sync::atomic::Ordering::SeqCst), 0, "{code}");
    }
}

#[tokio::test]
async fn a_stream_that_ended_without_a_status_or_failed_runs_again() {
    for end in [End::Bare, End::Error] {
        let env = Env::new();
        let runs = Counter::default();
        let app = app(&env, &runs, move |n| stream(if n == 1 { end } else { End::Status("0") }));
        let res = app.clone().oneshot(call()).await.unwrap();
        let read = res.into_body().collect().await;
        match end {
            End::Error => assert!(read.is_err(), "the failure reaches the client"),
            _ => assert!(read.unwrap().trailers().is_none(), "no status"),
        }
        until_state(&env, RecordState::Failed).await;
        assert_eq!(send(&app).await, (3 * LIMIT, "0".to_owned()), "{end:?}: the retry ran the call again");
        assert_eq!(runs.get(), 2, "{end:?}");
    }
}

/// A body the test feeds frame by frame.
struct Fed(mpsc::UnboundedReceiver<Frame<Bytes>>);

impl http_body::Body for Fed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|frame| frame.map(Ok))
    }
}

/// An app whose runs stream what the test feeds them, one feed per run in the order they
/// were queued; a run with no feed queued streams an OK call of its own.
fn fed_app(env: &Env, runs: &Counter) -> (Router, mpsc::UnboundedSender<mpsc::UnboundedReceiver<Frame<Bytes>>>) {
    let (feeds, queue) = mpsc::unbounded_channel();
    let queue = Arc::new(Mutex::new(queue));
    let app = app(env, runs, move |_| match queue.lock().unwrap().try_recv() {
        Ok(feed) => Body::new(Fed(feed)),
        Err(_) => stream(End::Status("0")),
    });
    (app, feeds)
}

/// Moves the store's clock and tokio's paused clock together, letting renewals run.
async fn advance(env: &Env, by: Duration) {
    let step = Duration::from_millis(250);
    let mut left = by;
    while !left.is_zero() {
        env.advance(step);
        tokio::time::advance(step).await;
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        left = left.saturating_sub(step);
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_during_the_stream_is_aborted_however_long_it_flows() {
    let env = Env::new();
    let runs = Counter::default();
    let (app, tx, mut body) = streaming_call(&env, &runs).await;
    assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap().len(), 2 * LIMIT);
    // Ten leases long: renewal keeps the claim, so a retry never runs the call twice.
    for _ in 0..10 {
        assert_eq!(record(&env).await.state, RecordState::InFlight);
        assert_eq!(send(&app).await, (0, "10".to_owned()), "ABORTED while the stream flows");
        advance(&env, Duration::from_secs(3)).await;
        tx.send(Frame::data(Bytes::from_static(b"more"))).unwrap();
        assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap().as_ref(), b"more");
    }
    tx.send(Frame::trailers(status("0"))).unwrap();
    drop(tx);
    let rest = body.collect().await.unwrap();
    assert_eq!(rest.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(record(&env).await.state, RecordState::Completed);
    assert_eq!(send(&app).await, (0, "6".to_owned()));
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_stream_the_client_dropped_before_its_status_runs_again() {
    let env = Env::new();
    let runs = Counter::default();
    let (app, feeds) = fed_app(&env, &runs);
    let first = feed(&feeds);
    first.send(Frame::data(Bytes::from(vec![1; 2 * LIMIT]))).unwrap();
    let mut body = app.clone().oneshot(call()).await.unwrap().into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    until_state(&env, RecordState::Failed).await;
    let tx = feed(&feeds);
    for frame in [Frame::data(Bytes::from(vec![2; 2 * LIMIT])), Frame::trailers(status("0"))] {
        tx.send(frame).unwrap();
    }
    drop(tx);
    assert_eq!(send(&app).await, (2 * LIMIT, "0".to_owned()), "the retry ran the call again");
    assert_eq!(runs.get(), 2);
}

/// Queues a feed for the next run of a [`fed_app`] and returns its sender.
fn feed(feeds: &mpsc::UnboundedSender<mpsc::UnboundedReceiver<Frame<Bytes>>>) -> mpsc::UnboundedSender<Frame<Bytes>> {
    let (tx, rx) = mpsc::unbounded_channel();
    feeds.send(rx).unwrap();
    tx
}

/// A call whose handler has sent `2 * LIMIT` bytes, more than the layer buffers, so its
/// answer streams; the handler sends what the test gives `tx` next.
async fn streaming_call(env: &Env, runs: &Counter) -> (Router, mpsc::UnboundedSender<Frame<Bytes>>, Body) {
    let (app, feeds) = fed_app(env, runs);
    let tx = feed(&feeds);
    tx.send(Frame::data(Bytes::from(vec![1; 2 * LIMIT]))).unwrap();
    let body = app.clone().oneshot(call()).await.unwrap().into_body();
    (app, tx, body)
}

/// Reads data frames from `body` until `len` bytes came.
async fn read_data(body: &mut Body, len: usize) {
    let mut got = 0;
    while got < len {
        got += body.frame().await.unwrap().unwrap().into_data().unwrap().len();
    }
}

/// Lets every task that can run, run (no time passes).
async fn settle() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_body_dropped_while_its_status_is_written_does_not_run_the_call_twice() {
    // A client that went away while its stream's OK status was being written (the store out, `complete` resent) failed
    // the record: the retry ran the call a second time.
    let env = Env::new();
    let runs = Counter::default();
    let app = app(&env, &runs, |_| stream(End::Status("0")));
    env.store.fail_complete.store(true, Ordering::SeqCst);
    let mut body = app.clone().oneshot(call()).await.unwrap().into_body();
    read_data(&mut body, 3 * LIMIT).await;
    assert!(futures::poll!(body.frame()).is_pending(), "the trailers wait for the record");
    // The client's deadline passes while the store is out: it drops the call.
    drop(body);
    advance(&env, Duration::from_millis(500)).await;
    env.store.fail_complete.store(false, Ordering::SeqCst);
    advance(&env, Duration::from_secs(1)).await;
    assert_eq!(record(&env).await.state, RecordState::Completed, "the write outlived the body");
    assert_eq!(env.store.fails.load(Ordering::SeqCst), 0, "nothing marked the record failed");
    assert_eq!(send(&app).await, (0, "6".to_owned()), "ALREADY_EXISTS, not a second run");
    assert_eq!(runs.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_lease_is_renewed_while_the_final_status_is_written() {
    // The renewal stopped before the final `complete`: while the store refused it, the lease ran out, and a retry
    // reclaimed the record and ran the call a second time.
    let env = Env::new();
    let runs = Counter::default();
    let (app, tx, mut body) = streaming_call(&env, &runs).await;
    read_data(&mut body, 2 * LIMIT).await;
    // Before the first renewal: unrenewed, the lease ends three seconds after the claim.
    advance(&env, Duration::from_millis(750)).await;
    env.advance(Duration::from_millis(150));
    tokio::time::advance(Duration::from_millis(150)).await;
    env.store.fail_complete.store(true, Ordering::SeqCst);
    tx.send(Frame::trailers(status("0"))).unwrap();
    drop(tx);
    let client = tokio::spawn(body.collect());
    settle().await;
    // The store refuses the write past the end of that lease, within the retry window.
    advance(&env, Duration::from_millis(2250)).await;
    assert_eq!(send(&app).await, (0, "10".to_owned()), "ABORTED: the claim holds while its status is written");
    assert_eq!(runs.get(), 1);
    env.store.fail_complete.store(false, Ordering::SeqCst);
    advance(&env, Duration::from_millis(500)).await;
    let rest = client.await.unwrap().unwrap();
    let trailers = rest.trailers().unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    assert!(trailers.get("idempotent-stored").is_none(), "stored: {trailers:?}");
    assert_eq!(record(&env).await.state, RecordState::Completed);
    assert_eq!(send(&app).await, (0, "6".to_owned()));
    assert_eq!(runs.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_complete_that_landed_before_a_refused_renewal_counts_as_stored() {
    // A renewal refused because the final `complete` had already landed (extend moves only a lease in flight) read as a
    // lost lease: a stored status went out marked not stored.
    let env = Env::new();
    let runs = Counter::default();
    let (app, tx, mut body) = streaming_call(&env, &runs).await;
    read_data(&mut body, 2 * LIMIT).await;
    advance(&env, Duration::from_millis(750)).await;
    // The first `complete` lands but its answer is lost; the resends fail until the
    // renewal due one second after the claim has been refused.
    env.store.complete_answers_lost.store(1, Ordering::SeqCst);
    env.store.fail_complete.store(true, Ordering::SeqCst);
    tx.send(Frame::trailers(status("0"))).unwrap();
    drop(tx);
    let client = tokio::spawn(body.collect());
    settle().await;
    advance(&env, Duration::from_secs(1)).await;
    assert_eq!(record(&env).await.state, RecordState::Completed);
    env.store.fail_complete.store(false, Ordering::SeqCst);
    advance(&env, Duration::from_secs(1)).await;
    let rest = client.await.unwrap().unwrap();
    let trailers = rest.trailers().unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    assert!(trailers.get("idempotent-stored").is_none(), "the status was stored: {trailers:?}");
    assert_eq!(send(&app).await, (0, "6".to_owned()));
    assert_eq!(runs.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_stops_reading_lets_the_claim_lapse() {
    // A client that stopped reading (a half-open connection, no keepalive) kept the key claimed for ever: the lease was
    // renewed as long as the body existed, read or not.
    let env = Env::new();
    let runs = Counter::default();
    let (app, tx, mut body) = streaming_call(&env, &runs).await;
    read_data(&mut body, 2 * LIMIT).await;
    // The handler streams on; the client reads nothing for four leases.
    tx.send(Frame::data(Bytes::from_static(b"unread"))).unwrap();
    advance(&env, Duration::from_secs(4 * 3)).await;
    assert_eq!(send(&app).await, (3 * LIMIT, "0".to_owned()), "the lease lapsed: a retry reclaimed and ran the call");
    assert_eq!(runs.get(), 2);
    // The first client reads again: its call ends at once with an error, not with the
    // rest of a call whose record another attempt owns now.
    tx.send(Frame::trailers(status("0"))).unwrap();
    drop(tx);
    let rest = body.collect().await.unwrap();
    let trailers = rest.trailers().cloned().unwrap();
    assert!(rest.to_bytes().is_empty(), "nothing more after the claim lapsed");
    assert_eq!(trailers["grpc-status"], "10", "ABORTED");
    assert_eq!(trailers["idempotent-stored"], "false");
    settle().await;
    assert_eq!(record(&env).await.state, RecordState::Completed, "the lapsed claim's fail was fenced off");
    assert_eq!(send(&app).await, (0, "6".to_owned()));
    assert_eq!(runs.get(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_client_waiting_on_a_slow_stream_keeps_the_claim() {
    // A client waiting for the next message of a handler that sent nothing for several leases was taken for gone: the
    // claim lapsed under a live call.
    let env = Env::new();
    let runs = Counter::default();
    let (app, tx, body) = streaming_call(&env, &runs).await;
    let client = tokio::spawn(body.collect());
    settle().await;
    for _ in 0..4 {
        advance(&env, Duration::from_secs(3)).await;
        assert_eq!(send(&app).await, (0, "10".to_owned()), "ABORTED while the client waits");
    }
    tx.send(Frame::trailers(status("0"))).unwrap();
    drop(tx);
    let rest = client.await.unwrap().unwrap();
    assert_eq!(rest.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(record(&env).await.state, RecordState::Completed);
    assert_eq!(runs.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_status_that_could_not_be_stored_is_marked_in_the_trailers() {
    // A streamed status the store never took (an outage longer than the retries, a lost lease) reached the client
    // unmarked, unlike an HTTP response's `Idempotent-Stored: false`.
    for refusal in ["outage", "lease lost"] {
        let env = Env::new();
        let runs = Counter::default();
        let app = app(&env, &runs, |_| stream(End::Status("0")));
        match refusal {
            "outage" => env.store.fail_complete.store(true, Ordering::SeqCst),
            _ => {
                *env.store.complete_refusal.lock().unwrap() = Some(|id, token| StoreError::LeaseLost {
                    id,
                    presented: token,
                    current: Some(FencingToken(token.0 + 1)),
                });
            }
        }
        let client = tokio::spawn(app.clone().oneshot(call()));
        settle().await;
        let body = client.await.unwrap().unwrap().into_body();
        let client = tokio::spawn(body.collect());
        settle().await;
        // Past the retry window, one lease after the first try.
        advance(&env, Duration::from_secs(4)).await;
        let rest = client.await.unwrap().unwrap();
        let trailers = rest.trailers().cloned().unwrap_or_default();
        assert_eq!(rest.to_bytes().len(), 3 * LIMIT, "{refusal}");
        assert_eq!(trailers.get("grpc-status").map(|v| v.to_str().unwrap()), Some("0"), "{refusal}");
        assert_eq!(trailers.get(idem_http::IDEMPOTENT_STORED).map(|v| v.to_str().unwrap()), Some("false"), "{refusal}");
        assert_eq!(runs.get(), 1, "{refusal}");
    }
}

/// The body the layer returns stays `Send + Sync` for a `Send + Sync` inner body: the
/// claim a gRPC stream holds does not take that away.
#[test]
fn the_response_body_stays_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<idem_http::ResponseBody<http_body_util::Full<Bytes>>>();
}
