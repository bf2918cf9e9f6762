//! The group-commit executor on its own, over a transactional engine made of the model
//! (a transaction works on a copy and commits by swapping it in), as an `Embedded` store
//! whose claims all go to the writer: batches against the sequential model, and each
//! batch-level behaviour the executor promises every embedded store (own refusals stay
//! own, a failed commit fails exactly its batch, a panic is recovered, read-only batches
//! are not committed, abandoned claims are skipped).

use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::{BoxFuture, join_all};
use idem_core::engine;
use idem_core::group_commit::{BatchConfig, Embedded, Engine, GroupCommit, Stage, TransactionFailed};
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, Endpoint, Expired, FencingToken, Fingerprint, IdempotencyKey,
    ManualClock, Model, ReclaimRequest, Record, RecordId, RecordRead, RecordTable, Scope, Store, StoreError,
    StoredResponse, UnixMillis,
};
use proptest::prelude::*;

/// The model as a transactional engine, with faults a test can plant.
#[derive(Clone, Debug, Default)]
struct ModelEngine {
    committed: Arc<Mutex<Model>>,
    fail_commit: Arc<AtomicBool>,
    /// A write of this record panics (a bug inside a batch).
    panic_on: Arc<Mutex<Option<RecordId>>>,
    /// A write of this record is refused before it changes anything (a value over the
    /// engine's size limit).
    refuse: Arc<Mutex<Option<RecordId>>>,
    commits: Arc<Mutex<u64>>,
}

/// A table that panics, or refuses, when asked to write one planted record.
struct Planted<'m> {
    model: &'m mut Model,
    panic_on: Option<RecordId>,
    refuse: Option<RecordId>,
}

impl RecordRead for Planted<'_> {
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.model.read(id)
    }
    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.model.journal_read(id, name)
    }
}

impl RecordTable for Planted<'_> {
    fn write(&mut self, old: Option<&Record>, new: &Record) -> Result<(), StoreError> {
        assert!(self.panic_on != Some(new.id), "planted panic");
        if self.refuse == Some(new.id) {
            return Err(StoreError::unavailable("model", "value too large", false, "refused before writing"));
        }
        self.model.write(old, new)
    }
    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<Expired>, StoreError> {
        self.model.expired(now, limit)
    }
    fn remove(&mut self, expired: Expired) -> Result<(), StoreError> {
        self.model.remove(expired)
    }
    fn journal_write(&mut self, id: RecordId, name: &str, value: &[u8]) -> Result<(), StoreError> {
        self.model.journal_write(id, name, value)
    }
    fn journal_clear(&mut self, id: RecordId) -> Result<(), StoreError> {
        self.model.journal_clear(id)
    }
}

/// Test locks are never poisoned unless a test already failed.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Engine for ModelEngine {
    fn backend(&self) -> &'static str {
        "model"
    }

    fn transaction(&mut self, apply: &mut dyn FnMut(&mut dyn RecordTable) -> bool) -> Result<(), TransactionFailed> {
        let mut draft = lock(&self.committed).clone();
        let (panic_on, refuse) = (*lock(&self.panic_on), *lock(&self.refuse));
        if !apply(&mut Planted { model: &mut draft, panic_on, refuse }) {
            return Ok(());
        }
        if self.fail_commit.load(Ordering::SeqCst) {
            let error = StoreError::unavailable("model", "disk full", true, "planted commit failure");
            return Err(TransactionFailed { stage: Stage::Commit, error });
        }
        *lock(&self.committed) = draft;
        *lock(&self.commits) += 1;
        Ok(())
    }
}

const LEASE: Duration = Duration::from_secs(5);
const RETENTION: Duration = Duration::from_secs(60);

fn claim(k: usize, body: u8) -> ClaimRequest {
    let scope = Scope::new("group-commit", Endpoint::new("POST", "/g")).expect("scope");
    let key = IdempotencyKey::parse(format!("k{k}").as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(&[body]), LEASE, RETENTION)
}

fn id(k: usize) -> RecordId {
    claim(k, 0).id()
}

/// The model engine as an embedded store with no read view at hand for claims, so every
/// operation goes to the writer and each batch is exactly the operations sent.
#[derive(Clone, Debug)]
struct ModelStore {
    engine: ModelEngine,
    writer: GroupCommit,
}

