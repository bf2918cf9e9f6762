//! A completion refused as a permanent outage (an `Unavailable` the backend calls not
//! retryable: SQLite's full disk, redb after a latched I/O failure) was never sent again,
//! so the record stayed in flight and the retry after the lease ran the handler twice.
//! Journal writes and lease renewals already rode such an outage out; `complete` and
//! `fail` gave up at the first refusal. The store here is a memory store on a manual clock
//! behind a wrapper that refuses `complete` or `fail`; the layer's retry pauses run on
//! tokio's timer (real, or paused where the outage outlasts a whole lease).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use common::{Counter, Script, Step, T0, app, post, send};
use idem_core::codec::CodecError;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Endpoint, FencingToken, IdempotencyKey, ManualClock, MemoryStore,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Scope, Store, StoreError, StoredResponse,
    SweepOutcome,
};
use idem_http::{BearerToken, CompletionRetry, IdempotencyLayer, StoreDeadlines};

/// The lease TTL, and so the completion retry window.
const LEASE: Duration = Duration::from_secs(300);

/// How the wrapper refuses a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// `Unavailable`, not retryable, as SQLite reports a full disk.
    Outage,
    /// A fenced-out token: another attempt owns the record.
    LeaseLost,
    /// The record does not decode.
    Corrupt,
    /// The backend does not offer the call.
    Unsupported,
}

/// A [`MemoryStore`] whose `complete` and `fail` are refused, writing nothing, for as many
/// calls as the test says.
#[derive(Debug)]
struct RefusingStore {
    inner: MemoryStore,
    refusal: Refusal,
    /// The next this many `complete` calls are refused (`usize::MAX`: every one).
    refuse_completes: AtomicUsize,
    /// The next this many `fail` calls are refused.
    refuse_fails: AtomicUsize,
    /// How many `complete` calls reached the store.
    completes: AtomicUsize,
    /// How many `fail` calls reached the store.
    fails: AtomicUsize,
}

impl RefusingStore {
    /// The refusal for this call, if `left` still counts refusals.
    fn refused(&self, left: &AtomicUsize, id: RecordId, token: FencingToken, op: &'static str) -> Option<StoreError> {
        left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).ok()?;
        Some(match self.refusal {
            Refusal::Outage => {
                StoreError::unavailable("refusing", op, false, std::io::Error::other("database or disk is full"))
            }
            Refusal::LeaseLost => {
                StoreError::LeaseLost { id, presented: token, current: Some(FencingToken(token.0 + 1)) }
            }
            Refusal::Corrupt => StoreError::Corrupt { id: Some(id), source: CodecError::Empty },
            Refusal::Unsupported => StoreError::Unsupported { operation: op },
        })
    }
}

