//! `IdempotencyMiddleware` in a `reqwest-middleware` stack with `reqwest-retry` and
//! `reqwest-tracing`, against a real axum server behind idem-http on loopback: one key
//! per logical operation across every retry, `Retry-After` waited out, no retry of a
//! mismatch or of `x-should-retry: false`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::routing::post;
use idem_client::OperationKey;
use idem_client::middleware::{IdempotencyMiddleware, retry_transient};
use idem_core::MemoryStore;
use idem_http::{IdempotencyLayer, MismatchStatus};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_retry::policies::ExponentialBackoff;

/// What the server saw of each request, outside the idempotency layer: arrival time,
/// key, and the status and `Retry-After` it answered.
#[derive(Clone, Debug)]
struct Seen {
    at: Instant,
    key: Option<String>,
    status: u16,
    retry_after: Option<u64>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// Serves `app` behind idem-http (memory store, bearer principal) and a recorder.
async fn serve(app: Router, layer: IdempotencyLayer) -> (String, Log) {
    let log: Log = Arc::default();
    let l = log.clone();
    let app = app.layer(layer).layer(axum::middleware::from_fn(move |req: Request, next: Next| {
        let l = l.clone();
        async move {
            let at = Instant::now();
            let key = req.headers().get("idempotency-key").map(|v| v.to_str().unwrap_or("?").to_owned());
            let res = next.run(req).await;
            let retry_after =
                res.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
            l.lock().unwrap().push(Seen { at, key, status: res.status().as_u16(), retry_after });
            res
        }
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), log)
}

fn layer() -> IdempotencyLayer {
    IdempotencyLayer::new(Arc::new(MemoryStore::new()))
}

/// The stack under test: tracing outermost, then reqwest-retry (fast backoff, so only a
/// honoured `Retry-After` can make an attempt wait a second), then ours.
fn client(max_retries: u32) -> ClientWithMiddleware {
    let backoff = ExponentialBackoff::builder()
        .retry_bounds(Duration::from_millis(1), Duration::from_millis(5))
        .build_with_max_retries(max_retries);
    ClientBuilder::new(reqwest::Client::new())
        .with(reqwest_tracing::TracingMiddleware::default())
        .with(retry_transient(backoff))
        .with(IdempotencyMiddleware::default())
        .build()
}

#[tokio::test]
async fn one_key_across_reqwest_retry_retries_and_a_new_key_per_operation() {
    //! A middleware that made its key per attempt would give each retry a new record and
    //! run the handler once per attempt as a new operation.
    let fails = Arc::new(Mutex::new(2));
    let f = fails.clone();
    let app = Router::new().route(
        "/w",
        post(move || {
            let f = f.clone();
            async move {
                let mut left = f.lock().unwrap();
                if *left > 0 {
                    *left -= 1;
                    StatusCode::SERVICE_UNAVAILABLE.into_response()
                } else {
                    (StatusCode::CREATED, "made").into_response()
                }
            }
        }),
    );
    let (base, log) = serve(app, layer()).await;
    let client = client(5);
    let res = client.post(format!("{base}/w")).bearer_auth("t").body("{}").send().await.unwrap();
    assert_eq!(res.status(), 201);
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.iter().map(|s| s.status).collect::<Vec<_>>(), [503, 503, 201]);
    let key = seen[0].key.clone().expect("a key on the first attempt");
    assert!(seen.iter().all(|s| s.key.as_deref() == Some(key.as_str())), "{seen:?}");

    // The next logical operation gets a key of its own; a caller's key is used as given.
    let res = client.post(format!("{base}/w")).bearer_auth("t").body("{}").send().await.unwrap();
    assert_eq!(res.status(), 201);
    let mine = OperationKey::generate();
    let res =
        client.post(format!("{base}/w")).bearer_auth("t").body("{}").with_extension(mine.clone()).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 5);
    assert_ne!(seen[3].key.as_deref(), Some(key.as_str()), "a second operation reused the key");
    assert_eq!(seen[4].key.as_deref(), Some(mine.as_str()));
    // A GET is safe: no key.
    let _ = client.get(format!("{base}/w")).send().await.unwrap();
    assert_eq!(log.lock().unwrap()[5].key, None);
}

