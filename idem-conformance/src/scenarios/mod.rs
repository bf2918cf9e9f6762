//! The named scenarios. Each is a plain `pub async fn(Env)` whose doc line says what must
//! hold. Add a scenario: write it in its group and list it in `__for_each_scenario!`.
//!
//! # Groups
//! - [`claim`] - create-if-absent.
//! - [`replay`] - a completed record keeps its response byte-exact; mismatches change nothing.
//! - [`inflight`] - in-flight records and lease expiry.
//! - [`reclaim`] - compare-and-set takeover, and races between reclaimers.
//! - [`fencing`] - a stale fencing token changes nothing and gets `LeaseLost`.
//! - [`failed`](mod@failed) - the failed state and its retry.
//! - [`retention`] - the retention window and the sweep.
//! - [`scope`](mod@scope) - isolation between principals and endpoints.
//! - [`limits`] - keys and values at their limits.
//! - [`clock`] - clock edges: lease ends to the millisecond, zero leases, clock steps.
//! - [`peers`] - two handles on one store: takeover, fencing, racing first claims, dead owners,
//!   wake-ups.
//! - [`capability`] - capability variants (native expiry, server clock, peer handles).
//! - [`journal`] - the per-record journal of resumable handlers' steps and intents.
//! - [`extend`] - lease renewal: fenced like `complete`, never earlier, never swept.
//! - [`list`] - listing for operators: live records, filters, pages.
//! - [`generation`] - a key reused after retention: tokens above every earlier
//!   generation's, earlier owners fenced off, new sub-keys.
//!
//! # Rules every scenario follows
//! Its records live under `env.principal(..)` (a random namespace); it never sleeps (time
//! moves through `env.clock`); races are real (tasks released by a barrier); sweeps happen
//! inside [`Env::sweep_session`] and are checked on the scenario's own records only.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, Receipt, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, Scope, Store, StoreError, StoredResponse, UnixMillis,
};

use crate::Env;

pub mod capability;
pub mod claim;
pub mod clock;
pub mod extend;
pub mod failed;
pub mod fencing;
pub mod generation;
pub mod inflight;
pub mod journal;
pub mod limits;
pub mod list;
pub mod peers;
pub mod reclaim;
pub mod replay;
pub mod retention;
pub mod scope;

/// The lease used by scenarios unless they say otherwise.
pub const LEASE: Duration = Duration::from_secs(5);
/// The retention used by scenarios unless they say otherwise.
pub const RETENTION: Duration = Duration::from_secs(60);
/// Lease in ms.
pub const LEASE_MS: i64 = 5_000;
/// Retention in ms.
pub const RETENTION_MS: i64 = 60_000;

/// The scope of `principal` (inside the env's namespace) on `POST /e`.
#[must_use]
pub fn scope(env: &Env, principal: &str) -> Scope {
    Scope::new(env.principal(principal), Endpoint::new("POST", "/e")).expect("non-empty principal")
}

/// Parses a key that the scenario knows is valid.
#[must_use]
pub fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::parse(k.as_bytes()).expect("valid key")
}

/// The fingerprint scenarios use for a request with `body`.
#[must_use]
pub fn fp(body: &[u8]) -> Fingerprint {
    Fingerprint::of_bytes(body)
}

/// A claim request for `key` under `principal` (inside the env's namespace) on `POST /e`.
#[must_use]
pub fn claim_req(env: &Env, principal: &str, key: &str, body: &[u8]) -> ClaimRequest {
    ClaimRequest::new(scope(env, principal), self::key(key), fp(body), LEASE, RETENTION)
}

/// A claim request with its own lease and retention.
#[must_use]
pub fn claim_req_timed(
    env: &Env,
    principal: &str,
    key: &str,
    body: &[u8],
    lease: Duration,
    retention: Duration,
) -> ClaimRequest {
    ClaimRequest::new(scope(env, principal), self::key(key), fp(body), lease, retention)
}

/// A reclaim of `record` that presents its token and fingerprint, with the default lease
/// and retention.
#[must_use]
pub fn reclaim_req(record: &Record) -> ReclaimRequest {
    ReclaimRequest {
        id: record.id,
        expected: record.token,
        fingerprint: record.fingerprint,
        lease_ttl: LEASE,
        retention: RETENTION,
    }
}

