//! Clock edges. A lease is fresh while `now < lease_expires_at` and a record is gone once
//! `now >= expires_at`, in milliseconds, with no off-by-one and no seconds/milliseconds mix
//! (`docs/failures.md#seconds-and-milliseconds-mixed`); every lease is finite, even a zero
//! one (`docs/failures.md#zero-lease-means-no-deadline`).

use std::time::Duration;

use idem_core::{FencingToken, UnixMillis};

use super::{claim_req, claim_req_timed, claimed, conflict, get, must_claim, reclaim_req, reclaimed};
use crate::Env;

/// One ms before `lease_expires_at` the lease is fresh: a reclaim conflicts.
pub async fn lease_is_fresh_one_ms_before_it_expires(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.set(UnixMillis(r.lease_expires_at.0 - 1));
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&r)).await, Some(r.clone()));
}

/// Exactly at `lease_expires_at` the lease has passed: a reclaim wins.
pub async fn lease_is_stale_exactly_when_it_expires(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.set(r.lease_expires_at);
    assert_eq!(reclaimed(env.store.as_ref(), reclaim_req(&r)).await.token, r.token.next());
}

/// One ms after `lease_expires_at` a reclaim wins.
pub async fn lease_is_stale_one_ms_after_it_expires(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.set(UnixMillis(r.lease_expires_at.0 + 1));
    assert_eq!(reclaimed(env.store.as_ref(), reclaim_req(&r)).await.token, r.token.next());
}

/// A 5 s lease is still live at 4.999 s: a reclaim conflicts.
pub async fn five_second_lease_is_live_at_4999_ms(env: Env) {
    let start = env.clock.now_ms();
    let r =
        must_claim(&env, claim_req_timed(&env, "p", "k", b"b", Duration::from_secs(5), Duration::from_secs(60))).await;
    assert_eq!(r.lease_expires_at.0 - start, 5_000, "the lease is stored in milliseconds");
    env.clock.set(UnixMillis(start + 4_999));
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&r)).await, Some(r));
}

/// A 5 s lease is reclaimable at 5.001 s.
pub async fn five_second_lease_is_reclaimable_at_5001_ms(env: Env) {
    let start = env.clock.now_ms();
    let r =
        must_claim(&env, claim_req_timed(&env, "p", "k", b"b", Duration::from_secs(5), Duration::from_secs(60))).await;
    env.clock.set(UnixMillis(start + 5_001));
    let n = reclaimed(env.store.as_ref(), reclaim_req(&r)).await;
    assert_eq!(n.lease_expires_at.0, start + 5_001 + 5_000);
}

/// A zero lease is finite (`lease_expires_at = now`) and reclaimable at once; retention still holds.
pub async fn zero_lease_is_finite_and_reclaimable_at_once(env: Env) {
    let now = env.clock.now_ms();
    let r = must_claim(&env, claim_req_timed(&env, "p", "k", b"b", Duration::ZERO, Duration::from_secs(60))).await;
    assert_eq!(r.lease_expires_at.0, now, "a zero lease expires now, it is never 'no expiry'");
    assert_eq!(r.expires_at.0, now + 60_000);
    env.clock.advance_ms(1_000);
    let n = reclaimed(env.store.as_ref(), reclaim_req(&r)).await;
    assert_eq!(n.token, r.token.next());
}

/// A zero lease with zero retention gives a record that is gone at once; a new claim wins.
pub async fn zero_lease_and_retention_record_is_gone_at_once(env: Env) {
    let now = env.clock.now_ms();
    let r = must_claim(&env, claim_req_timed(&env, "p", "k", b"b", Duration::ZERO, Duration::ZERO)).await;
    assert_eq!((r.lease_expires_at.0, r.expires_at.0), (now, now));
    assert_eq!(get(env.store.as_ref(), r.id).await, None);
    let n = claimed(env.store.as_ref(), claim_req(&env, "p", "k", b"b")).await;
    if env.capabilities().native_expiry {
        // The record may already have left the store; a generation that lived zero ms is
        // the one case the clock cannot tell from the next (see `FencingToken::first_at`).
        env.report("native expiry: the zero-retention record may be gone");
        assert!(n.token >= FencingToken::first_at(UnixMillis(now)), "token {}", n.token);
    } else {
        env.report("the expired record is still stored");
        assert_eq!(n.token, r.token.next(), "a new generation in the same ms stays above the stored record's token");
    }
}

/// Retention edges: the record is there one ms before `expires_at`, gone at it and after.
pub async fn record_is_gone_exactly_at_expires_at(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    for (offset, present) in [(-1, true), (0, false), (1, false)] {
        env.clock.set(UnixMillis(r.expires_at.0 + offset));
        assert_eq!(get(env.store.as_ref(), r.id).await.is_some(), present, "at expires_at{offset:+} ms");
    }
}

/// A clock stepping backwards never frees a fresh lease, and the lease still ends on time.
pub async fn clock_stepping_back_never_frees_a_fresh_lease(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(-2_000);
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&r)).await, Some(r.clone()));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r.clone()));
    env.clock.set(r.lease_expires_at);
    assert_eq!(reclaimed(env.store.as_ref(), reclaim_req(&r)).await.token, r.token.next());
}
