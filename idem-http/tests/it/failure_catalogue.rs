//! The failure catalogue (`docs/failures.md`) at the HTTP level: each test's first doc line
//! names the failure it pins, and its last line the catalogue entry. Requests go through
//! `oneshot` on an axum router over a memory store on a manual clock; time moves only when
//! a test moves the clock.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use bytes::Bytes;
use common::{Counter, Env, Gate, Got, Script, Step, T0, app, eventually, post, put, send, start_and_crash};
use http_body_util::Full;
use idem_core::{FencingToken, RecordState};
use idem_http::{
    CompletionRetry, HandlerExecution, IdempotencyLayer, KeyRequirement, MissingPrincipal, Policy, StoreDeadlines,
    StoreFailureMode,
};
use std::sync::atomic::Ordering;
use tower::{Layer, ServiceExt};

const ORDERS: &str = "POST /v1/orders";
const LEASE_MS: i64 = 300_000;

fn layer(env: &Env) -> IdempotencyLayer {
    IdempotencyLayer::new(env.dyn_store())
}

fn json(got: &Got) -> serde_json::Value {
    serde_json::from_slice(&got.body).unwrap()
}

async fn state(env: &Env, key: &str) -> Option<RecordState> {
    env.record("tok-p", ORDERS, key).await.map(|r| r.state)
}

/// An in-flight claim with zero remaining time had no deadline, so retries were blocked until retention expired.
///
/// Pins `docs/failures.md#zero-lease-means-no-deadline`.
#[tokio::test]
async fn zero_lease_is_finite_and_a_retry_reclaims_after_it() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Hold(Gate::default()));
    let app = app(layer(&env).with_policy(common::policy(|p| p.lease_ttl = Duration::ZERO)), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    start_and_crash(&app, &req).await;
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(record.state, RecordState::InFlight);
    assert_eq!(record.lease_expires_at, record.started_at, "a zero lease expires at once, it is not 'no expiry'");
    assert_eq!(record.expires_at.0 - record.created_at.0, 24 * 3_600_000);

    env.advance(Duration::from_secs(1));
    let retry = send(&app, &req).await;
    assert_eq!(retry.status, 201, "the retry reclaims instead of waiting out the retention: {}", retry.text());
    assert_eq!(json(&retry)["token"], FencingToken::first_at(T0).0 + 1);
    assert_eq!(n.get(), 2);
}