/// The response scenarios store: 201 with `Location`, `ETag`, `Content-Type` and a JSON body.
#[must_use]
pub fn response() -> StoredResponse {
    StoredResponse::new(
        201,
        vec![
            ("content-type".to_owned(), b"application/json".to_vec()),
            ("location".to_owned(), b"/tickets/42".to_vec()),
            ("etag".to_owned(), b"\"v1\"".to_vec()),
        ],
        br#"{"id":"tkt_42"}"#.to_vec(),
    )
}

/// Claims and expects to win.
pub async fn must_claim(env: &Env, req: ClaimRequest) -> Record {
    claimed(env.store.as_ref(), req).await
}

/// Claims on `store` and expects to win.
pub async fn claimed(store: &dyn Store, req: ClaimRequest) -> Record {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// Claims and expects to find a live record; returns it and the store's `now`.
pub async fn existing(store: &dyn Store, req: ClaimRequest) -> (Record, UnixMillis) {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Existing { record, now } => (record, now),
        other => panic!("expected Existing, got {other:?}"),
    }
}

/// Reclaims and expects to win.
pub async fn reclaimed(store: &dyn Store, req: ReclaimRequest) -> Record {
    match store.reclaim(req).await.expect("reclaim") {
        ReclaimOutcome::Reclaimed(r) => r,
        other => panic!("expected Reclaimed, got {other:?}"),
    }
}

/// Reclaims and expects a conflict; returns the record the store reported.
pub async fn conflict(store: &dyn Store, req: ReclaimRequest) -> Option<Record> {
    match store.reclaim(req).await.expect("reclaim") {
        ReclaimOutcome::Conflict { current, .. } => current,
        other => panic!("expected Conflict, got {other:?}"),
    }
}

/// Completes `record`'s claim with `resp`, expects it to apply, and returns the record as
/// written.
pub async fn completed(store: &dyn Store, record: &Record, resp: StoredResponse) -> Record {
    let receipt = store.complete(record.id, record.token, resp).await.expect("complete by the current owner");
    written(store, record.id, receipt).await
}

/// Renews `record`'s lease by `lease`, expects it to apply, and returns the record as
/// written.
pub async fn extended(store: &dyn Store, record: &Record, lease: Duration) -> Record {
    let receipt = store.extend(record.id, record.token, lease).await.expect("extend by the current owner");
    written(store, record.id, receipt).await
}

/// Marks `record`'s claim failed, expects it to apply, and returns the record as written.
pub async fn failed(store: &dyn Store, record: &Record) -> Record {
    let receipt = store.fail(record.id, record.token).await.expect("fail by the current owner");
    written(store, record.id, receipt).await
}

/// The record a fenced write just wrote, read back; its receipt must report it.
async fn written(store: &dyn Store, id: RecordId, receipt: Receipt) -> Record {
    let record = store.get(id).await.expect("get after a write").expect("the record just written is live");
    assert_eq!(Receipt::of(&record), receipt, "the receipt reports the record as written");
    record
}

/// Reads a record.
pub async fn get(store: &dyn Store, id: RecordId) -> Option<Record> {
    store.get(id).await.expect("get")
}

/// Asserts `res` is exactly `StoreError::LeaseLost { id, presented, current }`.
#[track_caller]
pub fn assert_lease_lost<T: std::fmt::Debug>(
    res: Result<T, StoreError>,
    id: RecordId,
    presented: FencingToken,
    current: Option<FencingToken>,
) {
    match res {
        Err(StoreError::LeaseLost { id: got_id, presented: got_presented, current: got_current }) => {
            assert_eq!(got_id, id, "LeaseLost names the record");
            assert_eq!(got_presented, presented, "LeaseLost carries the presented token");
            assert_eq!(got_current, current, "LeaseLost carries the current token (None: record gone)");
        }
        other => panic!("expected StoreError::LeaseLost, got {other:?}"),
    }
}

