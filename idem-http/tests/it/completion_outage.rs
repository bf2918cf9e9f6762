//! A completion refused as a permanent outage (an `Unavailable` the backend calls not
//! retryable: SQLite's full disk, redb after a latched I/O failure) was never sent again,
//! so the record stayed in flight and the retry after the lease ran the handler twice.
//! Journal writes and lease renewals already rode such an outage out; `complete` and
//! `fail` gave up at the first refusal. The store here is a memory store on a manual clock
//! behind the shared `FlakyStore`, which refuses `complete` or `fail`; the layer's retry pauses run on
//! tokio's timer (real, or paused where the outage outlasts a whole lease).

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Counter, Env, Gate, Refusal, Script, Step, app, post, send};
use idem_core::codec::CodecError;
use idem_core::{FencingToken, Record, RecordState, StoreError};
use idem_http::{CompletionRetry, IdempotencyLayer, StoreDeadlines};

/// The lease TTL, and so the completion retry window.
const LEASE: Duration = Duration::from_secs(300);

/// The final refusals: never sent again.
const FINAL: [(&str, Refusal); 3] = [
    ("lease lost", |id, token| StoreError::LeaseLost {
        id,
        presented: token,
        current: Some(FencingToken(token.0 + 1)),
    }),
    ("corrupt", |id, _| StoreError::Corrupt { id: Some(id), source: CodecError::Empty }),
    ("unsupported", |_, _| StoreError::Unsupported { operation: "complete" }),
];

fn layer(env: &Env, retry: CompletionRetry) -> IdempotencyLayer {
    let mut deadlines = StoreDeadlines::default();
    deadlines.completion_retry = retry;
    IdempotencyLayer::new(env.store.clone())
        .with_policy(common::policy(|p| p.lease_ttl = LEASE))
        .with_store_deadlines(deadlines)
}

/// The record of `key` sent by the test requests (bearer `tok-p`, `POST /v1/orders`).
async fn record(env: &Env, key: &str) -> Record {
    env.record("tok-p", "POST /v1/orders", key).await.expect("the record exists")
}

/// A `complete` refused three times by a full disk gave up at the first refusal: the record
/// stayed in flight, and the retry after the lease reclaimed it and ran the handler again.
/// With retries off the second run still happens: the switch is respected, and the test
/// can fail.
#[tokio::test]
async fn a_completion_refused_as_a_permanent_outage_is_sent_again_and_the_handler_runs_once() {
    for (retry, runs) in [(CompletionRetry::WhileLeaseLasts, 1), (CompletionRetry::Off, 2)] {
        let env = Env::new();
        let (n, s) = (Counter::default(), Script::default());
        let app = app(layer(&env, retry), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        env.store.complete_outages.store(3, Ordering::SeqCst);

        let first = send(&app, &req).await;
        assert_eq!(first.status, 201, "{retry:?}");
        assert!(!first.replayed(), "{retry:?}");

        env.clock.advance(LEASE + Duration::from_secs(1));
        let retried = send(&app, &req).await;
        assert_eq!(retried.status, 201, "{retry:?}");
        assert_eq!(n.get(), runs, "{retry:?}: handler runs");
        match retry {
            CompletionRetry::WhileLeaseLasts => {
                assert!(retried.replayed(), "the retry after the lease replays");
                assert_eq!(retried.body, first.body);
                assert_eq!(env.store.completes.load(Ordering::SeqCst), 4, "three refusals, one that landed");
                assert_eq!(record(&env, "k1").await.state, RecordState::Completed);
            }
            _ => assert_eq!(env.store.completes.load(Ordering::SeqCst), 2, "one send per run"),
        }
    }
}

/// An outage that outlasts the whole retry window (one lease TTL, on tokio's paused clock):
/// the retries must end, the first answer is the handler's own response (not a replay, not
/// a problem: the operation ran, and an error would invite the retry that runs it again),
/// and the record is left in flight under the first attempt's token with no response, so a
/// retry while the store's lease lasts is turned away instead of running the handler.
#[tokio::test(start_paused = true)]
async fn a_completion_refused_for_longer_than_the_lease_leaves_the_record_in_flight() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let app = app(layer(&env, CompletionRetry::WhileLeaseLasts), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    env.store.complete_outages.store(usize::MAX, Ordering::SeqCst);

    let started = tokio::time::Instant::now();
    let first = send(&app, &req).await;
    let took = started.elapsed();
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    // The answer says that a retry will not replay it: never a silent second run.
    assert_eq!(first.header("idempotent-stored"), Some("false"), "the response is marked as not stored");
    let body: serde_json::Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(body["call"], 1, "the handler's own response");
    // The retries ran for the window (the last pause is at most 1 s) and stopped there.
    assert!(
        took >= LEASE - Duration::from_secs(2) && took <= LEASE + Duration::from_secs(1),
        "the answer came after {took:?}, the window is {LEASE:?}"
    );
    let attempts = env.store.completes.load(Ordering::SeqCst);
    assert!(attempts > 100, "the completion was sent again through the window: {attempts} attempts");

    let record = record(&env, "k1").await;
    assert_eq!(record.state, RecordState::InFlight);
    assert_eq!(Some(record.token.0), body["token"].as_u64(), "still the first attempt's claim");
    assert!(record.response.is_none(), "nothing was stored");

    // The store's clock has not moved: its lease still runs, and a retry is turned away.
    send(&app, &req).await.problem(409, "in-flight");
    assert_eq!(n.get(), 1, "the handler ran once");
}

/// A `fail` refused by a full disk also gave up at once: no second run came of it, but the
/// record stayed in flight and every retry was answered 409 for the rest of the lease. Sent
/// again, it lands once the store is back, and the retry runs at once.
#[tokio::test]
async fn a_fail_refused_as_a_permanent_outage_is_sent_again_and_frees_the_key() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Status(500));
    let app = app(layer(&env, CompletionRetry::WhileLeaseLasts), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    env.store.fail_outages.store(3, Ordering::SeqCst);

    assert_eq!(send(&app, &req).await.status, 500);
    assert_eq!(env.store.fails.load(Ordering::SeqCst), 4, "three refusals, one that landed");
    assert_eq!(record(&env, "k1").await.state, RecordState::Failed);

    let retried = send(&app, &req).await;
    assert_eq!(retried.status, 201);
    assert_eq!(n.get(), 2, "the failed attempt's retry runs without waiting out the lease");
}

