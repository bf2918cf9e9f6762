//! The decision table (`docs/decision-table.md#the-table`), row by row, through an axum
//! router (no sockets), plus the layer's other answers: safe methods, 413, 401, retention,
//! replay fidelity, the request extension and the endpoint scope.

use crate::common;

use std::time::Duration;

use common::{Counter, Env, Gate, Got, Script, Step, T0, app, post, send, start_and_crash};
use idem_core::{FencingToken, RecordState};
use idem_http::{IdempotencyLayer, MismatchStatus, MissingPrincipal};

const ORDERS: &str = "POST /v1/orders";
const LEASE_MS: i64 = 300_000;

fn layer(env: &Env) -> IdempotencyLayer {
    IdempotencyLayer::new(env.dyn_store())
}

fn body_json(got: &Got) -> serde_json::Value {
    serde_json::from_slice(&got.body).unwrap()
}

#[tokio::test]
async fn row_none_claims_runs_and_completes() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    let got = send(&app, &post("/v1/orders").key("k1").body("{}")).await;
    assert_eq!(got.status, 201);
    assert!(!got.replayed());
    assert_eq!(n.get(), 1);
    // T0 is 2027-01-15T08:00:00Z; the default retention is 24 h.
    assert_eq!(got.header("idempotency-key-expires"), Some("Sat, 16 Jan 2027 08:00:00 GMT"));
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.token, FencingToken::first_at(T0), "the first token of a record claimed at T0");
    assert_eq!(record.response.unwrap().status, 201);
}

#[tokio::test]
async fn row_in_flight_fresh_same_request_gets_409_with_retry_after() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    gate.started().await;

    // The same records through a layer whose cap is above the lease: Retry-After is then
    // the remaining lease itself.
    let uncapped = common::app(layer(&env).with_in_flight_retry_after(Duration::from_secs(3_600)), &n, &s);

    let busy = send(&app, &req).await;
    busy.problem(409, "in-flight");
    assert_eq!(busy.retry_after(), 2, "a short poll, capped at 2 s by default");
    assert!(busy.header("idempotency-key-expires").is_some());
    assert_eq!(send(&uncapped, &req).await.retry_after(), 300, "whole seconds until the lease ends");
    env.advance_ms(100_500);
    assert_eq!(send(&app, &req).await.retry_after(), 2);
    assert_eq!(send(&uncapped, &req).await.retry_after(), 200, "rounded up");
    env.advance_ms(LEASE_MS - 100_500 - 1);
    assert_eq!(send(&app, &req).await.retry_after(), 1, "at least 1 s while the lease is fresh");
    assert_eq!(send(&uncapped, &req).await.retry_after(), 1, "at least 1 s while the lease is fresh");
    env.advance_ms(1 - 1_500);
    assert_eq!(send(&app, &req).await.retry_after(), 2, "1.5 s left, rounded up, under the cap");
    let capped = common::app(layer(&env).with_in_flight_retry_after(Duration::from_millis(1_900)), &n, &s);
    assert_eq!(send(&capped, &req).await.retry_after(), 1, "the cap counts whole seconds, rounded down");
    let tiny = common::app(layer(&env).with_in_flight_retry_after(Duration::ZERO), &n, &s);
    assert_eq!(send(&tiny, &req).await.retry_after(), 1, "never below 1 s");

    gate.release();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn row_in_flight_fresh_different_request_is_a_mismatch() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    let app = app(layer(&env), &n, &s);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, &post("/v1/orders").key("k1").body("{\"a\":1}")).await }
    });
    gate.started().await;
    let other = send(&app, &post("/v1/orders").key("k1").body("{\"a\":2}")).await;
    other.problem(409, "mismatch");
    assert!(other.header("retry-after").is_none(), "a mismatch is never retried");
    gate.release();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn row_in_flight_expired_same_request_reclaims_and_winner_runs() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    let held = Gate::default();
    s.then(Step::Hold(gate)).then(Step::Hold(held.clone()));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    start_and_crash(&app, &req).await;
    assert_eq!(n.get(), 1);

    env.advance_ms(LEASE_MS);
    // The reclaimer runs (held on a gate), and a third request loses: 409 on the new lease.
    let winner = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    held.started().await;
    let loser = send(&app, &req).await;
    loser.problem(409, "in-flight");
    assert_eq!(loser.retry_after(), 2, "a fresh lease of 300 s, answered with the 2 s poll cap");
    held.release();
    let winner = winner.await.unwrap();
    assert_eq!(winner.status, 201);
    assert_eq!(body_json(&winner)["token"], FencingToken::first_at(T0).0 + 1, "the reclaim took the next token");
    assert_eq!(n.get(), 2);
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, winner.body);
}

