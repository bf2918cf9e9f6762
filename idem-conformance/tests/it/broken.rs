//! A suite that passes a broken store is itself broken: deliberately broken stores, each
//! with one bug seen in real idempotency implementations, and tests asserting that the
//! scenarios (and the model test) aimed at that bug fail on it while passing on the same
//! store without the bug.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use idem_conformance::scenarios::{
    claim, clock, extend, fencing, generation, inflight, journal, list, peers, replay, retention,
};
use idem_conformance::{Backend, Env, model_test};
use idem_core::transition::{self, ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};
use idem_core::{
    Capabilities, Clock, FencingToken, JournalWrite, ListFilter, Listing, ManualClock, Receipt, Record, RecordId,
    RecordState, Store, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};

/// The one bug a [`BrokenStore`] carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// No bug: the control run.
    None,
    /// Claim is check-then-insert with a yield in between: concurrent claims all win.
    CheckThenInsert,
    /// Complete ignores the fencing token: a stale owner overwrites the new attempt.
    CompleteIgnoresToken,
    /// Sweep deletes records whether or not they expired: live claims vanish.
    SweepDeletesLive,
    /// Reclaim ignores the lease: a fresh claim is taken over as an orphan.
    ReclaimIgnoresLease,
    /// The lease is stored in seconds where milliseconds are expected.
    LeaseInSeconds,
    /// The lease counts as fresh up to and including `lease_expires_at` (off by one).
    InclusiveLeaseEnd,
    /// Not a bug: the store does not offer the journal (`Capabilities::journal` unset,
    /// both methods `Unsupported`), so the journal scenarios run their unsupported variant.
    NoJournal,
    /// Declares `Capabilities::journal` but never implemented the methods.
    JournalDeclaredButMissing,
    /// A journal put checks only that the record is live, not the token or the state: a
    /// stale owner's step overwrites the current owner's.
    JournalIgnoresToken,
    /// A claim that replaces an expired record keeps the old attempt's journal entries.
    ReplacingClaimKeepsJournal,
    /// `overwrite = false` is ignored: the last write wins, so a step can run twice.
    JournalLastWriteWins,
    /// Extend renews any live in-flight record, whatever token is presented: a stale owner
    /// keeps the new attempt's lease alive, or renews the claim it lost.
    ExtendIgnoresToken,
    /// Extend checks the token but not the state: it renews a completed or failed record.
    ExtendRenewsFinished,
    /// Extend sets `lease_expires_at = now + lease` even when that is earlier.
    ExtendShortensLease,
    /// Extend moves the lease but not `expires_at`: a renewed claim is swept under its holder.
    ExtendKeepsExpiresAt,
    /// The tokens of a new generation restart (the old rule): token 1 for an absent
    /// record, the stored expired record's token + 1 otherwise. A record that left the
    /// store takes its tokens with it, and a late owner of it passes the fence on the next.
    TokensRestart,
    /// The listing judges nothing expired: records past their retention (gone for `get`)
    /// still show up for operators.
    ListIncludesExpired,
    /// The listing ignores the cursor: every page starts again at the first record.
    ListIgnoresCursor,
    /// Declares `Capabilities::server_clock` but times everything by the process's clock:
    /// a fleet trusting it skips the clock-sync bound it needs.
    ClaimsServerClock,
    /// Declares `Capabilities::shared` on storage one handle owns: a second process
    /// opening it would keep its own records.
    ClaimsShared,
}

/// A map-based store that follows `idem_core::transition` except for its bug.
#[derive(Debug)]
struct BrokenStore {
    bug: Bug,
    clock: ManualClock,
    records: Mutex<BTreeMap<RecordId, Record>>,
    /// Journal entries; always locked after `records` when both are held.
    journal: Mutex<BTreeMap<(RecordId, String), Vec<u8>>>,
}

impl BrokenStore {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<RecordId, Record>> {
        self.records.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_journal(&self) -> MutexGuard<'_, BTreeMap<(RecordId, String), Vec<u8>>> {
        self.journal.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drops record `id`'s journal (a claim wrote a new record, or a sweep removed it).
    fn drop_journal(&self, id: RecordId, replacing_claim: bool) {
        if replacing_claim && self.bug == Bug::ReplacingClaimKeepsJournal {
            return;
        }
        self.lock_journal().retain(|(i, _), _| *i != id);
    }