/// A live in-flight record was reclaimed as an orphan by a second server, so two requests ran.
///
/// Pins `docs/failures.md#live-claim-taken-over-as-an-orphan`.
#[tokio::test]
async fn two_layers_sharing_one_store_never_run_twice() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    // Two API servers: two routers, two layers, one store.
    let server_a = app(layer(&env), &n, &s);
    let server_b = app(IdempotencyLayer::new(env.dyn_store()), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let a = tokio::spawn({
        let (app, req) = (server_a.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    gate.started().await;

    let b = send(&server_b, &req).await;
    b.problem(409, "in-flight");
    assert_eq!(b.retry_after(), 2, "the lease has 300 s left; the answer is the 2 s poll cap");
    // However close to its end, a lease that has not passed is never taken over.
    env.advance_ms(LEASE_MS - 1);
    let b = send(&server_b, &req).await;
    b.problem(409, "in-flight");
    assert_eq!(b.retry_after(), 1);

    gate.release();
    let a = a.await.unwrap();
    assert_eq!(a.status, 201);
    let b = send(&server_b, &req).await;
    assert!(b.replayed());
    assert_eq!(b.body, a.body);
    assert_eq!(n.get(), 1);
}

/// A rejected duplicate deleted the owner's in-flight claim, and a rejected mismatch deleted the completed record.
///
/// Pins `docs/failures.md#rejected-duplicate-deletes-the-record`.
#[tokio::test]
async fn rejected_duplicates_and_mismatches_never_touch_the_owners_record() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{\"b\":1}");
    let a = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    gate.started().await;
    let claimed = env.record("tok-p", ORDERS, "k1").await.unwrap();

    env.advance_ms(1_000);
    send(&app, &req).await.problem(409, "in-flight");
    env.advance_ms(1_000);
    send(&app, &req).await.problem(409, "in-flight");
    send(&app, &post("/v1/orders").key("k1").body("{\"b\":2}")).await.problem(409, "mismatch");
    assert_eq!(env.record("tok-p", ORDERS, "k1").await.unwrap(), claimed, "rejections wrote nothing");
    assert_eq!(env.store.fails.load(Ordering::SeqCst), 0, "no rejection tried to mark the record failed");

    gate.release();
    let a = a.await.unwrap();
    let completed = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(completed.state, RecordState::Completed);
    send(&app, &post("/v1/orders").key("k1").body("{\"b\":2}")).await.problem(409, "mismatch");
    assert_eq!(env.record("tok-p", ORDERS, "k1").await.unwrap(), completed);

    let e = send(&app, &req).await;
    assert!(e.replayed());
    assert_eq!(e.body, a.body);
    assert_eq!(n.get(), 1);
}

/// A handler panic left the record in flight, so every retry got 409 until the retention ended.
///
/// Pins `docs/failures.md#orphaned-claim-blocks-retries`.
#[tokio::test]
async fn panic_marks_the_record_failed_and_the_retry_runs() {
    for execution in [HandlerExecution::Detached, HandlerExecution::Inline] {
        let env = Env::new();
        let (n, s) = (Counter::default(), Script::default());
        s.then(Step::Panic);
        let app = app(layer(&env).with_handler_execution(execution), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        let joined = tokio::spawn({
            let (app, req) = (app.clone(), req.clone());
            async move { send(&app, &req).await }
        })
        .await;
        let panic = joined.unwrap_err().into_panic();
        assert_eq!(
            panic.downcast_ref::<String>().map(String::as_str),
            Some("handler panicked on purpose (call 1)"),
            "the layer re-raises the handler's own panic ({execution:?})"
        );
        assert_eq!(state(&env, "k1").await, Some(RecordState::Failed), "failed before the panic went on");

        env.advance_ms(1_000);
        let retry = send(&app, &req).await;
        assert_eq!(retry.status, 201);
        assert!(!retry.replayed());
        env.advance_ms(LEASE_MS + 1_000);
        let later = send(&app, &req).await;
        assert!(later.replayed());
        assert_eq!(later.body, retry.body);
        assert_eq!(n.get(), 2);
    }
}

/// A handler error (the service's `Err`) left the record in flight instead of marking it failed.
///
/// Pins `docs/failures.md#orphaned-claim-blocks-retries`.
#[tokio::test]
async fn service_error_marks_the_record_failed_and_the_retry_runs() {
    let env = Env::new();
    let n = Counter::default();
    // A plain tower service (no axum): its errors are real `Service::Error`s.
    let svc = tower::service_fn({
        let n = n.clone();
        move |_req: http::Request<Full<Bytes>>| {
            let call = n.bump();
            async move {
                if call == 1 {
                    Err(std::io::Error::other("database connection reset"))
                } else {
                    Ok(http::Response::builder().status(201).body(Full::new(Bytes::from("made"))).unwrap())
                }
            }
        }
    });
    let svc = layer(&env).layer(svc);
    let req = || {
        http::Request::post("/jobs/1")
            .header("authorization", "Bearer tok-p")
            .header("idempotency-key", "k1")
            .body(Full::new(Bytes::from("{}")))
            .unwrap()
    };
    let err = svc.clone().oneshot(req()).await.unwrap_err();
    assert_eq!(err.to_string(), "database connection reset");
    // Without an axum router the endpoint is the concrete path.
    let record = env.record("tok-p", "POST /jobs/1", "k1").await.unwrap();
    assert_eq!(record.state, RecordState::Failed);

    env.advance_ms(1_000);
    let retry = Got::read(svc.clone().oneshot(req()).await.unwrap()).await;
    assert_eq!((retry.status.as_u16(), &retry.body[..]), (201, &b"made"[..]));
    env.advance_ms(LEASE_MS + 1_000);
    let later = Got::read(svc.oneshot(req()).await.unwrap()).await;
    assert!(later.replayed());
    assert_eq!(n.get(), 2);
}

/// A streamed response bypassed the completion path, so its record was never completed.
///
/// Pins `docs/failures.md#orphaned-claim-blocks-retries`.
#[tokio::test]
async fn streamed_bodies_go_through_completion() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Stream(vec!["{\"parts\":", "[1,", "2,3]", "}"]));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = send(&app, &req).await;
    assert_eq!((first.status.as_u16(), first.text()), (201, "{\"parts\":[1,2,3]}"));
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.response.unwrap().body_bytes().unwrap().unwrap().as_ref(), first.body.as_ref());

    env.advance_ms(1_000);
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(n.get(), 1);
}

