//! In-flight records and lease expiry: a fresh lease blocks every takeover; an expired one
//! is reclaimed by compare-and-set; a lease passing changes nothing on its own.

use std::time::Duration;

use idem_core::{RecordState, UnixMillis};

use super::{
    LEASE_MS, RETENTION_MS, claim_req, claim_req_timed, completed, conflict, existing, failed, get, must_claim,
    reclaim_req, reclaimed, response,
};
use crate::Env;

/// A reclaim while the lease is fresh conflicts, reports the live claim and changes nothing.
pub async fn fresh_lease_blocks_reclaim(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS / 2);
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&r)).await, Some(r.clone()));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}

/// After the lease, a reclaim with the current token wins: token + 1, in flight, no response.
pub async fn expired_lease_is_reclaimed_with_next_token(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS + 1);
    let n = reclaimed(env.store.as_ref(), reclaim_req(&r)).await;
    assert_eq!(n.token, r.token.next());
    assert_eq!(n.state, RecordState::InFlight);
    assert_eq!(n.response, None);
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(n));
}

/// A reclaim keeps `created_at`, sets `started_at = now` and `lease_expires_at = now + lease`.
pub async fn reclaim_keeps_created_at_and_restarts_the_lease(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(7_000);
    let now = env.clock.now_ms();
    let mut req = reclaim_req(&r);
    req.lease_ttl = Duration::from_millis(2_500);
    let n = reclaimed(env.store.as_ref(), req).await;
    assert_eq!(n.created_at, r.created_at);
    assert_eq!(n.started_at.0, now);
    assert_eq!(n.lease_expires_at.0, now + 2_500);
    assert_eq!((n.id, &n.scope, &n.key, n.fingerprint), (r.id, &r.scope, &r.key, r.fingerprint));
}

/// A reclaim with a short retention never moves `expires_at` earlier.
pub async fn reclaim_never_moves_expires_at_earlier(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS);
    let mut req = reclaim_req(&r);
    req.lease_ttl = Duration::from_secs(1);
    req.retention = Duration::from_secs(1);
    let n = reclaimed(env.store.as_ref(), req).await;
    assert_eq!(n.expires_at, r.expires_at);
}

/// A reclaim late in the window extends `expires_at` to `now + retention`.
pub async fn reclaim_extends_retention_from_now(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.set(UnixMillis(r.expires_at.0 - 1_000));
    let now = env.clock.now_ms();
    let n = reclaimed(env.store.as_ref(), reclaim_req(&r)).await;
    assert_eq!(n.expires_at.0, now + RETENTION_MS);
    env.clock.set(UnixMillis(r.expires_at.0 + 1));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(n), "the reclaimed record outlives its first window");
}

/// An owner whose lease expired but whom nobody reclaimed still completes with its token.
pub async fn owner_completes_after_lease_expiry_when_nobody_reclaimed(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS * 3);
    let done = completed(env.store.as_ref(), &r, response()).await;
    assert_eq!(done.state, RecordState::Completed);
    assert_eq!(done.token, r.token);
}

/// An owner whose lease expired but whom nobody reclaimed can still mark its attempt failed.
pub async fn owner_fails_after_lease_expiry_when_nobody_reclaimed(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS * 3);
    let f = failed(env.store.as_ref(), &r).await;
    assert_eq!(f.state, RecordState::Failed);
    assert_eq!(f.lease_expires_at, r.lease_expires_at, "an already passed lease end stays where it was");
}

/// A lease passing changes nothing by itself: the record stays in flight, same token.
pub async fn passing_lease_leaves_the_record_unchanged(env: Env) {
    let r = must_claim(&env, claim_req_timed(&env, "p", "k", b"body", Duration::from_secs(1), Duration::from_secs(60)))
        .await;
    env.clock.advance_ms(30_000);
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}

/// Duplicates and mismatches during the lease leave the owner's claim untouched.
pub async fn rejected_duplicates_leave_the_claim_untouched(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(1_000);
    existing(env.store.as_ref(), claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(1_000);
    existing(env.store.as_ref(), claim_req(&env, "p", "k", b"other body")).await;
    conflict(env.store.as_ref(), reclaim_req(&r)).await;
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r.clone()));
    let done = completed(env.store.as_ref(), &r, response()).await;
    assert_eq!(done.token, r.token, "the owner still completes");
}
