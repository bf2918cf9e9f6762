//! Browser clients. CORS and rate-limit fields set by a layer inside the idempotency layer
//! were stored with the response and replayed to the next caller: the first caller's
//! origin in `Access-Control-Allow-Origin`, a quota from an earlier moment. And the
//! documented recipe (docs/operations.md, "Browser clients") must let a preflight through.

use crate::common;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post as route_post;
use common::{Counter, Env, Got, Req, post};
use http::header::{ACCESS_CONTROL_ALLOW_ORIGIN, AUTHORIZATION, CONTENT_TYPE, LOCATION, ORIGIN, RETRY_AFTER};
use http::{HeaderValue, Method, Request};
use idem_http::{IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_EXPIRES, IDEMPOTENT_REPLAYED, IdempotencyLayer};
use tower::ServiceExt;
use tower_http::cors::{AllowOrigin, CorsLayer};

/// The recipe: CORS outside the idempotency layer, so a preflight never reaches it and
/// every answer (a replay, a 409, a 503) carries the fields for the origin asking now.
fn cors() -> CorsLayer {
    let origins = [HeaderValue::from_static("https://a.example"), HeaderValue::from_static("https://b.example")];
    CorsLayer::new()
        .allow_origin(AllowOrigin::list(origins))
        .allow_methods([Method::POST])
        .allow_headers([AUTHORIZATION, CONTENT_TYPE, IDEMPOTENCY_KEY])
        .expose_headers([IDEMPOTENT_REPLAYED, IDEMPOTENCY_KEY_EXPIRES, RETRY_AFTER, LOCATION])
}

/// `POST /v1/things`, whose response already carries what an inner CORS or rate-limit
/// layer would add for the first caller.
fn things(env: &Env, runs: &Counter) -> Router {
    let runs = runs.clone();
    let handler = route_post(move || {
        runs.bump();
        async {
            let fields = [
                ("access-control-allow-origin", "https://a.example"),
                ("ratelimit", "limit=10, remaining=9, reset=60"),
                ("x-ratelimit-remaining", "9"),
                ("location", "/v1/things/1"),
            ];
            (StatusCode::CREATED, fields, "{}")
        }
    });
    Router::new().route("/v1/things", handler).layer(IdempotencyLayer::new(env.dyn_store()))
}

async fn send_from(app: &Router, origin: &'static str, req: &Req) -> Got {
    let mut req = req.build();
    req.headers_mut().insert(ORIGIN, HeaderValue::from_static(origin));
    Got::read(app.clone().oneshot(req).await.unwrap()).await
}

#[tokio::test]
async fn cors_and_rate_limit_fields_from_inside_the_layer_are_never_replayed() {
    let (env, runs) = (Env::new(), Counter::default());
    let app = things(&env, &runs);
    let req = post("/v1/things").key("k1").body("{}");
    let first = send_from(&app, "https://a.example", &req).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("ratelimit"), Some("limit=10, remaining=9, reset=60"), "the first caller gets them");
    let replay = send_from(&app, "https://b.example", &req).await;
    assert!(replay.replayed());
    assert_eq!(runs.get(), 1);
    for field in ["access-control-allow-origin", "ratelimit", "x-ratelimit-remaining"] {
        assert_eq!(replay.header(field), None, "{field} was replayed to another caller");
    }
    assert_eq!(replay.header("location"), Some("/v1/things/1"), "the operation's own fields are");
}

#[tokio::test]
async fn the_recipe_answers_a_preflight_and_labels_a_replay_for_the_origin_asking() {
    let (env, runs) = (Env::new(), Counter::default());
    let app = things(&env, &runs).layer(cors());
    let preflight = Request::builder()
        .method(Method::OPTIONS)
        .uri("/v1/things")
        .header(ORIGIN, "https://b.example")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization,content-type,idempotency-key")
        .body(axum::body::Body::empty())
        .unwrap();
    let got = Got::read(app.clone().oneshot(preflight).await.unwrap()).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("access-control-allow-origin"), Some("https://b.example"));
    assert!(got.header("access-control-allow-headers").is_some_and(|h| h.contains("idempotency-key")));
    assert_eq!(runs.get(), 0, "a preflight never reaches the handler");

    let req = post("/v1/things").key("k1").body("{}");
    assert_eq!(send_from(&app, "https://a.example", &req).await.status, 201);
    let replay = send_from(&app, "https://b.example", &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.headers.get_all(ACCESS_CONTROL_ALLOW_ORIGIN).iter().collect::<Vec<_>>(), ["https://b.example"]);
    let exposed = replay.header("access-control-expose-headers").unwrap_or_default();
    assert!(exposed.contains("idempotent-replayed") && exposed.contains("retry-after"), "{exposed}");
    // A refusal (here a mismatch) is labelled too, or the browser hides it from the page.
    let mismatch = send_from(&app, "https://b.example", &post("/v1/things").key("k1").body("{\"other\":1}")).await;
    assert!(mismatch.status.is_client_error());
    assert_eq!(mismatch.header("access-control-allow-origin"), Some("https://b.example"));
    assert_eq!(runs.get(), 1);
}