    fn journal_supported(&self) -> bool {
        !matches!(self.bug, Bug::NoJournal | Bug::JournalDeclaredButMissing)
    }
}

#[async_trait]
impl Store for BrokenStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let now = self.clock.now();
        if self.bug == Bug::CheckThenInsert {
            let seen = self.lock().get(&req.id()).filter(|r| !r.is_expired(now)).cloned();
            if let Some(record) = seen {
                return Ok(ClaimOutcome::Existing { record, now });
            }
            // The bug: another caller can insert between the check and the write.
            tokio::task::yield_now().await;
            let (write, outcome) = transition::claim(None, &req, now);
            if let Some(r) = write {
                let mut records = self.lock();
                self.drop_journal(r.id, true);
                records.insert(r.id, r);
            }
            return Ok(outcome);
        }
        let mut records = self.lock();
        let (write, mut outcome) = transition::claim(records.get(&req.id()), &req, now);
        if let Some(mut r) = write {
            if self.bug == Bug::LeaseInSeconds {
                r.lease_expires_at = UnixMillis(now.0 + req.lease_ms() / 1000);
                outcome = ClaimOutcome::Claimed(r.clone());
            }
            if self.bug == Bug::TokensRestart {
                r.token = records.get(&req.id()).map_or(FencingToken::FIRST, |old| old.token.next());
                outcome = ClaimOutcome::Claimed(r.clone());
            }
            self.drop_journal(r.id, true);
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
    ) -> Result<Receipt, StoreError> {
        let now = self.clock.now();
        let mut records = self.lock();
        if self.bug == Bug::CompleteIgnoresToken
            && let Some(r) = records.get_mut(&id).filter(|r| !r.is_expired(now))
        {
            r.state = RecordState::Completed;
            r.response = Some(response);
            return Ok(Receipt::of(r));
        }
        let next = transition::complete(records.get(&id), id, token, response, now)
            .map_err(|l| StoreError::lease_lost(id, l))?;
        let receipt = Receipt::of(&next);
        records.insert(id, next);
        Ok(receipt)
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        let now = self.clock.now();
        let mut records = self.lock();
        let lease_end = UnixMillis(now.0 + i64::try_from(lease_ttl.as_millis()).unwrap_or(i64::MAX / 2));
        let renewable = |r: &Record| match self.bug {
            Bug::ExtendIgnoresToken => r.state == RecordState::InFlight,
            Bug::ExtendRenewsFinished => r.token == token,
            _ => false,
        };
        if matches!(self.bug, Bug::ExtendIgnoresToken | Bug::ExtendRenewsFinished)
            && let Some(r) = records.get_mut(&id).filter(|r| !r.is_expired(now) && renewable(r))
        {
            r.lease_expires_at = r.lease_expires_at.max(lease_end);
            r.expires_at = r.expires_at.max(r.lease_expires_at);
            return Ok(Receipt::of(r));
        }
        let mut next = transition::extend(records.get(&id), id, token, lease_ttl, now)
            .map_err(|l| StoreError::lease_lost(id, l))?;
        match self.bug {
            Bug::ExtendShortensLease => next.lease_expires_at = lease_end,
            Bug::ExtendKeepsExpiresAt => next.expires_at = records.get(&id).map_or(next.expires_at, |r| r.expires_at),
            _ => {}
        }
        let receipt = Receipt::of(&next);
        records.insert(id, next);
        Ok(receipt)
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        let now = self.clock.now();
        let mut records = self.lock();
        let next = transition::fail(records.get(&id), id, token, now).map_err(|l| StoreError::lease_lost(id, l))?;
        let receipt = Receipt::of(&next);
        records.insert(id, next);
        Ok(receipt)
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
            self.drop_journal(*id, false);
        }
        Ok(SweepOutcome { removed: removed as u64, more: ids.len() > limit })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            journal: self.bug != Bug::NoJournal,
            list: true,
            server_clock: self.bug == Bug::ClaimsServerClock,
            shared: self.bug == Bug::ClaimsShared,
            ..Capabilities::NONE
        }
    }

    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        let now = self.clock.now();
        let records: Vec<Record> = self.lock().values().cloned().collect();
        let mut applied = filter.clone();
        if self.bug == Bug::ListIgnoresCursor {
            applied.after = None;
        }
        // Judged at the dawn of time, nothing has expired yet.
        let judged_at = if self.bug == Bug::ListIncludesExpired { UnixMillis(i64::MIN) } else { now };
        let page = applied.select(records, judged_at);
        Ok(Listing::new(now, page.records, page.more))
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        if !self.journal_supported() {
            return Err(StoreError::Unsupported { operation: "journal_put" });
        }
        let now = self.clock.now();
        let records = self.lock();
        let current = records.get(&id);
        if self.bug == Bug::JournalIgnoresToken {
            if current.is_none_or(|r| r.is_expired(now)) {
                return Err(StoreError::LeaseLost { id, presented: token, current: None });
            }
        } else {
            transition::check_journal_owner(current, id, token, now).map_err(|l| StoreError::lease_lost(id, l))?;
        }
        let mut journal = self.lock_journal();
        let k = (id, name.to_owned());
        if !overwrite
            && self.bug != Bug::JournalLastWriteWins
            && let Some(v) = journal.get(&k)
        {
            return Ok(JournalWrite::Exists(v.clone()));
        }
        journal.insert(k, value);
        Ok(JournalWrite::Written)
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        if !self.journal_supported() {
            return Err(StoreError::Unsupported { operation: "journal_get" });
        }
        let now = self.clock.now();
        let records = self.lock();
        if records.get(&id).is_none_or(|r| r.is_expired(now)) {
            return Ok(None);
        }
        Ok(self.lock_journal().get(&(id, name.to_owned())).cloned())
    }
}

