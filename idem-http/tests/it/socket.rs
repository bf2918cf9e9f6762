//! End to end over a real TCP socket with a real HTTP client (reqwest over hyper): what a
//! client on the wire sees of create, replay, mismatch, in flight and a missing key.

use crate::common;

use common::{Counter, Env, Gate, Script, Step, app};
use idem_http::IdempotencyLayer;

async fn serve(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

#[tokio::test]
async fn create_replay_mismatch_in_flight_and_missing_key_over_a_socket() {
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Created).then(Step::Hold(gate.clone()));
    let base = serve(app(IdempotencyLayer::new(env.dyn_store()), &n, &s)).await;
    let client = reqwest::Client::new();
    let create = |key: &str, body: &'static str| {
        client
            .post(format!("{base}/v1/orders"))
            .bearer_auth("tok-p")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body)
    };

    let first = create("k1", "{\"size\":\"large\"}").send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("set-cookie").is_some());
    let location = first.headers()["location"].clone();
    let first_body = first.bytes().await.unwrap();

    let replay = create("k1", "{\"size\":\"large\"}").send().await.unwrap();
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["location"], location);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert!(replay.headers().get("set-cookie").is_none());
    assert_ne!(replay.headers()["date"], "Thu, 01 Jan 2026 00:00:00 GMT", "the server's own Date, not the stored one");
    assert_eq!(replay.bytes().await.unwrap(), first_body);

    let other = create("k1", "{\"size\":\"small\"}").send().await.unwrap();
    assert_eq!(other.status(), 409);
    assert_eq!(other.headers()["content-type"], "application/problem+json");
    let problem: serde_json::Value = other.json().await.unwrap();
    assert_eq!(problem["type"], idem_http::ProblemKind::Mismatch.type_uri());

    let held = tokio::spawn(create("k2", "{}").send());
    gate.started().await;
    let busy = create("k2", "{}").send().await.unwrap();
    assert_eq!(busy.status(), 409);
    assert_eq!(busy.headers()["retry-after"], "2", "a 300 s lease, answered with the 2 s poll cap");
    gate.release();
    assert_eq!(held.await.unwrap().unwrap().status(), 201);

    let keyless = client.post(format!("{base}/v1/orders")).bearer_auth("tok-p").body("{}").send().await.unwrap();
    assert_eq!(keyless.status(), 400);
    assert_eq!(keyless.headers()["content-type"], "application/problem+json");
    assert_eq!(n.get(), 2);
}
