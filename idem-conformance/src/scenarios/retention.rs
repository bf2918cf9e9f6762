//! The retention window and the sweep. A record counts as absent from `expires_at` on,
//! swept or not; a sweep never removes a record before its `expires_at` (so never a live
//! claim), works in bounded batches, and a sweep racing a claim leaves a consistent record.
//!
//! Scenarios that sweep run inside [`crate::Env::sweep_session`] and, on stores with
//! native expiry, run the "sweep is a no-op" variant and say so.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimOutcome, FencingToken, RecordState, Store, UnixMillis};

use super::{
    claim_req, claim_req_timed, claimed, completed, conflict, failed, get, must_claim, race, reclaim_req, response,
    sweep_all, sweep_until_done,
};
use crate::Env;

const SHORT: Duration = Duration::from_secs(2);

/// `get` returns `None` from `expires_at` on, before any sweep; one ms earlier it returns the record.
pub async fn get_is_none_from_expires_at_on_before_any_sweep(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    env.clock.set(UnixMillis(r.expires_at.0 - 1));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
    env.clock.set(r.expires_at);
    assert_eq!(get(env.store.as_ref(), r.id).await, None);
    env.clock.advance_ms(1);
    assert_eq!(get(env.store.as_ref(), r.id).await, None);
}

/// A claim after expiry gets a new in-flight record with a higher token, its own fingerprint and times.
pub async fn claim_after_expiry_gets_a_new_record_with_a_higher_token(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    env.clock.set(done.expires_at);
    let now = env.clock.now_ms();
    let req = claim_req(&env, "p", "k", b"a new request");
    let n = claimed(env.store.as_ref(), req.clone()).await;
    assert!(n.token > done.token, "token {} after expired token {}", n.token, done.token);
    assert_eq!(n.token, FencingToken::first_at(UnixMillis(now)), "a new generation's first token comes from the clock");
    assert_eq!(n.state, RecordState::InFlight);
    assert_eq!(n.response, None);
    assert_eq!(n.fingerprint, req.fingerprint());
    assert_eq!((n.created_at.0, n.started_at.0), (now, now));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(n));
}

/// A failed record past `expires_at` cannot be reclaimed: conflict with no current record.
pub async fn expired_record_cannot_be_reclaimed(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    env.clock.set(f.expires_at);
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&f)).await, None);
    assert_eq!(get(env.store.as_ref(), r.id).await, None);
}

/// A sweep never removes a live claim, fresh or with its lease passed, while expired neighbours go.
pub async fn sweep_keeps_live_claims(env: Env) {
    let s = env.sweep_session().await;
    let live = must_claim(&env, claim_req(&env, "p", "live", b"body")).await;
    let short = must_claim(&env, claim_req_timed(&env, "p", "short", b"body", SHORT, SHORT)).await;
    env.clock.set(short.expires_at);
    sweep_all(&env, s.native_expiry).await;
    assert_eq!(get(env.store.as_ref(), live.id).await, Some(live.clone()), "a fresh claim survives the sweep");
    assert_eq!(get(env.store.as_ref(), short.id).await, None);
    env.clock.set(live.lease_expires_at);
    sweep_all(&env, s.native_expiry).await;
    assert_eq!(get(env.store.as_ref(), live.id).await, Some(live.clone()), "a stale claim is still unexpired");
    let done = completed(env.store.as_ref(), &live, response()).await;
    assert_eq!(done.token, live.token);
}