/// A streamed response that failed half-way left the record in flight (or stored half a body).
///
/// Pins `docs/failures.md#orphaned-claim-blocks-retries`.
#[tokio::test]
async fn a_stream_that_fails_marks_the_record_failed() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::BrokenStream);
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    send(&app, &req).await.problem(500, "response-body-failed");
    assert_eq!(state(&env, "k1").await, Some(RecordState::Failed));
    env.advance_ms(1_000);
    let retry = send(&app, &req).await;
    assert_eq!(retry.status, 201);
    assert_eq!(n.get(), 2);
}

/// A silently failed "complete" write left the record in flight for the whole retention window.
///
/// Pins `docs/failures.md#orphaned-claim-blocks-retries`.
#[tokio::test]
async fn a_failed_complete_blocks_retries_only_until_the_lease_ends() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    // Completion retries off: this pins what a lost completion costs without them
    // (`deadlines.rs` beside this module shows the retry preventing the second run).
    let mut no_retry = StoreDeadlines::default();
    no_retry.completion_retry = CompletionRetry::Off;
    let app = app(layer(&env).with_store_deadlines(no_retry), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    env.store.fail_complete.store(true, Ordering::SeqCst);
    let first = send(&app, &req).await;
    assert_eq!(first.status, 201, "the work is done, so the response is returned anyway");
    assert_eq!(state(&env, "k1").await, Some(RecordState::InFlight));
    env.store.fail_complete.store(false, Ordering::SeqCst);

    env.advance_ms(1_000);
    let busy = send(&app, &req).await;
    busy.problem(409, "in-flight");
    assert_eq!(busy.retry_after(), 2, "the lease has 299 s left; the answer is the 2 s poll cap");
    env.advance_ms(LEASE_MS);
    let retry = send(&app, &req).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed(), "after the lease, a retry reclaims and runs (documented)");
    assert_eq!(json(&retry)["token"], FencingToken::first_at(T0).0 + 1);
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
    assert_eq!(n.get(), 2);
}

/// A client disconnect cancelled the handler half-way and the retry repeated its side effects.
///
/// Under the default `HandlerExecution::Detached` the handler keeps running after the
/// client's response future is dropped: the record completes and the retry is a replay.
///
/// Pins `docs/failures.md#client-disconnect-cancels-the-handler`.
#[tokio::test]
async fn a_client_disconnect_does_not_cancel_a_detached_handler() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let task = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    gate.started().await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(state(&env, "k1").await, Some(RecordState::InFlight), "the handler still runs");
    env.advance_ms(1_000);
    send(&app, &req).await.problem(409, "in-flight");

    gate.release();
    eventually(|| async { state(&env, "k1").await == Some(RecordState::Completed) }).await;
    let retry = send(&app, &req).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed(), "the retry gets the outcome of the work the disconnected client started");
    assert_eq!(json(&retry)["call"], 1);
    assert_eq!(env.store.fails.load(Ordering::SeqCst), 0);
    assert_eq!(n.get(), 1);
}

/// A client that disconnected mid-handler left an orphaned in-flight record (`HandlerExecution::Inline`).
///
/// Pins `docs/failures.md#client-disconnect-cancels-the-handler`.
#[tokio::test]
async fn inline_a_dropped_request_future_marks_the_record_failed() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    let app = app(layer(&env).with_handler_execution(HandlerExecution::Inline), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let task = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    gate.started().await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    eventually(|| async { state(&env, "k1").await == Some(RecordState::Failed) }).await;

    env.advance_ms(1_000);
    assert_eq!(send(&app, &req).await.status, 201);
    assert_eq!(n.get(), 2);
}