/// Sweeps until the store says no expired records remain (at most `max_calls` calls of
/// `limit`), checking each call stays within `limit`; returns the total removed.
pub async fn sweep_until_done(store: &dyn Store, limit: usize, max_calls: usize) -> u64 {
    let mut total = 0;
    for _ in 0..max_calls {
        let out = store.sweep(limit).await.expect("sweep");
        assert!(out.removed <= limit as u64, "a sweep removed {} records with limit {limit}", out.removed);
        total += out.removed;
        if !out.more {
            return total;
        }
    }
    panic!("sweep still reports more after {max_calls} calls of {limit}");
}

/// Sweeps every expired record (or, on a store with native expiry, checks the sweep is a
/// no-op returning zero) and reports which variant ran.
pub async fn sweep_all(env: &Env, native_expiry: bool) {
    if native_expiry {
        env.report("native expiry: sweep must be a no-op returning zero");
        let out = env.store.sweep(1_000).await.expect("sweep");
        assert_eq!((out.removed, out.more), (0, false), "a store with native expiry sweeps nothing");
    } else {
        env.report("sweep removes expired records");
        sweep_until_done(env.store.as_ref(), 1_000, 10_000).await;
    }
}

/// Runs `n` copies of `f` released together by a barrier on the multi-threaded runtime;
/// returns their results in spawn order.
pub async fn race<T, F, Fut>(n: usize, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let barrier = Arc::clone(&barrier);
        let fut = f(i);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            fut.await
        }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        match t.await {
            Ok(v) => out.push(v),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("race task cancelled: {e}"),
        }
    }
    out
}