/// A sweep one ms before `expires_at` keeps completed, failed and in-flight records alike.
pub async fn sweep_keeps_records_until_expires_at(env: Env) {
    let s = env.sweep_session().await;
    let a = must_claim(&env, claim_req(&env, "p", "in-flight", b"body")).await;
    let b = must_claim(&env, claim_req(&env, "p", "completed", b"body")).await;
    let b = completed(env.store.as_ref(), &b, response()).await;
    let c = must_claim(&env, claim_req(&env, "p", "failed", b"body")).await;
    let c = failed(env.store.as_ref(), &c).await;
    env.clock.set(UnixMillis(a.expires_at.0 - 1));
    sweep_all(&env, s.native_expiry).await;
    for r in [&a, &b, &c] {
        assert_eq!(get(env.store.as_ref(), r.id).await.as_ref(), Some(r), "{:?} record swept early", r.state);
    }
}

/// A sweep removes the scenario's expired records (one ms before their `expires_at` they no
/// longer read); a new claim of each starts a new generation, its token from the clock.
pub async fn sweep_removes_expired_records(env: Env) {
    let s = env.sweep_session().await;
    let mut records = Vec::new();
    for i in 0..4 {
        let r = must_claim(&env, claim_req_timed(&env, "p", &format!("k{i}"), b"body", SHORT, SHORT)).await;
        if i % 2 == 0 {
            completed(env.store.as_ref(), &r, response()).await;
        }
        records.push(r);
    }
    env.clock.set(records[3].expires_at);
    let now = UnixMillis(env.clock.now_ms());
    sweep_all(&env, s.native_expiry).await;
    for (i, r) in records.iter().enumerate() {
        assert_eq!(get(env.store.as_ref(), r.id).await, None);
        if !s.native_expiry {
            assert_swept(&env, r, now).await;
        }
        let n = claimed(env.store.as_ref(), claim_req(&env, "p", &format!("k{i}"), b"body")).await;
        assert_eq!(n.token, FencingToken::first_at(now), "a new generation's first token comes from the clock");
        assert!(n.token > r.token, "above the removed record's token {}", r.token);
    }
}

/// Checks `r` is no longer stored: one ms before its `expires_at` (where a record that is
/// still stored reads again) it reads as absent. Leaves the clock at `now`.
async fn assert_swept(env: &Env, r: &idem_core::Record, now: UnixMillis) {
    env.clock.set(UnixMillis(r.expires_at.0 - 1));
    assert_eq!(get(env.store.as_ref(), r.id).await, None, "record {} was left behind by the sweep", r.key);
    env.clock.set(now);
}

/// Sweeps of at most 2 records each say `more` while expired records remain, until all are gone.
pub async fn sweep_batches_are_bounded_and_say_more(env: Env) {
    let s = env.sweep_session().await;
    let mut records = Vec::new();
    for i in 0..5 {
        records.push(must_claim(&env, claim_req_timed(&env, "p", &format!("k{i}"), b"body", SHORT, SHORT)).await);
    }
    env.clock.set(records[4].expires_at);
    if s.native_expiry {
        sweep_all(&env, true).await;
    } else {
        env.report("sweep in batches of 2");
        let first = env.store.sweep(2).await.expect("sweep");
        assert!(first.removed <= 2, "a sweep of limit 2 removed {}", first.removed);
        assert!(first.more, "at least 3 expired records remain after a batch of 2, so `more` must be set");
        sweep_until_done(env.store.as_ref(), 2, 10_000).await;
        let now = UnixMillis(env.clock.now_ms());
        for r in &records {
            assert_swept(&env, r, now).await;
        }
    }
}

/// A sweep with limit 0 removes nothing; the expired record is still swept later.
pub async fn sweep_with_zero_limit_removes_nothing(env: Env) {
    let s = env.sweep_session().await;
    let r = must_claim(&env, claim_req_timed(&env, "p", "k", b"body", SHORT, SHORT)).await;
    env.clock.set(r.expires_at);
    let out = env.store.sweep(0).await.expect("sweep");
    assert_eq!(out.removed, 0, "limit 0 removes nothing");
    if !s.native_expiry {
        let now = UnixMillis(env.clock.now_ms());
        env.clock.set(UnixMillis(r.expires_at.0 - 1));
        assert_eq!(get(env.store.as_ref(), r.id).await, Some(r.clone()), "the expired record is still stored");
        env.clock.set(now);
        let n = claimed(env.store.as_ref(), claim_req(&env, "p", "k", b"body")).await;
        assert_eq!(n.token, FencingToken::first_at(now), "a new generation replaced the stored record");
    }
    sweep_all(&env, s.native_expiry).await;
}