#[tokio::test]
async fn an_in_flight_409_is_retried_after_its_retry_after_then_replays() {
    //! reqwest-retry's own strategy stops at a 409 and its backoff ignores Retry-After: a
    //! client that retried at once would hammer an operation still in flight.
    let started = Arc::new(tokio::sync::Notify::new());
    let s = started.clone();
    let app = Router::new().route(
        "/slow",
        post(move || {
            let s = s.clone();
            async move {
                s.notify_one();
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                (StatusCode::CREATED, "made slowly")
            }
        }),
    );
    let (base, log) = serve(app, layer()).await;
    let key = OperationKey::generate();
    // The first attempt, from elsewhere, holds the claim while the handler sleeps.
    let first = {
        let (url, key) = (format!("{base}/slow"), key.as_str().to_owned());
        tokio::spawn(async move {
            reqwest::Client::new().post(url).bearer_auth("t").header("idempotency-key", key).body("{}").send().await
        })
    };
    started.notified().await;
    let res = client(10)
        .post(format!("{base}/slow"))
        .bearer_auth("t")
        .body("{}")
        .with_extension(key.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(res.headers().get("idempotent-replayed").map(|v| v.as_bytes()), Some(&b"true"[..]));
    assert_eq!(first.await.unwrap().unwrap().status(), 201);

    let mut seen = log.lock().unwrap().clone();
    seen.sort_by_key(|s| s.at);
    // The middleware client's attempts: the 409s and the replay that followed them.
    let mine: Vec<&Seen> = seen.iter().skip(1).collect();
    assert!(mine[0].status == 409, "{seen:?}");
    for pair in mine.windows(2) {
        let wait = pair[0].retry_after.expect("an in-flight 409 carries Retry-After");
        let gap = pair[1].at - pair[0].at;
        assert!(gap >= Duration::from_secs(wait), "retried after {gap:?}, server asked for {wait} s: {seen:?}");
    }
    assert_eq!(mine.last().unwrap().status, 201);
}

#[tokio::test]
async fn a_422_mismatch_is_never_retried() {
    //! A client that retried a mismatch would repeat a request the server will never
    //! accept under that key.
    let app = Router::new().route("/w", post(|| async { (StatusCode::CREATED, "made") }));
    let (base, log) = serve(app, layer().with_mismatch_status(MismatchStatus::UnprocessableContent)).await;
    let key = OperationKey::generate();
    let client = client(5);
    let send = |body: &'static str| {
        client.post(format!("{base}/w")).bearer_auth("t").body(body).with_extension(key.clone()).send()
    };
    assert_eq!(send("{\"a\":1}").await.unwrap().status(), 201);
    let res = send("{\"a\":2}").await.unwrap();
    assert_eq!(res.status(), 422);
    assert_eq!(log.lock().unwrap().len(), 2, "the mismatch was sent again");
}

#[tokio::test]
async fn x_should_retry_false_stops_at_once() {
    //! A 503 the server marks `x-should-retry: false` (a record that does not decode) was
    //! retried by reqwest-retry's default strategy until its budget ran out.
    let app = Router::new().route(
        "/w",
        post(|| async {
            let mut h = HeaderMap::new();
            h.insert("x-should-retry", "false".parse().unwrap());
            (StatusCode::SERVICE_UNAVAILABLE, h, "no retry can fix this").into_response()
        }),
    );
    let (base, log) = serve(app, layer()).await;
    let res = client(5).post(format!("{base}/w")).bearer_auth("t").body("{}").send().await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(log.lock().unwrap().len(), 1, "retried despite x-should-retry: false");
}