impl Embedded for ModelStore {
    const CAPABILITIES: Capabilities = Capabilities { backend: "model", journal: true, ..Capabilities::NONE };
    fn writer(&self) -> &GroupCommit {
        &self.writer
    }
    fn try_view<T>(&self, _read: impl FnOnce(&dyn RecordRead) -> T) -> Option<T> {
        None
    }
    fn view<T>(&self, read: impl FnOnce(&dyn RecordRead) -> Result<T, StoreError>) -> Result<T, StoreError> {
        read(&*lock(&self.engine.committed))
    }
}

/// A store whose writer closes a batch only when `batch` operations are queued (or after
/// a long linger), so operations sent together share one transaction.
fn start(engine: &ModelEngine, clock: &ManualClock, batch: usize) -> ModelStore {
    let config = BatchConfig::default().with_max_batch(batch).with_full_batches(Duration::from_secs(5));
    let writer = GroupCommit::start(engine.clone(), Arc::new(clock.clone()), config).expect("writer starts");
    ModelStore { engine: engine.clone(), writer }
}

/// One operation's outcome, whatever its type, as the tests compare it.
type Shown = BoxFuture<'static, String>;

fn show<T: Debug>(outcome: Result<T, StoreError>) -> String {
    format!("{outcome:?}")
}

/// Operations sent in this order in one go (futures are polled, and so queued, in order).
async fn send(ops: Vec<Shown>) -> Vec<String> {
    join_all(ops).await
}

fn complete(store: &ModelStore, k: usize, token: u64) -> BoxFuture<'static, Result<idem_core::Receipt, StoreError>> {
    let store = store.clone();
    let response = StoredResponse::new(201, vec![], b"{}".to_vec());
    Box::pin(async move { store.complete(id(k), FencingToken(token), response).await })
}

fn claimed<T>(outcome: &Result<ClaimOutcome, T>) -> bool {
    matches!(outcome, Ok(ClaimOutcome::Claimed(_)))
}

/// An operation of the property test. A token is `1..4`, presented relative to the key's
/// token when the batch is built: 1 the one before it (stale), 2 the current one, 3 the
/// next one (what a reclaim earlier in the same batch takes). Absent keys count from the
/// token a claim would take now (the generation's first, from the clock).
#[derive(Clone, Debug)]
enum Op {
    Claim(usize, u8),
    Reclaim(usize, u64, u8),
    Complete(usize, u64),
    Fail(usize, u64),
    Extend(usize, u64),
    Sweep(usize),
    Journal(usize, u64, bool),
}

