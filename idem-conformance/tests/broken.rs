//! A suite that passes a broken store is itself broken: deliberately broken stores, each
//! with one bug seen in real idempotency implementations, and tests asserting that the
//! scenarios (and the model test) aimed at that bug fail on it while passing on the same
//! store without the bug.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use idem_conformance::scenarios::{claim, clock, fencing, handed, inflight, replay, retention};
use idem_conformance::{Backend, Env, model_test};
use idem_core::transition::{self, ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};
use idem_core::{
    Capabilities, Clock, FencingToken, ManualClock, Record, RecordId, RecordState, Store, StoreError, StoredResponse,
    SweepOutcome, UnixMillis,
};

/// The one bug a [`BrokenStore`] carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// No bug: the control run.
    None,
    /// Claim is check-then-insert with a yield in between (C9): concurrent claims all win.
    CheckThenInsert,
    /// Complete ignores the fencing token (C8): a stale owner overwrites the new attempt.
    CompleteIgnoresToken,
    /// Sweep deletes records whether or not they expired: live claims vanish.
    SweepDeletesLive,
    /// Reclaim ignores the lease (C3): a fresh claim is taken over.
    ReclaimIgnoresLease,
    /// The lease is stored in seconds where milliseconds are expected (C2).
    LeaseInSeconds,
    /// The lease counts as fresh up to and including `lease_expires_at` (off by one).
    InclusiveLeaseEnd,
}

/// A map-based store that follows `idem_core::transition` except for its bug.
#[derive(Debug)]
struct BrokenStore {
    bug: Bug,
    clock: ManualClock,
    records: Mutex<BTreeMap<RecordId, Record>>,
}

impl BrokenStore {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<RecordId, Record>> {
        self.records.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl Store for BrokenStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let now = self.clock.now();
        if self.bug == Bug::CheckThenInsert {
            let seen = self.lock().get(&req.id).filter(|r| !r.is_expired(now)).cloned();
            if let Some(record) = seen {
                return Ok(ClaimOutcome::Existing { record, now });
            }
            // The bug: another caller can insert between the check and the write.
            tokio::task::yield_now().await;
            let (write, outcome) = transition::claim(None, &req, now);
            if let Some(r) = write {
                self.lock().insert(r.id, r);
            }
            return Ok(outcome);
        }
        let mut records = self.lock();
        let (write, mut outcome) = transition::claim(records.get(&req.id), &req, now);
        if let Some(mut r) = write {
            if self.bug == Bug::LeaseInSeconds {
                r.lease_expires_at = UnixMillis(now.0 + req.lease_ms() / 1000);
                outcome = ClaimOutcome::Claimed(r.clone());
            }
            records.insert(r.id, r);
        }
        Ok(outcome)
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let now = self.clock.now();
        let mut records = self.lock();
        let current = records.get(&req.id).cloned();
        let reclaimable = match (&current, self.bug) {
            (Some(r), Bug::ReclaimIgnoresLease) => {
                !r.is_expired(now)
                    && r.token == req.expected
                    && r.fingerprint == req.fingerprint
                    && r.state != RecordState::Completed
            }
            (Some(r), Bug::InclusiveLeaseEnd) if r.state == RecordState::InFlight && now == r.lease_expires_at => false,
            (Some(r), _) => transition::is_reclaimable(r, &req, now),
            (None, _) => false,
        };
        match current {
            Some(r) if reclaimable => {
                let mut next = r.clone();
                next.state = RecordState::InFlight;
                next.token = r.token.next();
                next.response = None;
                next.started_at = now;
                next.lease_expires_at = UnixMillis(now.0 + req.lease_ms());
                next.expires_at = r.expires_at.max(UnixMillis(now.0 + req.retention_ms()));
                records.insert(next.id, next.clone());
                Ok(ReclaimOutcome::Reclaimed(next))
            }
            current => Ok(ReclaimOutcome::Conflict { current: current.filter(|r| !r.is_expired(now)), now }),
        }
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        let now = self.clock.now();
        let mut records = self.lock();
        if self.bug == Bug::CompleteIgnoresToken
            && let Some(r) = records.get_mut(&id).filter(|r| !r.is_expired(now))
        {
            r.state = RecordState::Completed;
            r.response = Some(response);
            return Ok(r.clone());
        }
        let next = transition::complete(records.get(&id), id, token, response, now)
            .map_err(|l| StoreError::lease_lost(id, l))?;
        records.insert(id, next.clone());
        Ok(next)
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        let now = self.clock.now();
        let mut records = self.lock();
        let next = transition::fail(records.get(&id), id, token, now).map_err(|l| StoreError::lease_lost(id, l))?;
        records.insert(id, next.clone());
        Ok(next)
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let now = self.clock.now();
        Ok(self.lock().get(&id).filter(|r| !r.is_expired(now)).cloned())
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        let now = self.clock.now();
        let mut records = self.lock();
        let doomed = |r: &Record| self.bug == Bug::SweepDeletesLive || r.is_expired(now);
        let ids: Vec<RecordId> = records.values().filter(|r| doomed(r)).map(|r| r.id).collect();
        let removed = ids.len().min(limit);
        for id in &ids[..removed] {
            records.remove(id);
        }
        Ok(SweepOutcome { removed: removed as u64, more: ids.len() > limit })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
    }
}