#[tokio::test]
async fn row_in_flight_expired_different_request_is_a_mismatch() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Hold(Gate::default()));
    let app = app(layer(&env), &n, &s);
    start_and_crash(&app, &post("/v1/orders").key("k1").body("{\"a\":1}")).await;
    env.advance_ms(LEASE_MS + 1);
    send(&app, &post("/v1/orders").key("k1").body("{\"a\":2}")).await.problem(409, "mismatch");
    assert_eq!(n.get(), 1);
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(
        (record.state, record.token),
        (RecordState::InFlight, FencingToken::first_at(T0)),
        "the mismatch wrote nothing"
    );
}

#[tokio::test]
async fn row_completed_same_request_replays_status_headers_and_body() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = send(&app, &req).await;
    env.advance_ms(5_000);
    let replay = send(&app, &req).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    for h in ["location", "etag", "content-type", "x-request-id", "idempotency-key-expires"] {
        assert_eq!(replay.header(h), first.header(h), "{h}");
    }
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn row_completed_different_request_is_a_mismatch_and_changes_nothing() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    send(&app, &post("/v1/orders").key("k1").body("{\"a\":1}")).await;
    let before = env.record("tok-p", ORDERS, "k1").await.unwrap();
    let other = send(&app, &post("/v1/orders").key("k1").body("{\"a\":2}")).await;
    other.problem(409, "mismatch");
    assert!(!other.replayed());
    assert_eq!(env.record("tok-p", ORDERS, "k1").await.unwrap(), before);
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn row_failed_same_request_reclaims_and_runs_again() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Status(500));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    assert_eq!(send(&app, &req).await.status, 500);
    assert_eq!(env.record("tok-p", ORDERS, "k1").await.unwrap().state, RecordState::Failed);
    let retry = send(&app, &req).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(body_json(&retry)["token"], FencingToken::first_at(T0).0 + 1);
    assert_eq!(n.get(), 2);
}

#[tokio::test]
async fn row_failed_different_request_is_a_mismatch() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Status(500));
    let app = app(layer(&env), &n, &s);
    send(&app, &post("/v1/orders").key("k1").body("{\"a\":1}")).await;
    send(&app, &post("/v1/orders").key("k1").body("{\"a\":2}")).await.problem(409, "mismatch");
    assert_eq!(n.get(), 1);
    assert_eq!(env.record("tok-p", ORDERS, "k1").await.unwrap().state, RecordState::Failed);
}

#[tokio::test]
async fn mismatch_status_follows_the_layer_setting() {
    for (status, code) in [(MismatchStatus::UnprocessableContent, 422), (MismatchStatus::BadRequest, 400)] {
        let env = Env::new();
        let (n, s) = (Counter::default(), Script::default());
        let app = app(layer(&env).with_mismatch_status(status), &n, &s);
        send(&app, &post("/v1/orders").key("k1").body("a")).await;
        send(&app, &post("/v1/orders").key("k1").body("b")).await.problem(code, "mismatch");
    }
}

#[tokio::test]
async fn after_retention_the_key_starts_a_new_operation() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    send(&app, &req).await;
    env.advance_ms(24 * 3_600_000 - 1);
    assert!(send(&app, &req).await.replayed(), "still retained 1 ms before the end");
    env.advance_ms(1);
    let again = send(&app, &req).await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed());
    assert_eq!(n.get(), 2);
}