struct Broken(Bug);

#[async_trait]
impl Backend for Broken {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        Arc::new(BrokenStore {
            bug: self.0,
            clock,
            records: Mutex::new(BTreeMap::new()),
            journal: Mutex::new(BTreeMap::new()),
        })
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
            peers::two_handles_racing_a_first_claim_have_one_winner
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
            peers::stale_owner_is_fenced_and_the_new_claim_stays,
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
        &scenarios![inflight::fresh_lease_blocks_reclaim, peers::fresh_claim_is_never_reclaimable_from_another_handle],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_in_seconds_is_caught() {
    caught(
        Bug::LeaseInSeconds,
        1,
        &scenarios![clock::five_second_lease_is_live_at_4999_ms, inflight::fresh_lease_blocks_reclaim],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inclusive_lease_end_is_caught() {
    caught(Bug::InclusiveLeaseEnd, 1, &scenarios![clock::lease_is_stale_exactly_when_it_expires]).await;
}

/// Every scenario that uses the journal, for the capability tests below.
fn journal_scenarios() -> Vec<(&'static str, Scenario)> {
    scenarios![
        journal::journal_values_round_trip_byte_exact,
        journal::journal_names_at_the_limits_round_trip,
        journal::journal_first_write_wins,
        journal::journal_overwrite_replaces,
        journal::journal_stale_token_is_lease_lost_and_changes_nothing,
        journal::journal_put_after_complete_is_lease_lost,
        journal::journal_put_after_fail_is_lease_lost,
        journal::journal_put_on_absent_record_is_lease_lost,
        journal::journal_entries_survive_a_reclaim,
        journal::journal_get_is_none_once_the_record_expired,
        journal::journal_sweep_removes_entries_with_their_record,
        journal::journal_claim_replacing_an_expired_record_starts_empty,
        journal::journal_concurrent_first_writes_have_one_winner,
        journal::journal_entries_are_isolated_between_records,
        journal::journal_peer_handle_sees_entries,
        journal::journal_step_memoises_across_a_reclaim,
        journal::journal_stale_owners_step_is_fenced,
        journal::journal_intent_reconcile_paths,
        extend::extend_keeps_the_journal,
        generation::late_step_of_an_earlier_generation_is_fenced,
    ]
    .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn journal_scenarios_pass_a_store_without_the_journal_through_the_unsupported_variant() {
    for (name, scenario) in journal_scenarios() {
        assert!(!fails(Bug::None, scenario).await, "{name} fails on the correct store with a journal");
        assert!(!fails(Bug::NoJournal, scenario).await, "{name} fails a store that does not declare the journal");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn journal_declared_but_missing_is_caught_by_every_journal_scenario() {
    for (name, scenario) in journal_scenarios() {
        assert!(fails(Bug::JournalDeclaredButMissing, scenario).await, "{name} passed a journal that is only declared");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn journal_ignoring_the_token_is_caught() {
    caught(
        Bug::JournalIgnoresToken,
        1,
        &scenarios![
            journal::journal_stale_token_is_lease_lost_and_changes_nothing,
            journal::journal_put_after_complete_is_lease_lost,
            journal::journal_put_after_fail_is_lease_lost,
            journal::journal_stale_owners_step_is_fenced,
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replacing_claim_keeping_the_journal_is_caught() {
    caught(
        Bug::ReplacingClaimKeepsJournal,
        1,
        &scenarios![journal::journal_claim_replacing_an_expired_record_starts_empty],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn journal_last_write_wins_is_caught() {
    caught(
        Bug::JournalLastWriteWins,
        1,
        &scenarios![
            journal::journal_first_write_wins,
            journal::journal_entries_survive_a_reclaim,
            journal::journal_concurrent_first_writes_have_one_winner,
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extend_ignoring_the_token_is_caught() {
    caught(
        Bug::ExtendIgnoresToken,
        1,
        &scenarios![
            extend::extend_with_a_wrong_token_is_lease_lost_and_changes_nothing,
            extend::extend_by_a_reclaimed_owner_is_lease_lost,
            extend::renewed_lease_refuses_a_retry_until_its_new_end,
            generation::new_generation_after_removal_fences_every_earlier_token,
            generation::new_generation_over_a_stored_expired_record_fences_every_earlier_token,
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extend_renewing_a_completed_or_failed_record_is_caught() {
    caught(
        Bug::ExtendRenewsFinished,
        1,
        &scenarios![
            extend::extend_of_a_completed_record_is_lease_lost,
            extend::extend_of_a_failed_record_is_lease_lost
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extend_moving_the_lease_earlier_is_caught() {
    caught(Bug::ExtendShortensLease, 1, &scenarios![extend::extend_never_moves_the_lease_earlier]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extend_leaving_expires_at_behind_is_caught() {
    caught(Bug::ExtendKeepsExpiresAt, 1, &scenarios![extend::renewed_claim_outlives_its_retention_through_sweeps])
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listing_expired_records_is_caught() {
    caught(Bug::ListIncludesExpired, 1, &scenarios![list::list_filters_live_records_by_state_age_and_principal]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listing_that_ignores_the_cursor_is_caught() {
    caught(Bug::ListIgnoresCursor, 1, &scenarios![list::list_pages_resume_after_the_cursor]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn declaring_a_server_clock_or_sharing_the_store_lacks_is_caught() {
    use idem_conformance::scenarios::capability;
    let scenario = scenarios![capability::declared_clock_and_sharing_match_the_backend];
    caught(Bug::ClaimsServerClock, 1, &scenario).await;
    caught(Bug::ClaimsShared, 1, &scenario).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_restarting_for_a_new_generation_are_caught() {
    caught(
        Bug::TokensRestart,
        1,
        &scenarios![
            generation::new_generation_after_removal_fences_every_earlier_token,
            generation::tokens_grow_over_many_generations,
            claim::absent_record_is_claimed_with_the_first_token_of_its_time,
            retention::sweep_removes_expired_records,
        ],
    )
    .await;
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
    assert!(!model_test_fails(Bug::NoJournal), "the model test fails a correct store without the journal");
    for bug in [
        Bug::CompleteIgnoresToken,
        Bug::SweepDeletesLive,
        Bug::ReclaimIgnoresLease,
        Bug::LeaseInSeconds,
        Bug::InclusiveLeaseEnd,
        Bug::JournalIgnoresToken,
        Bug::JournalLastWriteWins,
        Bug::ReplacingClaimKeepsJournal,
        Bug::ExtendIgnoresToken,
        Bug::ExtendRenewsFinished,
        Bug::ExtendShortensLease,
        Bug::ExtendKeepsExpiresAt,
        Bug::TokensRestart,
    ] {
        assert!(model_test_fails(bug), "the model test passed a store with bug {bug:?}");
    }
}