/// A handler that allocates a worker: it counts its call, waits for `gate`, then allocates.
/// With `spawned` the allocation runs in a task of its own, as a `spawn_blocking` database
/// transaction does: cancelling the handler does not stop it.
fn allocating_app(layer: IdempotencyLayer, calls: &Counter, workers: &Counter, gate: &Gate, spawned: bool) -> Router {
    let (calls, workers, gate) = (calls.clone(), workers.clone(), gate.clone());
    let handler = move || {
        let (calls, workers, gate) = (calls.clone(), workers.clone(), gate.clone());
        async move {
            calls.bump();
            let allocate = async move {
                gate.hold().await;
                workers.bump()
            };
            let worker = if spawned { tokio::spawn(allocate).await.unwrap() } else { allocate.await };
            (http::StatusCode::CREATED, format!("{{\"worker\":{worker}}}"))
        }
    };
    Router::new().route("/v1/workers", axum::routing::post(handler)).layer(layer)
}

/// Awaits `task`, failing instead of hanging when it blocks (on a handler gate nobody
/// will release, i.e. the handler ran again). Yields, never sleeps.
async fn unblocked<T>(task: tokio::task::JoinHandle<T>) -> T {
    let t = &task;
    eventually(move || async move { t.is_finished() }).await;
    task.await.unwrap()
}

async fn workers_state(env: &Env, key: &str) -> Option<RecordState> {
    env.record("tok-p", "POST /v1/workers", key).await.map(|r| r.state)
}

/// A client disconnect cancelled the handler half-way and the retry repeated its side effects (a phantom worker).
///
/// The side effect comes after an await point; the client's response future is dropped
/// before it. Detached: it happens once across the dropped attempt and the retry.
///
/// Pins `docs/failures.md#client-disconnect-cancels-the-handler`.
#[tokio::test]
async fn a_side_effect_after_an_await_happens_once_across_a_disconnect_and_its_retry() {
    let env = Env::new();
    let (calls, workers, gate) = (Counter::default(), Counter::default(), Gate::default());
    let app = allocating_app(layer(&env), &calls, &workers, &gate, false);
    let req = post("/v1/workers").key("w1").body("{\"size\":\"large\"}");
    let client = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    gate.started().await;
    client.abort();
    assert!(client.await.unwrap_err().is_cancelled());
    assert_eq!(workers.get(), 0, "the client went away before the side effect");

    let busy = unblocked(tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    }))
    .await;
    busy.problem(409, "in-flight");
    assert_eq!(busy.retry_after(), 2, "the lease has 300 s left; the answer is the 2 s poll cap");
    assert_eq!(calls.get(), 1, "the retry did not run the handler while the first attempt works");

    gate.release();
    eventually(|| async { workers_state(&env, "w1").await == Some(RecordState::Completed) }).await;
    let replay = send(&app, &req).await;
    assert_eq!((replay.status.as_u16(), replay.text()), (201, "{\"worker\":1}"));
    assert!(replay.replayed());
    assert_eq!((calls.get(), workers.get()), (1, 1), "one handler run, one worker");
}

/// A cancelled inline handler left its spawned allocation running and the retry allocated again (a phantom worker).
///
/// Pins what `HandlerExecution::Inline` risks (documented) next to what `Detached`
/// prevents, with the same handler: its allocation outlives the cancelled handler future.
///
/// Pins `docs/failures.md#client-disconnect-cancels-the-handler`.
#[tokio::test]
async fn work_that_outlives_a_cancelled_handler_repeats_inline_but_not_detached() {
    for (execution, expected_workers) in [(HandlerExecution::Inline, 2), (HandlerExecution::Detached, 1)] {
        let env = Env::new();
        let (calls, workers, gate) = (Counter::default(), Counter::default(), Gate::default());
        let app = allocating_app(layer(&env).with_handler_execution(execution), &calls, &workers, &gate, true);
        let req = post("/v1/workers").key("w1").body("{}");
        let client = tokio::spawn({
            let (app, req) = (app.clone(), req.clone());
            async move { send(&app, &req).await }
        });
        gate.started().await;
        client.abort();
        assert!(client.await.unwrap_err().is_cancelled());
        gate.release();
        eventually(|| async { workers.get() == 1 }).await;
        eventually(|| async { workers_state(&env, "w1").await != Some(RecordState::InFlight) }).await;

        env.advance_ms(1_000);
        let retry = tokio::spawn({
            let (app, req) = (app.clone(), req.clone());
            async move { send(&app, &req).await }
        });
        if execution == HandlerExecution::Inline {
            // The record was marked failed, so the retry runs the handler again.
            gate.started().await;
            gate.release();
        }
        let retry = unblocked(retry).await;
        assert_eq!(retry.status, 201, "{execution:?}");
        assert_eq!(retry.replayed(), execution == HandlerExecution::Detached, "{execution:?}");
        assert_eq!(workers.get(), expected_workers, "{execution:?}");
        assert_eq!(calls.get(), expected_workers, "{execution:?}");
    }
}

