//! The retry loop against a real HTTP server on loopback.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use idem_client::{ClientError, IdempotentClient, OperationKey, RetryPolicy};

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn fast() -> RetryPolicy {
    RetryPolicy::default()
        .with_backoff(Duration::from_millis(1), Duration::from_millis(5))
        .with_budget(Duration::from_secs(10))
}

#[tokio::test]
async fn same_key_on_every_attempt_until_success() {
    // Fails twice with 503, then answers 201; every attempt must carry one key.
    let calls = Arc::new(AtomicU32::new(0));
    let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (c, k) = (calls.clone(), keys.clone());
    let app = Router::new().route(
        "/w",
        post(move |h: HeaderMap| async move {
            k.lock().unwrap().push(h.get("idempotency-key").unwrap().to_str().unwrap().to_string());
            if c.fetch_add(1, Ordering::SeqCst) < 2 {
                StatusCode::SERVICE_UNAVAILABLE.into_response()
            } else {
                (StatusCode::CREATED, "made").into_response()
            }
        }),
    );
    let base = serve(app).await;
    let client = IdempotentClient::new(reqwest::Client::new(), fast());
    let key = OperationKey::generate();
    let reply = client.request(reqwest::Method::POST, format!("{base}/w"), &key).json_body("{}").send().await.unwrap();
    assert_eq!(reply.status, 201);
    assert_eq!(reply.stats.attempts, 3);
    assert_eq!(reply.stats.server_errors, 2);
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|k| k == key.as_str()));
}

#[tokio::test]
async fn busy_409_is_retried_after_retry_after_and_mismatch_stops() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let app = Router::new()
        .route(
            "/busy",
            post(move || async move {
                if c.fetch_add(1, Ordering::SeqCst) == 0 {
                    (StatusCode::CONFLICT, [("retry-after", "1"), ("content-type", "application/problem+json")], "{}")
                        .into_response()
                } else {
                    (StatusCode::OK, "done").into_response()
                }
            }),
        )
        .route(
            "/mismatch",
            post(|| async {
                // A server with its own problem base (idem_http::set_type_base).
                let body = r#"{"type":"https://api.example.com/problems/mismatch","status":409}"#;
                (StatusCode::CONFLICT, [("content-type", "application/problem+json")], body).into_response()
            }),
        );
    let base = serve(app).await;
    let client = IdempotentClient::new(reqwest::Client::new(), fast());
    let started = std::time::Instant::now();
    let reply =
        client.request(reqwest::Method::POST, format!("{base}/busy"), &OperationKey::generate()).send().await.unwrap();
    assert_eq!((reply.status.as_u16(), reply.stats.busy), (200, 1));
    // Retry-After: 1 was honoured even though the backoff cap is 5 ms.
    assert!(started.elapsed() >= Duration::from_millis(990));
    let err = client
        .request(reqwest::Method::POST, format!("{base}/mismatch"), &OperationKey::generate())
        .send()
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Mismatch { .. }), "{err:?}");
}

#[tokio::test]
async fn connection_refused_gives_up_within_budget() {
    // Nothing listens on this port once the listener is dropped.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let client = IdempotentClient::new(
        reqwest::Client::new(),
        fast().with_budget(Duration::from_millis(300)).with_max_attempts(5),
    );
    let err = client
        .request(reqwest::Method::POST, format!("http://{addr}/w"), &OperationKey::generate())
        .send()
        .await
        .unwrap_err();
    match err {
        ClientError::GaveUp { stats, .. } => assert!(stats.attempts >= 2 && stats.transport_errors == stats.attempts),
        other => panic!("{other:?}"),
    }
}

/// An idem server with a long lease whose operation outlasts the client's first attempt:
/// `POST /v1/workers/7/firmware` takes `flash` and counts its runs.
async fn firmware_server(lease: Duration, retry_after_cap: Duration, flash: Duration) -> (String, Arc<AtomicU32>) {
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let mut policy = idem_core::Policy::default();
    policy.lease_ttl = lease;
    let layer = idem_http::IdempotencyLayer::new(Arc::new(idem_core::MemoryStore::new()))
        .with_policy(policy)
        .with_in_flight_retry_after(retry_after_cap);
    let app = Router::new()
        .route(
            "/v1/workers/{id}/firmware",
            post(move || async move {
                r.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(flash).await;
                (StatusCode::CREATED, "flashed")
            }),
        )
        .layer(layer);
    (serve(app).await, runs)
}

/// The client gave up on the first in-flight 409 because the server's lease was long
/// (its Retry-After was the whole remaining lease, past the client's budget), or in-flight
/// polls used up the attempt cap.
#[tokio::test]
async fn a_long_lease_operation_is_polled_until_its_replay() {
    let (base, runs) = firmware_server(Duration::from_secs(600), Duration::from_secs(2), Duration::from_secs(3)).await;
    // The first attempt times out while the flash runs on; a cap of two attempts would be
    // spent by then if the in-flight polls counted.
    let client = IdempotentClient::new(
        reqwest::Client::new(),
        fast()
            .with_budget(Duration::from_secs(60))
            .with_attempt_timeout(Duration::from_millis(500))
            .with_max_attempts(2),
    );
    let started = std::time::Instant::now();
    let reply = client
        .request(reqwest::Method::POST, format!("{base}/v1/workers/7/firmware"), &OperationKey::generate())
        .header("authorization", "Bearer ops")
        .send()
        .await
        .unwrap();
    assert_eq!((reply.status.as_u16(), reply.replayed, &reply.body[..]), (201, true, &b"flashed"[..]));
    assert_eq!(reply.stats.transport_errors, 1, "{:?}", reply.stats);
    assert!(reply.stats.busy >= 2, "polled while the flash ran: {:?}", reply.stats);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "flashed once");
    // Retry-After was the 2 s cap, not the 600 s lease: the replay came seconds after the flash.
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