#[doc(hidden)]
#[macro_export]
macro_rules! __for_each_scenario {
    ($m:path, $backend:expr) => {
        $m!($backend, claim::absent_record_is_claimed_with_the_first_token_of_its_time);
        $m!($backend, claim::second_claim_sees_existing_record);
        $m!($backend, claim::concurrent_claims_have_exactly_one_winner);
        $m!($backend, claim::claim_stores_scope_key_and_fingerprint);
        $m!($backend, claim::claim_of_completed_record_returns_it_with_response);
        $m!($backend, claim::claim_of_failed_record_returns_it_failed);
        $m!($backend, claim::claim_never_takes_over_a_stale_in_flight_record);
        $m!($backend, claim::retention_shorter_than_lease_is_raised_to_the_lease);
        $m!($backend, claim::distinct_keys_in_one_scope_are_distinct_records);
        $m!($backend, claim::concurrent_claims_of_distinct_keys_all_win);
        $m!($backend, replay::completed_record_keeps_status_headers_and_body);
        $m!($backend, replay::completed_record_keeps_header_order_and_repeats);
        $m!($backend, replay::complete_keeps_token_and_timestamps);
        $m!($backend, replay::complete_returns_what_get_reads);
        $m!($backend, replay::completed_record_reads_the_same_every_time);
        $m!($backend, replay::mismatched_claim_leaves_completed_record_untouched);
        $m!($backend, replay::cached_client_error_keeps_its_status);
        $m!($backend, replay::second_complete_by_the_owner_is_lease_lost);
        $m!($backend, inflight::fresh_lease_blocks_reclaim);
        $m!($backend, inflight::expired_lease_is_reclaimed_with_next_token);
        $m!($backend, inflight::reclaim_keeps_created_at_and_restarts_the_lease);
        $m!($backend, inflight::reclaim_never_moves_expires_at_earlier);
        $m!($backend, inflight::reclaim_extends_retention_from_now);
        $m!($backend, inflight::owner_completes_after_lease_expiry_when_nobody_reclaimed);
        $m!($backend, inflight::owner_fails_after_lease_expiry_when_nobody_reclaimed);
        $m!($backend, inflight::passing_lease_leaves_the_record_unchanged);
        $m!($backend, inflight::rejected_duplicates_leave_the_claim_untouched);
        $m!($backend, reclaim::eight_reclaimers_of_a_stale_claim_have_one_winner);
        $m!($backend, reclaim::eight_reclaimers_of_a_failed_record_have_one_winner);
        $m!($backend, reclaim::reclaim_of_completed_record_conflicts);
        $m!($backend, reclaim::reclaim_with_wrong_fingerprint_conflicts);
        $m!($backend, reclaim::reclaim_of_absent_record_conflicts_with_none);
        $m!($backend, reclaim::reclaim_with_a_future_token_conflicts);
        $m!($backend, reclaim::each_reclaim_raises_the_token_by_one);
        $m!($backend, reclaim::claims_racing_reclaims_never_replace_the_record);
        $m!($backend, fencing::stale_complete_is_fenced_and_changes_nothing);
        $m!($backend, fencing::stale_fail_is_fenced_and_changes_nothing);
        $m!($backend, fencing::stale_reclaim_is_fenced_and_changes_nothing);
        $m!($backend, fencing::complete_with_a_future_token_is_lease_lost);
        $m!($backend, fencing::complete_of_absent_record_is_lease_lost);
        $m!($backend, fencing::fail_of_absent_record_is_lease_lost);
        $m!($backend, fencing::complete_after_fail_is_lease_lost);
        $m!($backend, fencing::fail_after_complete_is_lease_lost);
        $m!($backend, fencing::writes_to_an_expired_record_are_lease_lost);
        $m!($backend, fencing::late_owner_racing_reclaimers_leaves_one_outcome);
        $m!($backend, failed::failed_record_is_reclaimable_at_once);
        $m!($backend, failed::failed_record_reclaim_needs_the_same_fingerprint);
        $m!($backend, failed::fail_ends_the_lease_and_keeps_retention);
        $m!($backend, failed::failed_then_reclaimed_record_completes);
        $m!($backend, failed::repeated_failures_keep_raising_the_token);
        $m!($backend, retention::get_is_none_from_expires_at_on_before_any_sweep);
        $m!($backend, retention::claim_after_expiry_gets_a_new_record_with_a_higher_token);
        $m!($backend, retention::expired_record_cannot_be_reclaimed);
        $m!($backend, retention::sweep_keeps_live_claims);
        $m!($backend, retention::sweep_keeps_records_until_expires_at);
        $m!($backend, retention::sweep_removes_expired_records);
        $m!($backend, retention::sweep_batches_are_bounded_and_say_more);
        $m!($backend, retention::sweep_with_zero_limit_removes_nothing);
        $m!($backend, retention::sweep_racing_claims_leaves_consistent_records);
        $m!($backend, retention::reclaimed_record_outlives_its_first_window);
        $m!($backend, retention::sweep_drains_many_expired_records_in_batches);
        $m!($backend, scope::same_key_other_principal_is_another_record);
        $m!($backend, scope::in_flight_claim_of_one_principal_does_not_block_another);
        $m!($backend, scope::same_key_other_endpoint_is_another_record);
        $m!($backend, scope::same_key_other_path_is_another_record);
        $m!($backend, scope::completing_in_one_scope_leaves_the_other_untouched);
        $m!($backend, scope::moving_bytes_between_scope_fields_is_another_record);
        $m!($backend, limits::key_of_255_bytes_round_trips);
        $m!($backend, limits::key_with_every_visible_ascii_byte_round_trips);
        $m!($backend, limits::non_ascii_principal_and_endpoint_round_trip);
        $m!($backend, limits::long_principal_and_endpoint_round_trip);
        $m!($backend, limits::body_with_every_byte_value_round_trips);
        $m!($backend, limits::non_ascii_text_body_round_trips);
        $m!($backend, limits::empty_body_round_trips);
        $m!($backend, limits::multi_mib_body_round_trips);
        $m!($backend, limits::two_hundred_headers_round_trip);
        $m!($backend, limits::header_values_with_non_utf8_bytes_round_trip);
        $m!($backend, limits::compressed_body_round_trips);
        $m!($backend, limits::not_retained_body_round_trips);
        $m!($backend, limits::trailers_round_trip);
        $m!($backend, limits::control_characters_in_principal_and_endpoint_round_trip);
        $m!($backend, clock::lease_is_fresh_one_ms_before_it_expires);
        $m!($backend, clock::lease_is_stale_exactly_when_it_expires);
        $m!($backend, clock::lease_is_stale_one_ms_after_it_expires);
        $m!($backend, clock::five_second_lease_is_live_at_4999_ms);
        $m!($backend, clock::five_second_lease_is_reclaimable_at_5001_ms);
        $m!($backend, clock::zero_lease_is_finite_and_reclaimable_at_once);
        $m!($backend, clock::zero_lease_and_retention_record_is_gone_at_once);
        $m!($backend, clock::record_is_gone_exactly_at_expires_at);
        $m!($backend, clock::clock_stepping_back_never_frees_a_fresh_lease);
        $m!($backend, peers::fresh_claim_is_never_reclaimable_from_another_handle);
        $m!($backend, peers::stale_owner_is_fenced_and_the_new_claim_stays);
        $m!($backend, peers::two_handles_racing_a_first_claim_have_one_winner);
        $m!($backend, peers::loser_rereading_after_completion_gets_the_response);
        $m!($backend, peers::dead_owners_claim_is_freed_by_its_lease);
        $m!($backend, peers::settling_a_record_wakes_its_waiter);
        $m!($backend, capability::declared_capabilities_hold);
        $m!($backend, capability::peer_handle_sees_the_same_records);
        $m!($backend, capability::server_clock_sets_leases_from_the_server);
        $m!($backend, capability::declared_clock_and_sharing_match_the_backend);
        $m!($backend, journal::journal_values_round_trip_byte_exact);
        $m!($backend, journal::journal_names_at_the_limits_round_trip);
        $m!($backend, journal::journal_first_write_wins);
        $m!($backend, journal::journal_overwrite_replaces);
        $m!($backend, journal::journal_stale_token_is_lease_lost_and_changes_nothing);
        $m!($backend, journal::journal_put_after_complete_is_lease_lost);
        $m!($backend, journal::journal_put_after_fail_is_lease_lost);
        $m!($backend, journal::journal_put_on_absent_record_is_lease_lost);
        $m!($backend, journal::journal_entries_survive_a_reclaim);
        $m!($backend, journal::journal_get_is_none_once_the_record_expired);
        $m!($backend, journal::journal_sweep_removes_entries_with_their_record);
        $m!($backend, journal::journal_claim_replacing_an_expired_record_starts_empty);
        $m!($backend, journal::journal_concurrent_first_writes_have_one_winner);
        $m!($backend, journal::journal_entries_are_isolated_between_records);
        $m!($backend, journal::journal_peer_handle_sees_entries);
        $m!($backend, journal::journal_step_memoises_across_a_reclaim);
        $m!($backend, journal::journal_stale_owners_step_is_fenced);
        $m!($backend, journal::journal_intent_reconcile_paths);
        $m!($backend, extend::extend_moves_the_lease_from_now_and_keeps_the_rest);
        $m!($backend, extend::extend_never_moves_the_lease_earlier);
        $m!($backend, extend::renewed_claim_outlives_its_retention_through_sweeps);
        $m!($backend, extend::extend_after_the_lease_ran_out_applies_while_nobody_reclaimed);
        $m!($backend, extend::extend_with_a_wrong_token_is_lease_lost_and_changes_nothing);
        $m!($backend, extend::extend_of_a_completed_record_is_lease_lost);
        $m!($backend, extend::extend_of_a_failed_record_is_lease_lost);
        $m!($backend, extend::extend_by_a_reclaimed_owner_is_lease_lost);
        $m!($backend, extend::extend_of_an_absent_record_is_lease_lost);
        $m!($backend, extend::extend_of_an_expired_record_is_lease_lost);
        $m!($backend, extend::renewed_lease_refuses_a_retry_until_its_new_end);
        $m!($backend, extend::extend_racing_reclaimers_leaves_one_outcome);
        $m!($backend, extend::extend_keeps_the_journal);
        $m!($backend, generation::new_generation_after_removal_fences_every_earlier_token);
        $m!($backend, generation::new_generation_over_a_stored_expired_record_fences_every_earlier_token);
        $m!($backend, generation::tokens_grow_over_many_generations);
        $m!($backend, generation::sub_keys_stay_within_a_generation_and_change_between_generations);
        $m!($backend, generation::late_step_of_an_earlier_generation_is_fenced);
        $m!($backend, list::list_filters_live_records_by_state_age_and_principal);
        $m!($backend, list::list_pages_resume_after_the_cursor);
    };
}