/// A refusal that is final must not be sent again: a fenced-out token means another attempt
/// owns the record (a resend would only be refused again, for a whole lease), and a corrupt
/// record or an unsupported call does not heal by waiting.
#[tokio::test]
async fn a_final_refusal_of_a_completion_is_not_sent_again() {
    for (refusal, make) in FINAL {
        let env = Env::new();
        let (n, s) = (Counter::default(), Script::default());
        let app = app(layer(&env, CompletionRetry::WhileLeaseLasts), &n, &s);
        *env.store.complete_refusal.lock().unwrap() = Some(make);

        let first = tokio::time::timeout(Duration::from_secs(10), send(&app, &post("/v1/orders").key("k1").body("{}")))
            .await
            .unwrap_or_else(|_| panic!("{refusal}: the completion was sent again for the whole window"));
        assert_eq!(first.status, 201, "{refusal}");
        assert_eq!(first.header("idempotent-stored"), Some("false"), "{refusal}: marked as not stored");
        assert_eq!(env.store.completes.load(Ordering::SeqCst), 1, "{refusal}: sent once");
        assert_eq!(record(&env, "k1").await.state, RecordState::InFlight, "{refusal}");
    }
}

/// The lease was renewed only while the handler ran, and a `complete` refused by an outage
/// is resent for up to one lease after that: the lease ran out in the middle of the
/// resends, a retry reclaimed the record and ran the handler a second time while the first
/// attempt was still trying to store its response. The renewal now lasts until the record
/// is written. Store clock and tokio's paused clock move together here.
#[tokio::test(start_paused = true)]
async fn the_lease_is_renewed_while_a_refused_completion_is_resent() {
    let lease = Duration::from_secs(6);
    let env = Env::new();
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    let layer = IdempotencyLayer::new(env.store.clone()).with_policy(common::policy(|p| p.lease_ttl = lease));
    let app = app(layer, &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    env.store.complete_outages.store(usize::MAX, Ordering::SeqCst);
    let step = Duration::from_millis(250);
    let tick = || async {
        env.clock.advance(step);
        tokio::time::advance(step).await;
    };

    let first = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    // The handler runs 6.25 s, renewed every 2 s (at 2.25 and 4.5 s on these ticks): its
    // lease then reaches 10.5 s, and the completion is resent from 6.25 s until 12.25 s.
    gate.started().await;
    for _ in 0..25 {
        tick().await;
    }
    gate.release();
    for _ in 0..19 {
        tick().await;
    }
    // 11 s: past the lease the handler's renewals gave.
    assert_eq!(record(&env, "k1").await.state, RecordState::InFlight, "the completion is still being resent");
    send(&app, &req).await.problem(409, "in-flight");
    assert_eq!(n.get(), 1, "a retry during the resends ran the handler again");

    // The store comes back within the resend window: the next resend (11.825 s: the pauses
    // double from 25 ms to 1 s) lands, and retries replay.
    env.store.complete_outages.store(0, Ordering::SeqCst);
    for _ in 0..5 {
        tick().await;
    }
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-stored"), None, "stored after all");
    assert!(send(&app, &req).await.replayed());
    assert_eq!(n.get(), 1);
}
