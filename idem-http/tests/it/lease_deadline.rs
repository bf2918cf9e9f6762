//! A request's [`LeaseDeadline`] (set by an outer layer, as on AWS Lambda): the claim's
//! lease ends at the deadline, renewals never move it past it, and a request with no time
//! left is refused before any claim. A memory store on a manual clock; the first attempt
//! is "killed" at its deadline by leaking its future, so nothing it would write is written.

use crate::common;

use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use common::{Counter, Env, Gate, Got, Req, Script, Step, T0, app, policy, post};
use http::Request;
use idem_core::RecordState;
use idem_http::{IdempotencyLayer, LeaseDeadline};
use tower::ServiceExt;

const ORDERS: &str = "POST /v1/orders";

fn layer(env: &Env, lease_ttl: Duration) -> IdempotencyLayer {
    IdempotencyLayer::new(env.dyn_store()).with_policy(policy(|p| p.lease_ttl = lease_ttl))
}

/// `req`, as an invocation with `left` before the runtime stops it (`None`: already past).
fn invoked(req: &Req, left: Option<Duration>) -> Request<Body> {
    let now = SystemTime::now();
    let deadline = left.map_or(now - Duration::from_secs(1), |left| now + left);
    let mut request = req.build();
    request.extensions_mut().insert(LeaseDeadline::at(deadline));
    request
}

async fn send(app: &Router, request: Request<Body>) -> Got {
    Got::read(app.clone().oneshot(request).await.unwrap()).await
}

/// Like `common::start_and_crash`: polled until the handler holds the claim and waits,
/// then leaked, so no completion, no failure and no drop guard ever runs (the runtime
/// killed the invocation).
async fn start_and_kill(app: &Router, request: Request<Body>) {
    let mut fut = Box::pin(app.clone().oneshot(request));
    assert!(futures::poll!(fut.as_mut()).is_pending(), "the handler should be blocked");
    std::mem::forget(fut);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

async fn lease_end(env: &Env) -> i64 {
    let record = env.record("tok-p", ORDERS, "k1").await.expect("a record");
    assert_eq!(record.state, RecordState::InFlight);
    record.lease_expires_at.0 - T0.0
}

/// A handler killed at its invocation's deadline blocked every retry with 409 for the
/// whole lease TTL (5 min), though nothing was running any more.
#[tokio::test]
async fn a_retry_after_the_deadline_reclaims_at_once() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Hold(Gate::default()));
    let app = app(layer(&env, Duration::from_secs(300)), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    start_and_kill(&app, invoked(&req, Some(Duration::from_secs(2)))).await;
    // The time left is read on the system clock as the request enters: a few ms went by.
    let end = lease_end(&env).await;
    assert!((1_900..=2_000).contains(&end), "the lease ends at the deadline, not in 5 min: {end} ms");

    env.advance_ms(1_000);
    send(&app, invoked(&req, Some(Duration::from_secs(2)))).await.problem(409, "in-flight");
    env.advance_ms(1_000);
    let retry = send(&app, invoked(&req, Some(Duration::from_secs(2)))).await;
    assert_eq!(retry.status, 201, "the retry after the deadline reclaims and runs; body: {}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(n.get(), 2);
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

/// A renewal moved the lease of a handler past its deadline, so a retry after the runtime
/// killed it waited for the renewed lease.
#[tokio::test(start_paused = true)]
async fn renewal_never_moves_the_lease_past_the_deadline() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    // A 3 s lease, renewed every second, under a deadline 5 s ahead.
    let app = app(layer(&env, Duration::from_secs(3)), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = tokio::spawn({
        let (app, request) = (app.clone(), invoked(&req, Some(Duration::from_secs(5))));
        async move { send(&app, request).await }
    });
    gate.started().await;
    assert!(lease_end(&env).await <= 3_000);
    let mut renewed = false;
    for _ in 0..5 {
        advance(&env, Duration::from_secs(1)).await;
        let end = lease_end(&env).await;
        assert!(end <= 5_000, "a renewal moved the lease past the deadline: {end} ms");
        renewed |= end > 3_000;
    }
    assert!(renewed, "the lease was renewed up to the deadline");
    // Past the deadline the (still running) first attempt holds nothing: the retry runs.
    advance(&env, Duration::from_millis(500)).await;
    let retry = send(&app, invoked(&req, Some(Duration::from_secs(5)))).await;
    assert_eq!(retry.status, 201, "the retry reclaims at the deadline; body: {}", retry.text());
    assert_eq!(n.get(), 2);
    gate.release();
    first.await.unwrap();
}

/// A request whose deadline had already passed claimed its record and started a handler
/// the runtime was about to kill, blocking its own retry.
#[tokio::test]
async fn a_request_past_its_deadline_is_refused_before_any_claim() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env, Duration::from_secs(300)), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    for left in [None, Some(Duration::ZERO), Some(Duration::from_micros(500))] {
        let refused = send(&app, invoked(&req, left)).await;
        refused.problem(503, "deadline-passed");
        assert_eq!(refused.retry_after(), 1);
    }
    assert_eq!(n.get(), 0, "the handler never ran");
    assert!(env.record("tok-p", ORDERS, "k1").await.is_none(), "nothing was claimed");
    // The next invocation, with time left, runs.
    assert_eq!(send(&app, invoked(&req, Some(Duration::from_secs(2)))).await.status, 201);
    assert_eq!(n.get(), 1);
}