#[async_trait]
impl Store for RefusingStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.inner.claim(req).await
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.inner.reclaim(req).await
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        if let Some(refusal) = self.refused(&self.refuse_completes, id, token, "complete") {
            return Err(refusal);
        }
        self.inner.complete(id, token, response).await
    }
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        self.fails.fetch_add(1, Ordering::SeqCst);
        if let Some(refusal) = self.refused(&self.refuse_fails, id, token, "fail") {
            return Err(refusal);
        }
        self.inner.fail(id, token).await
    }
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Record, StoreError> {
        self.inner.extend(id, token, lease_ttl).await
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.inner.sweep(limit).await
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// The refusing store on a manual clock.
struct Env {
    clock: ManualClock,
    store: Arc<RefusingStore>,
}

impl Env {
    fn new(refusal: Refusal) -> Self {
        let clock = ManualClock::new(T0);
        let inner = MemoryStore::with_clock(Arc::new(clock.clone()));
        let store = Arc::new(RefusingStore {
            inner,
            refusal,
            refuse_completes: AtomicUsize::new(0),
            refuse_fails: AtomicUsize::new(0),
            completes: AtomicUsize::new(0),
            fails: AtomicUsize::new(0),
        });
        Self { clock, store }
    }

    fn layer(&self, retry: CompletionRetry) -> IdempotencyLayer {
        IdempotencyLayer::new(self.store.clone())
            .with_lease_ttl(LEASE)
            .with_store_deadlines(StoreDeadlines::default().with_completion_retry(retry))
    }

    /// The record of `key` sent by the test requests (bearer `tok-p`, `POST /v1/orders`).
    async fn record(&self, key: &str) -> Record {
        let scope = Scope::new(BearerToken::principal_for(b"tok-p"), Endpoint::new("POST", "/v1/orders")).unwrap();
        let id = scope.record_id(&IdempotencyKey::parse(key.as_bytes()).unwrap());
        self.store.inner.get(id).await.unwrap().expect("the record exists")
    }
}

/// A `complete` refused three times by a full disk gave up at the first refusal: the record
/// stayed in flight, and the retry after the lease reclaimed it and ran the handler again.
/// With retries off the second run still happens: the switch is respected, and the test
/// can fail.
#[tokio::test]
async fn a_completion_refused_as_a_permanent_outage_is_sent_again_and_the_handler_runs_once() {
    for (retry, runs) in [(CompletionRetry::WhileLeaseLasts, 1), (CompletionRetry::Off, 2)] {
        let env = Env::new(Refusal::Outage);
        let (n, s) = (Counter::default(), Script::default());
        let app = app(env.layer(retry), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        env.store.refuse_completes.store(3, Ordering::SeqCst);

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
                assert_eq!(env.record("k1").await.state, RecordState::Completed);
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
    let env = Env::new(Refusal::Outage);
    let (n, s) = (Counter::default(), Script::default());
    let app = app(env.layer(CompletionRetry::WhileLeaseLasts), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    env.store.refuse_completes.store(usize::MAX, Ordering::SeqCst);

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

    let record = env.record("k1").await;
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
    let env = Env::new(Refusal::Outage);
    let (n, s) = (Counter::default(), Script::default());
    s.then(Step::Status(500));
    let app = app(env.layer(CompletionRetry::WhileLeaseLasts), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    env.store.refuse_fails.store(3, Ordering::SeqCst);

    assert_eq!(send(&app, &req).await.status, 500);
    assert_eq!(env.store.fails.load(Ordering::SeqCst), 4, "three refusals, one that landed");
    assert_eq!(env.record("k1").await.state, RecordState::Failed);

    let retried = send(&app, &req).await;
    assert_eq!(retried.status, 201);
    assert_eq!(n.get(), 2, "the failed attempt's retry runs without waiting out the lease");
}

/// A refusal that is final must not be sent again: a fenced-out token means another attempt
/// owns the record (a resend would only be refused again, for a whole lease), and a corrupt
/// record or an unsupported call does not heal by waiting.
#[tokio::test]
async fn a_final_refusal_of_a_completion_is_not_sent_again() {
    for refusal in [Refusal::LeaseLost, Refusal::Corrupt, Refusal::Unsupported] {
        let env = Env::new(refusal);
        let (n, s) = (Counter::default(), Script::default());
        let app = app(env.layer(CompletionRetry::WhileLeaseLasts), &n, &s);
        env.store.refuse_completes.store(usize::MAX, Ordering::SeqCst);

        let first = tokio::time::timeout(Duration::from_secs(10), send(&app, &post("/v1/orders").key("k1").body("{}")))
            .await
            .unwrap_or_else(|_| panic!("{refusal:?}: the completion was sent again for the whole window"));
        assert_eq!(first.status, 201, "{refusal:?}");
        assert_eq!(first.header("idempotent-stored"), Some("false"), "{refusal:?}: marked as not stored");
        assert_eq!(env.store.completes.load(Ordering::SeqCst), 1, "{refusal:?}: sent once");
        assert_eq!(env.record("k1").await.state, RecordState::InFlight, "{refusal:?}");
    }
}
