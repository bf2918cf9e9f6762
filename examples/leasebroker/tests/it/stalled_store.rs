//! A stalled store server (SIGSTOP) hung every keyed request instead of answering 503: the
//! store calls had no deadline. A private `redis-server` and a private PostgreSQL cluster
//! (started by the test on loopback ports 7120-7121, in temp dirs, and removed after) are
//! stopped with SIGSTOP while a request goes through the idempotency layer; it must get a
//! 503 at the layer's claim deadline, and the handler must not run. The same request with
//! the deadline switched off (an hour) hangs: the deadline is what answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idem_core::Store;
use idem_http::{IdempotencyLayer, StoreDeadlines};
use leasebroker::chaos::servers::{PrivatePostgres, PrivateRedis, RedisPersistence, signal};
use tower::ServiceExt;

const DEADLINE: Duration = Duration::from_millis(500);

fn app(store: Arc<dyn Store>, claim_deadline: Duration, runs: Arc<AtomicUsize>) -> Router {
    let mut deadlines = StoreDeadlines::default();
    deadlines.claim = claim_deadline;
    let layer = IdempotencyLayer::new(store).with_store_deadlines(deadlines);
    Router::new()
        .route(
            "/v1/workers",
            post(move || {
                let runs = Arc::clone(&runs);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    StatusCode::CREATED
                }
            }),
        )
        .layer(layer)
}

fn request() -> Request<Body> {
    Request::post("/v1/workers")
        .header("authorization", "Bearer stalled")
        .header("idempotency-key", uuid::Uuid::new_v4().to_string())
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap()
}

/// With the server stopped (`stop` sends SIGSTOP and returns the ids to resume): the layer
/// answers 503 at its deadline (the outer timeout only turns a hang into a failure), and,
/// when `hangs_without` says the store has no timeout of its own, the same request with the
/// deadline off hangs.
async fn stalled_claim_answers_503(store: Arc<dyn Store>, stop: impl FnOnce() -> Vec<u32>, hangs_without: bool) {
    let runs = Arc::new(AtomicUsize::new(0));
    let guarded = app(Arc::clone(&store), DEADLINE, Arc::clone(&runs));
    let unguarded = app(store, Duration::from_secs(3_600), Arc::clone(&runs));
    // The store works before the stall.
    assert_eq!(guarded.clone().oneshot(request()).await.unwrap().status(), StatusCode::CREATED);

    let pids = stop();
    let answered = tokio::time::timeout(Duration::from_secs(10), guarded.clone().oneshot(request())).await;
    let hung = tokio::time::timeout(Duration::from_secs(3), unguarded.oneshot(request())).await;
    for &p in &pids {
        signal(p, "CONT").unwrap();
    }
    let res = answered.expect("the request hung on a stalled store").unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    if hangs_without {
        assert!(hung.is_err(), "without a deadline the request should hang on the stalled store");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran without a claim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_redis_answers_503_at_the_deadline() {
    let redis = PrivateRedis::start(7120, RedisPersistence::AofAlways).expect("private redis-server");
    let store = idem_redis::RedisStore::connect(&redis.url(), idem_redis::Config::default()).await.expect("connect");
    // idem-redis has a response timeout of its own, so without the layer's deadline the
    // request does not hang either: only the deadline's answer is checked here.
    let pid = redis.pid().unwrap();
    let stop = move || {
        signal(pid, "STOP").unwrap();
        vec![pid]
    };
    stalled_claim_answers_503(Arc::new(store), stop, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_postgres_answers_503_at_the_deadline() {
    let pg = tokio::task::spawn_blocking(|| PrivatePostgres::start(7121)).await.unwrap().expect("private postgres");
    let store =
        idem_postgres::PostgresStore::connect(&pg.url(), idem_postgres::Config::default()).await.expect("connect");
    // sqlx waits for a stopped server forever: without the deadline, a hang.
    // The postmaster is stopped before its children are listed: a backend forked for a
    // connection the pool was still opening kept serving the claim (a 201).
    stalled_claim_answers_503(Arc::new(store), || pg.stop().unwrap(), true).await;
}