impl Op {
    /// The operation as sent to `store`, and the same one applied to `oracle` (which it
    /// advances), both shown; tokens count from `batch_start`, the model before the batch.
    fn run(&self, store: &ModelStore, batch_start: &Model, oracle: &mut Model, now: UnixMillis) -> (Shown, String) {
        let token = |k: usize, t: u64| {
            let base = engine::get(batch_start, id(k), now).unwrap().map_or(FencingToken::first_at(now), |r| r.token);
            FencingToken((base.0 + t).saturating_sub(2))
        };
        let s = store.clone();
        match *self {
            Op::Claim(k, body) => {
                let req = claim(k, body);
                let want = show(engine::claim(oracle, &req, now));
                (Box::pin(async move { show(s.claim(req).await) }), want)
            }
            Op::Reclaim(k, expected, body) => {
                let req = ReclaimRequest {
                    id: id(k),
                    expected: token(k, expected),
                    fingerprint: Fingerprint::of_bytes(&[body]),
                    lease_ttl: LEASE,
                    retention: RETENTION,
                };
                let want = show(engine::reclaim(oracle, &req, now));
                (Box::pin(async move { show(s.reclaim(req).await) }), want)
            }
            Op::Complete(k, t) => {
                let token = token(k, t);
                let response = StoredResponse::new(201, vec![], b"{}".to_vec());
                let want = show(engine::complete(oracle, id(k), token, response.clone(), now));
                (Box::pin(async move { show(s.complete(id(k), token, response).await) }), want)
            }
            Op::Fail(k, t) => {
                let token = token(k, t);
                let want = show(engine::fail(oracle, id(k), token, now));
                (Box::pin(async move { show(s.fail(id(k), token).await) }), want)
            }
            Op::Extend(k, t) => {
                let token = token(k, t);
                let want = show(engine::extend(oracle, id(k), token, RETENTION * 2, now));
                (Box::pin(async move { show(s.extend(id(k), token, RETENTION * 2).await) }), want)
            }
            Op::Sweep(limit) => {
                let want = show(engine::sweep(oracle, limit, now));
                (Box::pin(async move { show(s.sweep(limit).await) }), want)
            }
            Op::Journal(k, t, overwrite) => {
                let token = token(k, t);
                let value = vec![u8::try_from(t).unwrap_or(0)];
                let want = show(engine::journal_put(oracle, id(k), token, "step", &value, overwrite, now));
                (Box::pin(async move { show(s.journal_put(id(k), token, "step", value, overwrite).await) }), want)
            }
        }
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3usize, 0..2u8).prop_map(|(k, b)| Op::Claim(k, b)),
        2 => (0..3usize, 1..4u64, 0..2u8).prop_map(|(k, t, b)| Op::Reclaim(k, t, b)),
        2 => (0..3usize, 1..4u64).prop_map(|(k, t)| Op::Complete(k, t)),
        2 => (0..3usize, 1..4u64).prop_map(|(k, t)| Op::Fail(k, t)),
        1 => (0..3usize, 1..4u64).prop_map(|(k, t)| Op::Extend(k, t)),
        1 => (0..4usize).prop_map(Op::Sweep),
        2 => (0..3usize, 1..4u64, any::<bool>()).prop_map(|(k, t, o)| Op::Journal(k, t, o)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Batches behave exactly like their operations run one by one: every outcome, in
    /// arrival order, and the committed state equal the sequential model's.
    #[test]
    fn batches_equal_the_sequential_model(
        rounds in prop::collection::vec((prop::collection::vec(op(), 5), prop::sample::select(vec![0i64, 1, 5_000, 61_000])), 1..12)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let engine = ModelEngine::default();
        let clock = ManualClock::new(UnixMillis(1_000_000));
        let store = start(&engine, &clock, 5);
        let mut oracle = Model::new();
        for (ops, advance) in rounds {
            let batch_start = oracle.clone();
            let (sent, wanted): (Vec<Shown>, Vec<String>) =
                ops.iter().map(|op| op.run(&store, &batch_start, &mut oracle, clock.now())).unzip();
            let got = rt.block_on(send(sent));
            for ((op, got), want) in ops.iter().zip(got).zip(wanted) {
                prop_assert_eq!(got, want, "{:?}", op);
            }
            clock.advance(Duration::from_millis(advance.unsigned_abs()));
        }
        prop_assert_eq!(&*engine.committed.lock().expect("lock"), &oracle);
        let stats = store.writer.stats();
        prop_assert!(stats.batches < stats.operations, "operations shared transactions: {stats:?}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

#[test]
fn a_refused_operation_fails_only_its_caller() {
    //! A lease lost inside a batch must not take the batch's other callers down.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let store = start(&engine, &clock, 3);
    let first = FencingToken::first_at(clock.now()).0;
    let (claim, stale, done) = runtime().block_on(async {
        futures::join!(store.claim(claim(0, 0)), complete(&store, 0, first + 7), complete(&store, 0, first))
    });
    assert!(claimed(&claim), "{claim:?}");
    assert!(stale.expect_err("fenced").is_lease_lost());
    assert_eq!(done.expect("the owner completes").token, FencingToken(first));
    assert_eq!(store.writer.stats().failed_batches, 0);
}

/// Claims keys 0 and 1 in one batch.
fn claim_two(rt: &tokio::runtime::Runtime, store: &ModelStore) -> [Result<ClaimOutcome, StoreError>; 2] {
    let (a, b) = rt.block_on(async { futures::join!(store.claim(claim(0, 0)), store.claim(claim(1, 0))) });
    [a, b]
}

#[test]
fn a_write_the_engine_refuses_fails_only_its_caller() {
    //! A value the engine refuses before writing anything (redb's size limit) must not
    //! count as a change: the rest of its batch commits and the batch is not failed.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    *lock(&engine.refuse) = Some(id(0));
    let store = start(&engine, &clock, 2);
    let out = claim_two(&runtime(), &store);
    assert!(matches!(out[0], Err(StoreError::Unavailable { .. })), "the refused caller gets its error: {out:?}");
    assert!(claimed(&out[1]), "{out:?}");
    let stats = store.writer.stats();
    assert_eq!((stats.batches, stats.failed_batches, stats.read_only_batches), (1, 0, 0));
    let committed = lock(&engine.committed).clone();
    assert!(
        engine::get(&committed, id(1), clock.now()).unwrap().is_some()
            && engine::get(&committed, id(0), clock.now()).unwrap().is_none()
    );
}

#[test]
fn a_failed_commit_fails_every_caller_of_its_batch_and_only_those() {
    //! Nobody may hear "claimed" for a write that never committed, and the next batch
    //! must not inherit the failure.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let store = start(&engine, &clock, 2);
    engine.fail_commit.store(true, Ordering::SeqCst);
    let rt = runtime();
    for result in claim_two(&rt, &store) {
        let err = result.expect_err("the commit failed");
        assert!(err.to_string().contains("group commit of 2 operations failed at commit"), "{err}");
        assert!(err.is_retryable(), "the planted cause is retryable, so is the batch error");
    }
    assert!(engine.committed.lock().expect("lock").is_empty());
    engine.fail_commit.store(false, Ordering::SeqCst);
    let out = claim_two(&rt, &store);
    assert!(out.iter().all(claimed), "{out:?}");
    assert_eq!(store.writer.stats().failed_batches, 1);
}

#[test]
fn a_panic_in_a_batch_fails_that_batch_and_the_writer_goes_on() {
    //! A bug that panics inside one batch used to stop a store's writer until restart.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let store = start(&engine, &clock, 2);
    *engine.panic_on.lock().expect("lock") = Some(id(1));
    let rt = runtime();
    let out = claim_two(&rt, &store);
    assert!(out.iter().all(Result::is_err), "{out:?}");
    assert!(engine.committed.lock().expect("lock").is_empty(), "nothing of the panicked batch committed");
    *engine.panic_on.lock().expect("lock") = None;
    let out = claim_two(&rt, &store);
    assert!(out.iter().all(claimed), "{out:?}");
    assert_eq!(store.writer.stats().failed_batches, 1);
}

#[test]
fn a_batch_that_writes_nothing_is_not_committed() {
    //! A batch of replays and lost leases has nothing to make durable: no commit, no fsync.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let rt = runtime();
    let first = rt.block_on(start(&engine, &clock, 1).claim(claim(0, 0)));
    assert!(claimed(&first), "{first:?}");
    let store = start(&engine, &clock, 2);
    let (replay, stale) = rt.block_on(async { futures::join!(store.claim(claim(0, 0)), complete(&store, 0, 9)) });
    assert!(matches!(replay, Ok(ClaimOutcome::Existing { .. })), "{replay:?}");
    assert!(stale.expect_err("fenced").is_lease_lost());
    assert_eq!(*engine.commits.lock().expect("lock"), 1, "only the first claim committed");
    assert_eq!(store.writer.stats().read_only_batches, 1);
}

#[test]
fn a_claim_whose_caller_went_away_is_not_applied() {
    //! A claim nobody waits for must not lock the key for a lease.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let store = start(&engine, &clock, 2);
    let rt = runtime();
    rt.block_on(async {
        let mut gone = store.claim(claim(0, 0));
        // Polled once: queued; then dropped before the batch (still waiting for a second
        // operation) runs.
        assert!(futures::poll!(gone.as_mut()).is_pending());
        drop(gone);
        let kept = store.claim(claim(1, 0)).await;
        assert!(claimed(&kept), "{kept:?}");
    });
    let committed = engine.committed.lock().expect("lock").clone();
    assert!(engine::get(&committed, id(0), clock.now()).unwrap().is_none(), "the abandoned claim was skipped");
    assert_eq!(store.writer.stats().abandoned_claims, 1);
}

#[test]
fn claims_of_one_id_in_one_batch_have_one_winner_and_keep_its_record() {
    //! A claim decides by writing where nothing is stored (`RecordTable::create`): later
    //! claims of the same id in the batch must find the winner's record, untouched, and
    //! the index must keep one entry for it.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let store = start(&engine, &clock, 4);
    let outcomes = runtime().block_on(join_all((0..4u8).map(|body| store.claim(claim(0, body)))));
    let winner = match &outcomes[0] {
        Ok(ClaimOutcome::Claimed(r)) => r.clone(),
        other => panic!("the first claim in the batch wins, got {other:?}"),
    };
    for other in &outcomes[1..] {
        assert!(matches!(other, Ok(ClaimOutcome::Existing { record, .. }) if *record == winner), "{other:?}");
    }
    let committed = lock(&engine.committed).clone();
    assert_eq!(engine::get(&committed, id(0), clock.now()).unwrap(), Some(winner.clone()));
    let mut oracle = Model::new();
    engine::claim(&mut oracle, &claim(0, 0), clock.now()).unwrap();
    assert_eq!(committed, oracle, "one record, one index entry: the first claim's");
}