#[tokio::test]
async fn safe_methods_pass_through_untouched() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    for req in [
        common::Req::new(http::Method::GET, "/v1/orders").key("k1"),
        common::Req::new(http::Method::GET, "/v1/orders").key("k1"),
        common::Req::new(http::Method::GET, "/v1/orders").anonymous(),
        // Even an invalid key is none of the layer's business on a safe method.
        common::Req::new(http::Method::GET, "/v1/orders").key(" "),
        // QUERY (RFC 10008) is safe too: a keyed QUERY runs every time and is never stored.
        common::Req::new(http::Method::QUERY, "/v1/orders").key("k1").body("{}"),
        common::Req::new(http::Method::QUERY, "/v1/orders").key("k1").body("{}"),
    ] {
        let got = send(&app, &req).await;
        assert_eq!(got.status, 201);
        assert!(!got.replayed());
        assert!(got.header("idempotency-key-expires").is_none());
        assert_eq!(got.header("set-cookie").map(str::to_owned), Some(format!("session={}", n.get())));
    }
    assert_eq!(n.get(), 6);
    assert!(env.record("tok-p", "GET /v1/orders", "k1").await.is_none());
    assert!(env.record("tok-p", "QUERY /v1/orders", "k1").await.is_none());
}

#[tokio::test]
async fn oversized_request_body_gets_413_and_claims_nothing() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env).with_max_request_body(16), &n, &s);
    send(&app, &post("/v1/orders").key("k1").body("x".repeat(17))).await.problem(413, "body-too-large");
    // A declared Content-Length over the limit is refused before the body is read.
    let mut declared = post("/v1/orders").key("k2").body("small").build();
    declared.headers_mut().insert("content-length", http::HeaderValue::from_static("1000000"));
    let got = Got::read(tower::ServiceExt::oneshot(app.clone(), declared).await.unwrap()).await;
    got.problem(413, "body-too-large");
    assert_eq!(n.get(), 0);
    assert!(env.record("tok-p", ORDERS, "k1").await.is_none());
    assert!(env.record("tok-p", ORDERS, "k2").await.is_none());
    assert_eq!(send(&app, &post("/v1/orders").key("k1").body("x".repeat(16))).await.status, 201);
}

#[tokio::test]
async fn missing_principal_is_rejected_by_default_or_skipped_by_choice() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let strict = app(layer(&env), &n, &s);
    let req = post("/v1/orders").anonymous().key("k1").body("{}");
    let got = send(&strict, &req).await;
    got.problem(401, "missing-principal");
    assert_eq!(got.header("www-authenticate"), Some("Bearer"));
    send(&strict, &post("/v1/orders").token("").key("k1").body("{}")).await.problem(401, "missing-principal");
    assert_eq!(n.get(), 0);

    let lenient = app(layer(&env).with_missing_principal(MissingPrincipal::SkipIdempotency), &n, &s);
    let a = send(&lenient, &req).await;
    let b = send(&lenient, &req).await;
    assert_eq!((a.status, b.status), (http::StatusCode::CREATED, http::StatusCode::CREATED));
    assert!(!b.replayed());
    assert_ne!(a.body, b.body, "no shared anonymous bucket: both ran");
    assert_eq!(n.get(), 2);
}

#[tokio::test]
async fn large_bodies_are_compressed_and_replay_byte_exact() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Big(100_000));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = send(&app, &req).await;
    assert_eq!(first.body.len(), 100_000);
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert!(matches!(record.response.unwrap().body, idem_core::StoredBody::Lz4 { len: 100_000, .. }));
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn a_body_over_the_stored_limit_completes_and_replays_a_not_retained_problem() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Big(1_000));
    let app = app(layer(&env).with_policy(common::policy(|p| p.max_stored_body = 999)), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = send(&app, &req).await;
    assert_eq!((first.status.as_u16(), first.body.len()), (201, 1_000), "the first client gets the full body");
    let replay = send(&app, &req).await;
    let problem = replay.problem(201, "response-not-retained");
    assert!(problem["detail"].as_str().unwrap().contains("1000 bytes"));
    assert!(replay.replayed());
    assert_eq!(replay.header("location"), first.header("location"));
    assert!(replay.header("etag").is_none());
    assert_eq!(n.get(), 1, "a body too large to keep never makes the handler run twice");
}

#[tokio::test]
async fn the_handler_sees_its_claim_in_a_request_extension() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Status(503)).then(Step::Status(500));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    send(&app, &req).await;
    send(&app, &req).await;
    let third = send(&app, &req).await;
    assert_eq!(body_json(&third)["token"], FencingToken::first_at(T0).0 + 2, "one fencing token per claim");
}