struct Broken(Bug);

#[async_trait]
impl Backend for Broken {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        Arc::new(BrokenStore { bug: self.0, clock, records: Mutex::new(BTreeMap::new()) })
    }
}

type Scenario = fn(Env) -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs `scenario` on a fresh store with `bug`; true if it failed (panicked).
async fn fails(bug: Bug, scenario: Scenario) -> bool {
    let env = Env::open_named(Arc::new(Broken(bug)), "broken").await;
    match tokio::spawn(scenario(env)).await {
        Ok(_) => false,
        Err(e) => e.is_panic(),
    }
}

/// Asserts each scenario passes without the bug and fails with it (racy bugs get `tries`).
async fn caught(bug: Bug, tries: usize, scenarios: &[(&str, Scenario)]) {
    for (name, scenario) in scenarios {
        assert!(!fails(Bug::None, *scenario).await, "{name} fails on the correct store");
        let mut caught = false;
        for _ in 0..tries {
            if fails(bug, *scenario).await {
                caught = true;
                break;
            }
        }
        assert!(caught, "{name} passed a store with bug {bug:?}: the suite is broken");
    }
}

macro_rules! scenarios {
    ($($path:path),+ $(,)?) => {
        [$((stringify!($path), (|env| Box::pin($path(env))) as Scenario)),+]
    };
}

/// Runs the model test on a store with `bug`; true if it found a divergence.
fn model_test_fails(bug: Bug) -> bool {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let backend: Arc<dyn Backend> = Arc::new(Broken(bug));
    match model_test::check(&rt, &backend, 512) {
        Ok(_) => false,
        Err(e) => {
            eprintln!("model test on {bug:?}: {}", e.lines().next().unwrap_or_default());
            true
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_then_insert_claim_is_caught() {
    caught(
        Bug::CheckThenInsert,
        5,
        &scenarios![
            claim::concurrent_claims_have_exactly_one_winner,
            handed::c9_two_handles_racing_a_first_claim_have_one_winner
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn complete_ignoring_the_token_is_caught() {
    caught(
        Bug::CompleteIgnoresToken,
        1,
        &scenarios![
            fencing::stale_complete_is_fenced_and_changes_nothing,
            fencing::complete_with_a_future_token_is_lease_lost,
            fencing::complete_after_fail_is_lease_lost,
            replay::second_complete_by_the_owner_is_lease_lost,
            handed::c8_stale_owner_is_fenced_and_the_new_claim_stays,
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sweep_deleting_live_records_is_caught() {
    caught(
        Bug::SweepDeletesLive,
        1,
        &scenarios![retention::sweep_keeps_live_claims, retention::sweep_keeps_records_until_expires_at],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reclaim_ignoring_the_lease_is_caught() {
    caught(
        Bug::ReclaimIgnoresLease,
        1,
        &scenarios![
            inflight::fresh_lease_blocks_reclaim,
            handed::c3_fresh_claim_is_never_reclaimable_from_another_handle
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_in_seconds_is_caught() {
    caught(
        Bug::LeaseInSeconds,
        1,
        &scenarios![clock::c2_five_second_lease_is_live_at_4999_ms, inflight::fresh_lease_blocks_reclaim],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inclusive_lease_end_is_caught() {
    caught(Bug::InclusiveLeaseEnd, 1, &scenarios![clock::lease_is_stale_exactly_when_it_expires]).await;
}

#[test]
fn concurrent_model_test_catches_the_check_then_insert_claim() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime");
    let correct: Arc<dyn Backend> = Arc::new(Broken(Bug::None));
    if let Err(e) = model_test::check_concurrent(&rt, &correct, 128) {
        panic!("the concurrent model test fails the correct store: {e}");
    }
    let broken: Arc<dyn Backend> = Arc::new(Broken(Bug::CheckThenInsert));
    match model_test::check_concurrent(&rt, &broken, 512) {
        Ok(stats) => panic!("the concurrent model test passed a check-then-insert claim: {stats:?}"),
        Err(e) => eprintln!("concurrent model test on CheckThenInsert: {}", e.lines().next().unwrap_or_default()),
    }
}

#[test]
fn model_test_passes_the_correct_store_and_catches_each_sequential_bug() {
    assert!(!model_test_fails(Bug::None), "the model test fails the correct store");
    for bug in [
        Bug::CompleteIgnoresToken,
        Bug::SweepDeletesLive,
        Bug::ReclaimIgnoresLease,
        Bug::LeaseInSeconds,
        Bug::InclusiveLeaseEnd,
    ] {
        assert!(model_test_fails(bug), "the model test passed a store with bug {bug:?}");
    }
}
