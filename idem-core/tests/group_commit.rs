//! The group-commit executor on its own, over a transactional engine made of the model
//! (a transaction works on a copy and commits by swapping it in): batches against the
//! sequential model, and each batch-level behaviour the executor promises every embedded
//! store (own refusals stay own, a failed commit fails exactly its batch, a panic is
//! recovered, read-only batches are not committed, abandoned claims are skipped).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::join_all;
use idem_core::engine::{self, Write, Written};
use idem_core::group_commit::{BatchConfig, Engine, GroupCommit, Stage, TransactionFailed};
use idem_core::{
    ClaimOutcome, ClaimRequest, Clock, Endpoint, Expired, FencingToken, Fingerprint, IdempotencyKey, ManualClock,
    Model, ReclaimRequest, Record, RecordId, RecordRead, RecordTable, Scope, StoreError, StoredResponse, UnixMillis,
};
use proptest::prelude::*;

/// The model as a transactional engine, with faults a test can plant.
#[derive(Clone, Default)]
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

/// An executor that closes a batch only when `batch` operations are queued (or after a
/// long linger), so operations pushed together share one transaction.
fn start(engine: &ModelEngine, clock: &ManualClock, batch: usize) -> GroupCommit {
    let config = BatchConfig::default().with_max_batch(batch).with_full_batches(Duration::from_secs(5));
    GroupCommit::start(engine.clone(), Arc::new(clock.clone()), config).expect("writer starts")
}

/// Operations pushed in this order in one go (futures are polled, and so queued, in order).
async fn send(gc: &GroupCommit, writes: Vec<Write>) -> Vec<Result<Written, StoreError>> {
    join_all(writes.into_iter().map(|w| gc.submit(w))).await
}