/// Sweeps racing claims of 8 expired records leave each a whole new claim, never a mix or a gap.
pub async fn sweep_racing_claims_leaves_consistent_records(env: Env) {
    let s = env.sweep_session().await;
    let mut old = Vec::new();
    for i in 0..8 {
        let r = must_claim(&env, claim_req_timed(&env, "p", &format!("k{i}"), b"old", SHORT, SHORT)).await;
        old.push(completed(env.store.as_ref(), &r, response()).await);
    }
    env.clock.set(old[7].expires_at);
    let now = UnixMillis(env.clock.now_ms());
    env.report(if s.native_expiry { "native expiry: sweeps are no-ops" } else { "sweep races claims" });
    let env = Arc::new(env);
    let outcomes = race(16, |i| {
        let env = Arc::clone(&env);
        async move {
            if i % 2 == 0 {
                let store: &dyn Store = env.store.as_ref();
                for _ in 0..4 {
                    store.sweep(3).await.expect("sweep");
                }
                None
            } else {
                Some(env.store.claim(claim_req(&env, "p", &format!("k{}", i / 2), b"new")).await.expect("claim"))
            }
        }
    })
    .await;
    for (i, o) in outcomes.into_iter().flatten().enumerate() {
        let ClaimOutcome::Claimed(n) = o else { panic!("claim of expired k{i} did not win: {o:?}") };
        assert_eq!(n.state, RecordState::InFlight);
        assert_eq!(n.response, None, "no part of the old record survives");
        assert_eq!(n.fingerprint, super::fp(b"new"));
        // Swept first or replaced while still stored: a new generation either way.
        assert_eq!(n.token, FencingToken::first_at(now), "k{i}");
        assert_eq!(get(env.store.as_ref(), n.id).await.as_ref(), Some(&n), "the sweep removed a new claim");
        let done = completed(env.store.as_ref(), &n, response()).await;
        assert_eq!(done.token, n.token);
    }
}

/// A record reclaimed late in its window lives until its new `expires_at`, through sweeps.
pub async fn reclaimed_record_outlives_its_first_window(env: Env) {
    let s = env.sweep_session().await;
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    env.clock.set(UnixMillis(f.expires_at.0 - 10));
    let n = super::reclaimed(env.store.as_ref(), reclaim_req(&f)).await;
    env.clock.set(UnixMillis(r.expires_at.0 + 1_000));
    sweep_all(&env, s.native_expiry).await;
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(n.clone()));
    env.clock.set(n.expires_at);
    assert_eq!(get(env.store.as_ref(), r.id).await, None);
}

/// 100 expired records drain in batches of 30: every batch within its limit, none left behind.
pub async fn sweep_drains_many_expired_records_in_batches(env: Env) {
    let s = env.sweep_session().await;
    let env = Arc::new(env);
    let records =
        race(100, |i| {
            let env = Arc::clone(&env);
            async move {
                claimed(env.store.as_ref(), claim_req_timed(&env, "p", &format!("k{i}"), b"b", SHORT, SHORT)).await
            }
        })
        .await;
    env.clock.set(records[0].expires_at);
    if s.native_expiry {
        sweep_all(&env, true).await;
        return;
    }
    env.report("sweep drains 100 expired records in batches of 30");
    // The total is not asserted: on a shared server another process may sweep some of them.
    sweep_until_done(env.store.as_ref(), 30, 10_000).await;
    let now = UnixMillis(env.clock.now_ms());
    for r in &records {
        assert_swept(&env, r, now).await;
    }
}