#[tokio::test]
async fn the_endpoint_is_the_route_template_and_the_fingerprint_has_the_raw_path() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env), &n, &s);
    assert_eq!(send(&app, &post("/v1/workers/7/reboot").key("k1")).await.status, 201);
    assert!(env.record("tok-p", "POST /v1/workers/{id}/reboot", "k1").await.is_some());
    assert!(env.record("tok-p", "POST /v1/workers/7/reboot", "k1").await.is_none());
    // Same scope (the template), other resource: the fingerprint differs, so it is a
    // mismatch, never worker 7's replay.
    send(&app, &post("/v1/workers/8/reboot").key("k1")).await.problem(409, "mismatch");
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn lease_and_retention_follow_the_policy() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Hold(Gate::default()));
    let policy = common::policy(|p| (p.lease_ttl, p.retention) = (Duration::from_secs(5), Duration::from_secs(60)));
    let app = app(layer(&env).with_policy(policy), &n, &s);
    let req = post("/v1/orders").key("k1");
    start_and_crash(&app, &req).await;
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(record.lease_expires_at.0 - record.started_at.0, 5_000);
    assert_eq!(record.expires_at.0 - record.created_at.0, 60_000);
    env.advance_ms(4_999);
    assert_eq!(send(&app, &req).await.status, 409);
    env.advance_ms(1);
    assert_eq!(send(&app, &req).await.status, 201);
}

#[tokio::test]
async fn a_layer_wrapped_around_the_whole_router_scopes_by_concrete_path() {
    use tower::Layer;
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let router =
        app(IdempotencyLayer::new(env.dyn_store()).with_key_requirement(idem_http::KeyRequirement::Optional), &n, &s);
    // An outer layer over a second store sees the request before axum routes it.
    let outer_env = Env::new();
    let outer = layer(&outer_env).layer(router);
    let got =
        Got::read(tower::ServiceExt::oneshot(outer, post("/v1/workers/7/reboot").key("k1").build()).await.unwrap())
            .await;
    assert_eq!(got.status, 201);
    assert!(outer_env.record("tok-p", "POST /v1/workers/7/reboot", "k1").await.is_some());
    assert!(env.record("tok-p", "POST /v1/workers/{id}/reboot", "k1").await.is_some());
}

#[tokio::test]
async fn a_record_that_keeps_changing_gets_409_busy_after_three_rounds() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Status(500));
    let app = app(layer(&env), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    send(&app, &req).await;
    env.store.lose_reclaims.store(true, std::sync::atomic::Ordering::SeqCst);
    let got = send(&app, &req).await;
    got.problem(409, "busy");
    assert_eq!(got.retry_after(), 1);
    assert_eq!(env.store.reclaims.load(std::sync::atomic::Ordering::SeqCst), 3, "bounded: three rounds");
    assert_eq!(n.get(), 1, "the handler never ran without a claim");
}

#[tokio::test]
async fn a_handler_can_override_the_status_rule_for_one_response() {
    use idem_http::ResponseCaching;
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Override(409, ResponseCaching::Store))
        .then(Step::Override(200, ResponseCaching::DoNotStore))
        .then(Step::Override(503, ResponseCaching::Store));
    let app = app(layer(&env), &n, &s);
    // A final business 409 ("name taken"), stored on the handler's word.
    let first = send(&app, &post("/v1/orders").key("k1").body("{}")).await;
    let again = send(&app, &post("/v1/orders").key("k1").body("{}")).await;
    assert_eq!((first.status.as_u16(), again.status.as_u16()), (409, 409));
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // A 200 the handler does not want replayed: failed, so the retry runs.
    send(&app, &post("/v1/orders").key("k2").body("{}")).await;
    assert_eq!(env.record("tok-p", ORDERS, "k2").await.unwrap().state, RecordState::Failed);
    // A 5xx is never stored, even when asked.
    assert_eq!(send(&app, &post("/v1/orders").key("k3").body("{}")).await.status, 503);
    assert_eq!(env.record("tok-p", ORDERS, "k3").await.unwrap().state, RecordState::Failed);
    assert_eq!(n.get(), 3);
}