fn complete(k: usize, token: u64) -> Write {
    Write::Complete {
        id: id(k),
        token: FencingToken(token),
        response: StoredResponse::new(201, vec![], b"{}".to_vec()),
    }
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
    fn write(&self, oracle: &Model, now: UnixMillis) -> Write {
        let token = |k: usize, t: u64| {
            let base = engine::get(oracle, id(k), now).unwrap().map_or(FencingToken::first_at(now), |r| r.token);
            FencingToken((base.0 + t).saturating_sub(2))
        };
        match *self {
            Op::Claim(k, body) => Write::Claim(claim(k, body)),
            Op::Reclaim(k, expected, body) => Write::Reclaim(ReclaimRequest {
                id: id(k),
                expected: token(k, expected),
                fingerprint: Fingerprint::of_bytes(&[body]),
                lease_ttl: LEASE,
                retention: RETENTION,
            }),
            Op::Complete(k, t) => complete(k, token(k, t).0),
            Op::Fail(k, t) => Write::Fail { id: id(k), token: token(k, t) },
            Op::Extend(k, t) => Write::Extend { id: id(k), token: token(k, t), lease_ttl: RETENTION * 2 },
            Op::Sweep(limit) => Write::Sweep { limit },
            Op::Journal(k, t, overwrite) => Write::JournalPut {
                id: id(k),
                token: token(k, t),
                name: "step".into(),
                value: vec![u8::try_from(t).unwrap_or(0)],
                overwrite,
            },
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
        let gc = start(&engine, &clock, 5);
        let mut oracle = Model::new();
        for (ops, advance) in rounds {
            let writes: Vec<Write> = ops.iter().map(|op| op.write(&oracle, clock.now())).collect();
            let got = rt.block_on(send(&gc, writes.clone()));
            for ((op, write), got) in ops.iter().zip(writes).zip(got) {
                let want = idem_core::engine::apply(&mut oracle, write, clock.now());
                prop_assert_eq!(format!("{got:?}"), format!("{want:?}"), "{:?}", op);
            }
            clock.advance(Duration::from_millis(advance.unsigned_abs()));
        }
        prop_assert_eq!(&*engine.committed.lock().expect("lock"), &oracle);
        let stats = gc.stats();
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
    let gc = start(&engine, &clock, 3);
    let first = FencingToken::first_at(clock.now()).0;
    let out =
        runtime().block_on(send(&gc, vec![Write::Claim(claim(0, 0)), complete(0, first + 7), complete(0, first)]));
    assert!(matches!(out[0], Ok(Written::Claim(ClaimOutcome::Claimed(_)))));
    assert!(out[1].as_ref().expect_err("fenced").is_lease_lost());
    assert!(matches!(out[2], Ok(Written::Receipt(_))));
    assert_eq!(gc.stats().failed_batches, 0);
}

#[test]
fn a_write_the_engine_refuses_fails_only_its_caller() {
    //! A value the engine refuses before writing anything (redb's size limit) must not
    //! count as a change: the rest of its batch commits and the batch is not failed.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    *lock(&engine.refuse) = Some(id(0));
    let gc = start(&engine, &clock, 2);
    let out = runtime().block_on(send(&gc, vec![Write::Claim(claim(0, 0)), Write::Claim(claim(1, 0))]));
    assert!(matches!(out[0], Err(StoreError::Unavailable { .. })), "the refused caller gets its error: {out:?}");
    assert!(matches!(out[1], Ok(Written::Claim(ClaimOutcome::Claimed(_)))), "{out:?}");
    let stats = gc.stats();
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
    let gc = start(&engine, &clock, 2);
    engine.fail_commit.store(true, Ordering::SeqCst);
    let rt = runtime();
    for result in rt.block_on(send(&gc, vec![Write::Claim(claim(0, 0)), Write::Claim(claim(1, 0))])) {
        let err = result.expect_err("the commit failed");
        assert!(err.to_string().contains("group commit of 2 operations failed at commit"), "{err}");
        assert!(err.is_retryable(), "the planted cause is retryable, so is the batch error");
    }
    assert!(engine.committed.lock().expect("lock").is_empty());
    engine.fail_commit.store(false, Ordering::SeqCst);
    let out = rt.block_on(send(&gc, vec![Write::Claim(claim(0, 0)), Write::Claim(claim(1, 0))]));
    assert!(out.iter().all(|o| matches!(o, Ok(Written::Claim(ClaimOutcome::Claimed(_))))));
    assert_eq!(gc.stats().failed_batches, 1);
}

#[test]
fn a_panic_in_a_batch_fails_that_batch_and_the_writer_goes_on() {
    //! A bug that panics inside one batch used to stop a store's writer until restart.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let gc = start(&engine, &clock, 2);
    *engine.panic_on.lock().expect("lock") = Some(id(1));
    let rt = runtime();
    let out = rt.block_on(send(&gc, vec![Write::Claim(claim(0, 0)), Write::Claim(claim(1, 0))]));
    assert!(out.iter().all(Result::is_err), "{out:?}");
    assert!(engine.committed.lock().expect("lock").is_empty(), "nothing of the panicked batch committed");
    *engine.panic_on.lock().expect("lock") = None;
    let out = rt.block_on(send(&gc, vec![Write::Claim(claim(0, 0)), Write::Claim(claim(1, 0))]));
    assert!(out.iter().all(|o| matches!(o, Ok(Written::Claim(ClaimOutcome::Claimed(_))))), "{out:?}");
    assert_eq!(gc.stats().failed_batches, 1);
}

#[test]
fn a_batch_that_writes_nothing_is_not_committed() {
    //! A batch of replays and lost leases has nothing to make durable: no commit, no fsync.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let gc = start(&engine, &clock, 1);
    let rt = runtime();
    rt.block_on(send(&gc, vec![Write::Claim(claim(0, 0))]));
    let gc = start(&engine, &clock, 2);
    let out = rt.block_on(send(&gc, vec![Write::Claim(claim(0, 0)), complete(0, 9)]));
    assert!(matches!(out[0], Ok(Written::Claim(ClaimOutcome::Existing { .. }))));
    assert_eq!(*engine.commits.lock().expect("lock"), 1, "only the first claim committed");
    assert_eq!(gc.stats().read_only_batches, 1);
}

#[test]
fn a_claim_whose_caller_went_away_is_not_applied() {
    //! A claim nobody waits for must not lock the key for a lease.
    let (engine, clock) = (ModelEngine::default(), ManualClock::new(UnixMillis(1_000)));
    let gc = start(&engine, &clock, 2);
    let rt = runtime();
    rt.block_on(async {
        let mut gone = Box::pin(gc.submit(Write::Claim(claim(0, 0))));
        // Polled once: queued; then dropped before the batch (still waiting for a second
        // operation) runs.
        assert!(futures::poll!(gone.as_mut()).is_pending());
        drop(gone);
        let kept = gc.submit(Write::Claim(claim(1, 0))).await;
        assert!(matches!(kept, Ok(Written::Claim(ClaimOutcome::Claimed(_)))));
    });
    let committed = engine.committed.lock().expect("lock").clone();
    assert!(engine::get(&committed, id(0), clock.now()).unwrap().is_none(), "the abandoned claim was skipped");
    assert_eq!(gc.stats().abandoned_claims, 1);
}
