//! Stored headers and retry hints. The deny list silently replaced its defaults (one extra
//! name started storing `Set-Cookie`); headers a response's `Connection` field names were
//! stored and replayed; a 303 after a durable change was re-run by its retry; and SDK
//! retry loops, which retry every 409, kept retrying a mismatch because no answer said
//! not to.

use crate::common;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post as route_post;
use common::{Counter, Env, Gate, Script, Step, app, post, send};
use idem_http::{IdempotencyLayer, RetryHints, StoreFailureMode};
use std::sync::atomic::Ordering;

fn layer(env: &Env) -> IdempotencyLayer {
    IdempotencyLayer::new(env.dyn_store())
}

/// `POST /v1/things`: 201 with a cookie, a per-hop header named by `Connection`, and an id.
fn header_app(layer: IdempotencyLayer, runs: &Counter) -> Router {
    let runs = runs.clone();
    Router::new()
        .route(
            "/v1/things",
            route_post(move || {
                let runs = runs.clone();
                async move {
                    runs.bump();
                    (
                        StatusCode::CREATED,
                        [
                            ("set-cookie", "session=abc"),
                            ("connection", "x-hop, keep-alive"),
                            ("x-hop", "only-for-the-next-hop"),
                            ("x-request-id", "r-1"),
                            ("etag", "\"v1\""),
                        ],
                        "{}",
                    )
                }
            }),
        )
        .layer(layer)
}

#[tokio::test]
async fn the_deny_list_extends_the_defaults_and_connection_named_headers_are_dropped() {
    let env = Env::new();
    let runs = Counter::default();
    let deny = common::policy(|p| p.header_deny_list.push("X-Request-Id".into()));
    let app = header_app(layer(&env).with_policy(deny), &runs);
    let req = post("/v1/things").key("k1").body("{}");
    let first = send(&app, &req).await;
    assert_eq!(first.header("set-cookie"), Some("session=abc"), "the first client gets every header");
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("set-cookie"), None, "a default stays denied after adding a name");
    assert_eq!(replay.header("x-request-id"), None);
    assert_eq!(replay.header("x-hop"), None, "named by Connection: not stored");
    assert_eq!(replay.header("etag"), Some("\"v1\""));
    assert_eq!(runs.get(), 1);

    // Replacing the list drops the defaults.
    let replaced = common::policy(|p| p.header_deny_list = vec!["x-request-id".into()]);
    let app = header_app(layer(&env).with_policy(replaced), &runs);
    let req = post("/v1/things").key("k2").body("{}");
    send(&app, &req).await;
    let replay = send(&app, &req).await;
    assert_eq!(replay.header("set-cookie"), Some("session=abc"));
}

#[tokio::test]
async fn a_303_after_a_durable_change_is_replayed_and_other_redirects_run_again() {
    let env = Env::new();
    for (status, replayed) in [(303u16, true), (302, false), (307, false), (301, false)] {
        let runs = Counter::default();
        let r = runs.clone();
        let app = Router::new()
            .route(
                "/v1/things",
                route_post(move || {
                    let r = r.clone();
                    async move {
                        r.bump();
                        (StatusCode::from_u16(status).unwrap(), [("location", "/v1/things/7")], "")
                    }
                }),
            )
            .layer(layer(&env));
        let req = post("/v1/things").key(&format!("k-{status}")).body("{}");
        send(&app, &req).await;
        let retry = send(&app, &req).await;
        assert_eq!(retry.status.as_u16(), status);
        assert_eq!(retry.replayed(), replayed, "{status}");
        assert_eq!(retry.header("location"), Some("/v1/things/7"));
        assert_eq!(runs.get(), if replayed { 1 } else { 2 }, "{status}");
    }
}

#[tokio::test]
async fn never_retry_answers_say_false_and_retryable_ones_say_true() {
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
    let in_flight = send(&app, &req).await;
    in_flight.problem(409, "in-flight");
    assert_eq!(in_flight.header("x-should-retry"), Some("true"));
    assert_eq!(in_flight.header("stripe-should-retry"), None, "Stripe's header is opt-in");
    gate.release();
    let done = first.await.unwrap();
    assert_eq!(done.header("x-should-retry"), None, "the handler's own response is not marked");

    let mismatch = send(&app, &post("/v1/orders").key("k1").body(r#"{"other":1}"#)).await;
    mismatch.problem(409, "mismatch");
    assert_eq!(mismatch.header("x-should-retry"), Some("false"));
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("x-should-retry"), None, "a replay is the handler's response");

    let no_key = send(&app, &post("/v1/orders").body("{}")).await;
    no_key.problem(400, "missing-idempotency-key");
    assert_eq!(no_key.header("x-should-retry"), Some("false"));

    env.store.fail_all.store(true, Ordering::SeqCst);
    let down = send(&app, &post("/v1/orders").key("k2").body("{}")).await;
    down.problem(503, "store-unavailable");
    assert_eq!(down.header("x-should-retry"), Some("true"));
}

#[tokio::test]
async fn retry_hints_are_configurable() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let mut both = RetryHints::default();
    both.stripe_should_retry = true;
    let stripe = app(layer(&env).with_retry_hints(both), &n, &s);
    send(&stripe, &post("/v1/orders").key("k1").body("{}")).await;
    let mismatch = send(&stripe, &post("/v1/orders").key("k1").body("[]")).await;
    assert_eq!(mismatch.header("x-should-retry"), Some("false"));
    assert_eq!(mismatch.header("stripe-should-retry"), Some("false"));

    let mut none = RetryHints::default();
    none.x_should_retry = false;
    let quiet = app(layer(&env).with_retry_hints(none), &n, &s);
    let mismatch = send(&quiet, &post("/v1/orders").key("k1").body("[]")).await;
    mismatch.problem(409, "mismatch");
    assert_eq!((mismatch.header("x-should-retry"), mismatch.header("stripe-should-retry")), (None, None));

    // FailOpen does not change the hints of the answers it still makes.
    let open = app(layer(&env).with_store_failure_mode(StoreFailureMode::FailOpen), &n, &s);
    let mismatch = send(&open, &post("/v1/orders").key("k1").body("[]")).await;
    assert_eq!(mismatch.header("x-should-retry"), Some("false"));
}