/// A handler that panicked after its client went away left the record in flight until the lease ended.
///
/// Pins `docs/failures.md#orphaned-claim-blocks-retries`.
#[tokio::test]
async fn a_detached_handler_that_panics_after_a_disconnect_marks_the_record_failed() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::HoldThenPanic(gate.clone()));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let client = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    gate.started().await;
    client.abort();
    assert!(client.await.unwrap_err().is_cancelled());
    assert_eq!(state(&env, "k1").await, Some(RecordState::InFlight), "the handler runs on towards its panic");
    gate.release();
    eventually(|| async { state(&env, "k1").await == Some(RecordState::Failed) }).await;
    assert_eq!(env.store.fails.load(Ordering::SeqCst), 1);

    env.advance_ms(1_000);
    let retry = send(&app, &req).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(n.get(), 2);
}

/// A killed process left its claim in flight; retries must get 409 only until the lease TTL, not the retention.
///
/// Pins `docs/failures.md#orphaned-claim-blocks-retries`.
#[tokio::test]
async fn a_killed_process_frees_its_claim_when_the_lease_ends() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Hold(Gate::default()));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    start_and_crash(&app, &req).await;
    env.advance_ms(1_000);
    send(&app, &req).await.problem(409, "in-flight");
    env.advance_ms(LEASE_MS);
    assert_eq!(send(&app, &req).await.status, 201);
    assert_eq!(n.get(), 2);
}

/// Replay lost the status code, Location and ETag, or replayed per-exchange headers such as Set-Cookie.
///
/// Pins `docs/failures.md#replay-loses-status-headers-or-body`.
#[tokio::test]
async fn replay_keeps_status_body_and_entity_headers_and_drops_per_exchange_ones() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/tickets").key("k1").body("{\"title\":\"disk full\"}");
    let app = app.route(
        "/v1/tickets",
        axum::routing::post(|| async {
            (
                http::StatusCode::CREATED,
                [
                    ("location", "/tickets/42"),
                    ("etag", "\"t42-v1\""),
                    ("content-type", "application/json"),
                    ("set-cookie", "session=abc; HttpOnly"),
                    ("date", "Thu, 01 Jan 2026 00:00:00 GMT"),
                ],
                "{\"id\":42}",
            )
        })
        .layer(layer(&env)),
    );
    let first = send(&app, &req).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("set-cookie"), Some("session=abc; HttpOnly"), "the first client gets everything");
    let replay = send(&app, &req).await;
    assert_eq!(replay.status, 201, "a 201 replays as 201");
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), Some("/tickets/42"));
    assert_eq!(replay.header("etag"), Some("\"t42-v1\""));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert!(replay.replayed());
    assert_eq!(replay.header("set-cookie"), None);
    assert_eq!(replay.header("date"), None);
    assert_eq!(n.get(), 0, "the scripted handler is not on this route");
}

/// The handler ran again on the retry, so no replay happened at all.
///
/// Pins `docs/failures.md#replay-loses-status-headers-or-body`.
#[tokio::test]
async fn the_retry_is_a_replay_and_the_handler_count_stays_at_one() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    // Request ids are per exchange too; an operator adds them to the deny list.
    let mut policy = Policy::default();
    policy.header_deny_list.push("x-request-id".into());
    let app = app(layer(&env).with_policy(policy), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = send(&app, &req).await;
    assert_eq!(first.header("x-request-id"), Some("req-1"));
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("x-request-id"), None);
    assert_eq!(replay.header("location"), Some("/v1/orders/1"));
    assert_eq!(n.get(), 1);
}

