//! Store deadlines and completion retries (`idem_http::deadline`), through the layer: a
//! stalled claim hung the request instead of answering 503, and a completion lost to a
//! blip left the record in flight so the handler ran again after the lease. The store is
//! a memory store on a manual clock behind injected faults; the deadlines and retry pauses
//! run on tokio's real timer. The same stall against real servers (a `SIGSTOP`ped Redis and
//! Postgres) is in `examples/leasebroker/tests/stalled_store.rs`.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::response::IntoResponse;
use axum::{Extension, Router, routing};
use common::{Counter, Env, Script, app, post, send};
use http::StatusCode;
use idem_core::RecordState;
use idem_http::{CompletionRetry, IdempotencyContext, IdempotencyLayer, Problem, StoreDeadlines};

const ORDERS: &str = "POST /v1/orders";
const LEASE_MS: i64 = 300_000;

fn layer(env: &Env, deadlines: StoreDeadlines) -> IdempotencyLayer {
    IdempotencyLayer::new(env.dyn_store()).with_store_deadlines(deadlines)
}

/// The default deadlines with `change` applied.
fn deadlines(change: impl FnOnce(&mut StoreDeadlines)) -> StoreDeadlines {
    let mut deadlines = StoreDeadlines::default();
    change(&mut deadlines);
    deadlines
}

async fn state(env: &Env, key: &str) -> Option<RecordState> {
    env.record("tok-p", ORDERS, key).await.map(|r| r.state)
}

/// A claim on a stalled store hung the request forever instead of answering 503.
#[tokio::test]
async fn a_stalled_claim_answers_503_at_its_deadline() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env, deadlines(|d| d.claim = Duration::from_millis(200))), &n, &s);
    env.store.stall_claims.store(true, Ordering::SeqCst);
    // The outer timeout only turns a hang into a failure; the deadline is 200 ms.
    let got = tokio::time::timeout(Duration::from_secs(10), send(&app, &post("/v1/orders").key("k1").body("{}")))
        .await
        .expect("the request hung on a stalled store");
    got.problem(503, "store-unavailable");
    assert_eq!(got.retry_after(), 1);
    assert_eq!(n.get(), 0, "the handler never runs without a claim");

    env.store.stall_claims.store(false, Ordering::SeqCst);
    assert_eq!(send(&app, &post("/v1/orders").key("k1").body("{}")).await.status, 201);
    assert_eq!(n.get(), 1);
}

/// Without a deadline (switched off by making it an hour) the same stalled claim hangs:
/// the test above can fail.
#[tokio::test]
async fn without_a_deadline_the_stalled_claim_hangs() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env, deadlines(|d| d.claim = Duration::from_secs(3_600))), &n, &s);
    env.store.stall_claims.store(true, Ordering::SeqCst);
    let hung = tokio::time::timeout(Duration::from_secs(3), send(&app, &post("/v1/orders").key("k1").body("{}"))).await;
    assert!(hung.is_err(), "the request answered although the store never did");
}