/// A server that still answers Retry-After = the whole remaining lease made the client give
/// up on the first 409 although its budget had time for one more poll.
#[tokio::test]
async fn a_retry_after_past_the_budget_is_polled_at_the_budget_end() {
    let (base, runs) =
        firmware_server(Duration::from_secs(600), Duration::from_secs(3_600), Duration::from_millis(1_500)).await;
    let client = IdempotentClient::new(
        reqwest::Client::new(),
        fast().with_budget(Duration::from_secs(3)).with_attempt_timeout(Duration::from_millis(300)),
    );
    let started = std::time::Instant::now();
    let reply = client
        .request(reqwest::Method::POST, format!("{base}/v1/workers/7/firmware"), &OperationKey::generate())
        .header("authorization", "Bearer ops")
        .send()
        .await
        .unwrap();
    assert_eq!((reply.status.as_u16(), reply.replayed), (201, true));
    assert_eq!((reply.stats.transport_errors, reply.stats.busy), (1, 1), "{:?}", reply.stats);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(2_900) && elapsed < Duration::from_secs(4), "{elapsed:?}");
}

/// A `Retry-After` near `u64::MAX` (a broken or hostile server) panicked the client with an
/// `Instant + Duration` overflow; it must be clamped: a 503 stops within the budget, an
/// in-flight 409 is polled once more at the budget's end, and neither panics. A budget of
/// `Duration::MAX` must not overflow either.
#[tokio::test]
async fn a_huge_retry_after_is_clamped_not_a_panic() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let app = Router::new().route(
        "/w",
        post(move || async move {
            let n = c.fetch_add(1, Ordering::SeqCst);
            let huge = [("retry-after", u64::MAX.to_string())];
            match n {
                0 => (StatusCode::SERVICE_UNAVAILABLE, huge).into_response(),
                1 => (StatusCode::CONFLICT, huge).into_response(),
                _ => (StatusCode::CREATED, "made").into_response(),
            }
        }),
    );
    let base = serve(app).await;
    let policy = fast().with_budget(Duration::from_millis(300));
    let client = IdempotentClient::new(reqwest::Client::new(), policy);
    // The 503's Retry-After reaches past the budget: the client stops at once.
    let err = client
        .request(reqwest::Method::POST, format!("{base}/w"), &OperationKey::generate())
        .json_body("{}")
        .send()
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::GaveUp { .. }), "{err:?}");
    // The 409's: one last poll at the budget's end gets the 201.
    let reply = client
        .request(reqwest::Method::POST, format!("{base}/w"), &OperationKey::generate())
        .json_body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status, 201);
    // An unbounded budget with an in-flight 409 of u64::MAX seconds.
    calls.store(1, Ordering::SeqCst);
    let endless = IdempotentClient::new(reqwest::Client::new(), fast().with_budget(Duration::MAX));
    let pending =
        endless.request(reqwest::Method::POST, format!("{base}/w"), &OperationKey::generate()).json_body("{}").send();
    // The clamped wait is long; the point is that building the request loop did not panic.
    assert!(tokio::time::timeout(Duration::from_millis(300), pending).await.is_err());
}

#[tokio::test]
async fn a_503_marked_should_not_retry_stops_at_once() {
    // The client retried the layer's 503 for a record that does not decode (`x-should-retry:
    // false`, retrying cannot mend it) until its whole budget was spent.
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let app = Router::new().route(
        "/corrupt",
        post(move || async move {
            c.fetch_add(1, Ordering::SeqCst);
            let headers =
                [("retry-after", "1"), ("x-should-retry", "false"), ("content-type", "application/problem+json")];
            (StatusCode::SERVICE_UNAVAILABLE, headers, r#"{"type":"https://docs.rs/idem-http/latest/idem_http/problem/enum.ProblemKind.html#store-unavailable"}"#)
                .into_response()
        }),
    );
    let base = serve(app).await;
    let client = IdempotentClient::new(reqwest::Client::new(), fast().with_budget(Duration::from_secs(3)));
    let err = client
        .request(reqwest::Method::POST, format!("{base}/corrupt"), &OperationKey::generate())
        .send()
        .await
        .unwrap_err();
    let ClientError::GaveUp { stats, .. } = &err else { panic!("{err:?}") };
    assert_eq!(stats.attempts, 1, "{err:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn generated_keys_are_distinct_and_valid() {
    let a = OperationKey::generate();
    let b = OperationKey::generate();
    assert_ne!(a, b);
    assert!(a.as_str().bytes().all(|c| (0x21..=0x7e).contains(&c)));
}