/// A 5xx was cached, so the retry could never succeed (and a cached 503 came back as 500).
///
/// Pins `docs/failures.md#server-error-cached-and-replayed`.
#[tokio::test]
async fn a_5xx_is_never_stored_and_the_retry_runs() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Status(503));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = send(&app, &req).await;
    assert_eq!((first.status.as_u16(), first.header("retry-after")), (503, Some("2")), "the 503 itself goes through");
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(record.state, RecordState::Failed, "failed, not stuck in flight");
    assert!(record.response.is_none());
    let retry = send(&app, &req).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(n.get(), 2);
}

/// A cached 4xx came back with a normalised status instead of exactly what was stored.
///
/// Pins `docs/failures.md#server-error-cached-and-replayed`.
#[tokio::test]
async fn a_422_is_replayed_exactly() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Status(422));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = send(&app, &req).await;
    assert_eq!(first.status, 422);
    let replay = send(&app, &req).await;
    assert_eq!(replay.status, 422);
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert!(replay.replayed());
    assert_eq!(n.get(), 1);
}

/// Uncacheable 4xx (429, 409, 401...) were stored, pinning a transient refusal to the key.
///
/// Pins `docs/failures.md#server-error-cached-and-replayed`.
#[tokio::test]
async fn uncacheable_4xx_mark_the_record_failed() {
    for code in [401, 403, 408, 409, 423, 425, 429] {
        let env = Env::new();
        let (n, s) = (Counter::default(), Script::default());
        s.then(Step::Status(code));
        let app = app(layer(&env), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        assert_eq!(send(&app, &req).await.status.as_u16(), code);
        assert_eq!(state(&env, "k1").await, Some(RecordState::Failed), "{code}");
        assert_eq!(send(&app, &req).await.status, 201, "{code}");
        assert_eq!(n.get(), 2);
    }
}

/// A slow request whose lease expired overwrote (or released) the claim of the retry that took over.
///
/// Pins `docs/failures.md#stale-owner-overwrites-the-new-attempt`.
#[tokio::test]
async fn a_stale_owner_cannot_complete_over_the_new_attempt() {
    let env = Env::new();
    let (n, s, slow, retry_gate) = (Counter::default(), Script::default(), Gate::default(), Gate::default());
    s.then(Step::Hold(slow.clone())).then(Step::Hold(retry_gate.clone()));
    let app = app(layer(&env).with_policy(common::policy(|p| p.lease_ttl = Duration::from_secs(1))), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let a = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    slow.started().await;
    env.advance_ms(1_500);
    let b = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    retry_gate.started().await;
    // t = 2 s: A finishes while B (lease until 2.5 s) is still running.
    env.advance_ms(500);
    slow.release();
    let a = a.await.unwrap();
    assert_eq!(a.status, 201, "the stale owner's client still gets its response");
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(
        (record.state, record.token),
        (RecordState::InFlight, FencingToken::first_at(T0).next()),
        "A's complete was fenced off"
    );
    // t = 2.1 s: C finds B's claim intact, not A's response.
    env.advance_ms(100);
    send(&app, &req).await.problem(409, "in-flight");
    retry_gate.release();
    let b = b.await.unwrap();
    let c = send(&app, &req).await;
    assert!(c.replayed());
    assert_eq!(c.body, b.body, "the record holds B's response, not A's");
    assert_eq!(n.get(), 2);
}

/// Two concurrent first requests: the loser got a 5xx, or both ran.
///
/// Pins `docs/failures.md#concurrent-first-requests-both-run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_requests_run_the_handler_once() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (app, req, barrier) = (app.clone(), req.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                send(&app, &req).await
            })
        })
        .collect();
    let mut ran = 0;
    for t in tasks {
        let got = t.await.unwrap();
        match got.status.as_u16() {
            201 if !got.replayed() => ran += 1,
            201 => {}
            409 => {
                got.problem(409, "in-flight");
            }
            other => panic!("a loser got {other}: {}", got.text()),
        }
    }
    assert_eq!((ran, n.get()), (1, 1));
}