/// A `complete` lost to a transient store error left the record in flight; after the lease a
/// retry reclaimed it and ran the handler a second time.
#[tokio::test]
async fn a_transient_complete_failure_is_retried_and_the_handler_runs_once() {
    for (retry, runs) in [(CompletionRetry::WhileLeaseLasts, 1), (CompletionRetry::Off, 2)] {
        let env = Env::new();
        let (n, s) = (Counter::default(), Script::default());
        let app = app(layer(&env, deadlines(|d| d.completion_retry = retry)), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        env.store.complete_blips.store(2, Ordering::SeqCst);
        let first = send(&app, &req).await;
        assert_eq!(first.status, 201, "{retry:?}");
        let expected = match retry {
            CompletionRetry::WhileLeaseLasts => RecordState::Completed,
            _ => RecordState::InFlight,
        };
        assert_eq!(state(&env, "k1").await, Some(expected), "{retry:?}");

        env.advance_ms(LEASE_MS + 1_000);
        let retried = send(&app, &req).await;
        assert_eq!(retried.status, 201, "{retry:?}");
        assert_eq!(retried.replayed(), retry == CompletionRetry::WhileLeaseLasts, "{retry:?}");
        assert_eq!(n.get(), runs, "{retry:?}: handler runs");
    }
}

/// Sends one request whose first completion answer is lost, checks the resend read as done
/// and the retry replays it, and returns the stored response as the store holds it.
async fn resend_after_a_lost_answer(env: &Env, layer: IdempotencyLayer) -> idem_core::StoredResponse {
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer, &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    env.store.complete_answers_lost.store(1, Ordering::SeqCst);
    let first = send(&app, &req).await;
    assert_eq!(first.status, 201);
    assert_eq!(env.store.completes.load(Ordering::SeqCst), 2, "the lost answer was resent once");
    let record = env.record("tok-p", ORDERS, "k1").await.unwrap();
    assert_eq!(record.state, RecordState::Completed);
    let replay = send(&app, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, first.body);
    assert_eq!(n.get(), 1);
    record.response.expect("a stored response")
}

/// A resent `complete` after an ambiguous success (the write landed, its answer was lost)
/// was refused as `LeaseLost` because the record was no longer in flight; the layer then
/// logged the response as not stored. The resend must read as done.
#[tokio::test]
async fn a_resend_after_a_lost_answer_reads_as_done() {
    let env = Env::new();
    resend_after_a_lost_answer(&env, layer(&env, StoreDeadlines::default())).await;
}

/// Under sealing, the deadline store seals once and opens what it reads: a resend after a
/// lost answer must carry the same sealed bytes and still read as done, the stored
/// response must be sealed (not the plain one), and the replay must open it.
#[tokio::test]
async fn a_sealed_resend_after_a_lost_answer_reads_as_done_and_replays_opened() {
    let env = Env::new();
    let keys = idem_http::SealingKeys::new(1, [3; 32]);
    let sealed = layer(&env, StoreDeadlines::default()).with_sealing(idem_http::Sealing::new(keys));
    let stored = resend_after_a_lost_answer(&env, sealed).await;
    assert_eq!(stored.status, idem_core::seal::SEALED_STATUS, "the store holds the sealed form");
    assert!(stored.header(idem_core::seal::SEALED_HEADER).is_some());
}

/// A completion retry outlived its window: on a store that never recovers it must give up
/// (the response still goes out) instead of holding the request forever.
#[tokio::test]
async fn completion_retries_stop_at_the_lease() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    // A 1 s lease: the retry window is the lease TTL.
    let layer =
        layer(&env, StoreDeadlines::default()).with_policy(common::policy(|p| p.lease_ttl = Duration::from_secs(1)));
    let app = app(layer, &n, &s);
    env.store.fail_complete.store(true, Ordering::SeqCst);
    let got = tokio::time::timeout(Duration::from_secs(10), send(&app, &post("/v1/orders").key("k1").body("{}")))
        .await
        .expect("completion retries never stopped");
    assert_eq!(got.status, 201);
    let attempts = env.store.completes.load(Ordering::SeqCst);
    assert!(attempts > 2, "the completion was retried: {attempts} attempts");
    assert_eq!(state(&env, "k1").await, Some(RecordState::InFlight));
}

/// A step's outcome write that failed on a full disk (SQLite reports it as not retryable)
/// failed the request with nothing journalled, so the retry ran the step's side effect
/// again: the chaos run's SQLite full disk re-ran finished firmware flashes this way.
#[tokio::test]
async fn a_step_outcome_lost_to_a_full_disk_is_written_again_and_the_step_runs_once() {
    for (retry, runs) in [(CompletionRetry::WhileLeaseLasts, 1), (CompletionRetry::Off, 3)] {
        let env = Env::new();
        env.store.journal.store(true, Ordering::SeqCst);
        let effects = Counter::default();
        let counted = effects.clone();
        let app = Router::new()
            .route(
                "/v1/flashes",
                routing::post(move |Extension(ctx): Extension<IdempotencyContext>| {
                    let counted = counted.clone();
                    async move {
                        let flashed = ctx
                            .resumable()
                            .step("flash", |_| async move { Ok::<_, std::io::Error>(counted.bump()) })
                            .await;
                        match flashed {
                            Ok(n) => (StatusCode::CREATED, n.to_string()).into_response(),
                            Err(e) => Problem::from_step_error(&e).expect("a store error").into_response(),
                        }
                    }
                }),
            )
            .layer(layer(&env, deadlines(|d| d.completion_retry = retry)));
        let req = post("/v1/flashes").key("k1").body("{}");
        env.store.journal_put_blips.store(2, Ordering::SeqCst);
        // The client retries each 503 until it gets its 201.
        let mut statuses = Vec::new();
        loop {
            let got = send(&app, &req).await;
            statuses.push(got.status.as_u16());
            if got.status == StatusCode::CREATED || statuses.len() == 5 {
                break;
            }
            assert_eq!(got.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
        }
        assert_eq!(statuses.last(), Some(&201), "{retry:?}: {statuses:?}");
        assert_eq!(effects.get(), runs, "{retry:?}: side effects of the step; answers {statuses:?}");
        assert_eq!(env.store.journal_puts.load(Ordering::SeqCst), 3, "{retry:?}: two failed writes, one that landed");
    }
}