/// Two concurrent first requests while the winner is still running: the loser must get 409 busy, never 5xx.
///
/// Pins `docs/failures.md#concurrent-first-requests-both-run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losers_of_a_held_claim_get_409_busy() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..8 {
        let (app, req, barrier, tx) = (app.clone(), req.clone(), barrier.clone(), tx.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            tx.send(send(&app, &req).await).unwrap();
        });
    }
    // While the winner is held, every other request must come back, and as 409 busy.
    for _ in 0..7 {
        rx.recv().await.unwrap().problem(409, "in-flight");
    }
    gate.release();
    let winner = rx.recv().await.unwrap();
    assert_eq!(winner.status, 201);
    assert!(!winner.replayed());
    assert_eq!(n.get(), 1);
}

/// Keys were not scoped per endpoint, so another endpoint's response was replayed.
///
/// Pins `docs/failures.md#key-shared-across-endpoints`.
#[tokio::test]
async fn the_same_key_on_different_endpoints_runs_both() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    let project = send(&app, &post("/v1/projects").key("k1").body("{\"name\":\"p\"}")).await;
    let application = send(&app, &post("/v1/applications").key("k1").body("{\"name\":\"a\"}")).await;
    assert_eq!((project.status.as_u16(), application.status.as_u16()), (201, 201));
    assert!(!application.replayed());
    assert_eq!(json(&application)["path"], "/v1/applications", "never the project's response");
    assert_eq!(n.get(), 2);

    // Variant: one route template, two resources. The scope is the template (documented), the
    // fingerprint has the raw path, so the second is a mismatch: it never gets ticket 1's response.
    send(&app, &put("/tickets/1").key("k2").body("{}")).await;
    let other = send(&app, &put("/tickets/2").key("k2").body("{}")).await;
    other.problem(409, "mismatch");
    assert_eq!(n.get(), 3);
}

/// Keys were not scoped per principal, so one user got another's response or blocked their key.
///
/// Pins `docs/failures.md#key-shared-across-principals`.
#[tokio::test]
async fn the_same_key_from_two_principals_runs_both_and_leaks_nothing() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    let app = app(layer(&env), &n, &s);
    let p = send(&app, &post("/v1/orders").token("tok-p").key("k1").body("{}")).await;
    let q = send(&app, &post("/v1/orders").token("tok-q").key("k1").body("{}")).await;
    assert_eq!((p.status.as_u16(), q.status.as_u16()), (201, 201));
    assert!(!q.replayed());
    assert_ne!(q.body, p.body);
    assert_eq!(n.get(), 2);

    // Variant: Q holds k2 in flight; P is not blocked by it.
    s.then(Step::Hold(gate.clone()));
    let q = tokio::spawn({
        let app = app.clone();
        async move { send(&app, &post("/v1/orders").token("tok-q").key("k2").body("{}")).await }
    });
    gate.started().await;
    let p = send(&app, &post("/v1/orders").token("tok-p").key("k2").body("{}")).await;
    assert_eq!(p.status, 201);
    gate.release();
    assert_eq!(q.await.unwrap().status, 201);
    assert_eq!(n.get(), 4);

    // Variant: no principal. Default: 401. Documented alternative: run without idempotency.
    let anon = post("/v1/orders").anonymous().key("k1").body("{}");
    send(&app, &anon).await.problem(401, "missing-principal");
    let skip = common::app(layer(&env).with_missing_principal(MissingPrincipal::SkipIdempotency), &n, &s);
    let a = send(&skip, &anon).await;
    let b = send(&skip, &anon).await;
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.body, b.body);
    assert_eq!(n.get(), 6);
}

/// With the key optional, keyless requests shared one record and got the first response.
///
/// Pins `docs/failures.md#missing-or-blank-key-shares-a-record`.
#[tokio::test]
async fn keyless_requests_run_and_store_nothing_and_bad_keys_are_400() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env).with_key_requirement(KeyRequirement::Optional), &n, &s);
    let a = send(&app, &post("/v1/orders").body("{}")).await;
    let b = send(&app, &post("/v1/orders").body("{}")).await;
    assert_eq!((a.status.as_u16(), b.status.as_u16()), (201, 201));
    assert_ne!(a.body, b.body);
    assert!(!a.replayed() && !b.replayed());
    assert!(a.header("idempotency-key-expires").is_none(), "nothing was stored");
    assert_eq!(n.get(), 2);

    for blank in ["", "   ", "\"\"", "\" K\""] {
        send(&app, &post("/v1/orders").key(blank).body("{}")).await.problem(400, "invalid-idempotency-key");
    }
    for key in ["注文-🙂", "\u{e9}", "e\u{301}"] {
        send(&app, &post("/v1/orders").key(key).body("{}")).await.problem(400, "invalid-idempotency-key");
    }
    send(&app, &post("/v1/orders").key("k1").key("k2").body("{}")).await.problem(400, "duplicate-idempotency-key");
    assert_eq!(n.get(), 2);
    for key in ["K", "k1", "k2"] {
        assert!(env.record("tok-p", ORDERS, key).await.is_none(), "{key}: a rejected request stored nothing");
    }

    // Field whitespace (RFC 9110 §5.5 OWS) is not part of the value; whitespace inside is
    // refused above. So " K" on the wire is the key "K", the same as what hyper delivers.
    let k = send(&app, &post("/v1/orders").key("K").body("{}")).await;
    let spaced = send(&app, &post("/v1/orders").key(" K").body("{}")).await;
    assert!(spaced.replayed());
    assert_eq!(spaced.body, k.body);
}

/// JSON key order or whitespace changed the fingerprint; in raw mode (the default) that must be a mismatch, not a merge.
///
/// Pins `docs/failures.md#json-formatting-changes-the-fingerprint`.
#[tokio::test]
async fn raw_mode_treats_every_non_identical_body_as_a_mismatch() {
    let pairs = [
        (r#"{"a":1,"b":2}"#, r#"{"b":2, "a":1}"#),
        (r#"{"a":1,"b":2}"#, "{\n  \"a\": 1,\n  \"b\": 2\n}"),
        (r#"{"x":[1,2]}"#, r#"{"x":[2,1]}"#),
        (r#"{"a":null}"#, r#"{}"#),
        ("", "{}"),
        ("{}", "null"),
    ];
    for (i, (first, second)) in pairs.into_iter().enumerate() {
        let env = Env::new();
        let (n, s) = (Counter::default(), Script::default());
        let app = app(layer(&env), &n, &s);
        let key = format!("k{i}");
        send(&app, &post("/v1/orders").key(&key).body(first)).await;
        send(&app, &post("/v1/orders").key(&key).body(second)).await.problem(409, "mismatch");
        assert!(send(&app, &post("/v1/orders").key(&key).body(first)).await.replayed(), "byte-identical replays");
        assert_eq!(n.get(), 1);
    }
}

/// Store outage: the handler ran without a claim when the store was down (must fail closed by default).
///
/// Pins `docs/failures.md#store-unavailable`.
#[tokio::test]
async fn store_outage_fails_closed_with_503_and_never_runs_the_handler() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    env.store.fail_all.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        let got = send(&app, &post("/v1/orders").key("k1").body("{}")).await;
        got.problem(503, "store-unavailable");
        assert_eq!(got.retry_after(), 1);
    }
    assert_eq!(n.get(), 0);
    env.store.fail_all.store(false, Ordering::SeqCst);
    assert_eq!(send(&app, &post("/v1/orders").key("k1").body("{}")).await.status, 201);
    assert_eq!(n.get(), 1);
}

/// Store outage, fail-open: an operator who chose fail-open gets the handler run, unprotected.
///
/// Pins `docs/failures.md#store-unavailable`.
#[tokio::test]
async fn store_outage_fail_open_runs_the_handler_unprotected() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env).with_store_failure_mode(StoreFailureMode::FailOpen), &n, &s);
    env.store.fail_all.store(true, Ordering::SeqCst);
    let a = send(&app, &post("/v1/orders").key("k1").body("{}")).await;
    let b = send(&app, &post("/v1/orders").key("k1").body("{}")).await;
    assert_eq!((a.status.as_u16(), b.status.as_u16()), (201, 201));
    assert!(!b.replayed());
    assert!(a.header("idempotency-key-expires").is_none());
    assert_eq!(n.get(), 2);
}
