//! Extend (lease renewal): a fenced write by which a running handler keeps its claim. It
//! applies only for the holder of the current in-flight claim (whether or not its lease
//! already ran out, as long as nobody reclaimed it), moves the lease to `now + lease` but
//! never earlier, raises `expires_at` with it so a renewed claim is never swept, and keeps
//! the token, the state, the response and every other field. Any other caller gets the
//! exact `StoreError::LeaseLost` and changes nothing.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{FencingToken, JournalWrite, Receipt, ReclaimOutcome, Record, RecordState, Store, UnixMillis};

use super::{
    LEASE, LEASE_MS, assert_lease_lost, claim_req, claim_req_timed, completed, conflict, existing, extended, failed,
    get, must_claim, race, reclaim_req, reclaimed, response, sweep_all,
};
use crate::Env;

/// Extend moves the lease to the store's `now + lease` and changes nothing else; the owner
/// keeps writing with the same token.
pub async fn extend_moves_the_lease_from_now_and_keeps_the_rest(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(2_000);
    let now = env.clock.now_ms();
    let e = extended(env.store.as_ref(), &r, Duration::from_secs(10)).await;
    let expected = Record { lease_expires_at: UnixMillis(now + 10_000), ..r.clone() };
    assert_eq!(e, expected, "only the lease moved, to now + 10 s");
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(e.clone()));
    // A second renewal counts from the new now, not from the previous lease end.
    env.clock.advance_ms(3_000);
    let again = extended(env.store.as_ref(), &e, Duration::from_secs(10)).await;
    assert_eq!(again.lease_expires_at.0, now + 13_000);
    let done = completed(env.store.as_ref(), &again, response()).await;
    assert_eq!((done.token, done.state), (r.token, RecordState::Completed), "the renewed claim completes");
}

/// Extend never moves the lease earlier: a shorter or zero renewal leaves the record as it was.
pub async fn extend_never_moves_the_lease_earlier(env: Env) {
    let long = Duration::from_secs(30);
    let r = must_claim(&env, claim_req_timed(&env, "p", "k", b"body", long, Duration::from_secs(60))).await;
    env.clock.advance_ms(1_000);
    for lease in [Duration::from_secs(5), Duration::ZERO, Duration::from_secs(29)] {
        let e = extended(env.store.as_ref(), &r, lease).await;
        assert_eq!(e, r, "a renewal of {lease:?} at +1 s ends before the 30 s lease: nothing moves");
    }
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}

/// A renewal past the retention raises `expires_at` to the new lease end: the claim
/// outlives its first window, through sweeps (or native expiry), and is gone at the new end.
pub async fn renewed_claim_outlives_its_retention_through_sweeps(env: Env) {
    let s = env.sweep_session().await;
    let r =
        must_claim(&env, claim_req_timed(&env, "p", "k", b"b", Duration::from_secs(1), Duration::from_secs(2))).await;
    let t0 = r.created_at.0;
    env.clock.set(UnixMillis(t0 + 1_500));
    let e = extended(env.store.as_ref(), &r, Duration::from_secs(10)).await;
    assert_eq!((e.lease_expires_at.0, e.expires_at.0), (t0 + 11_500, t0 + 11_500));
    env.clock.set(UnixMillis(r.expires_at.0 + 1_000));
    sweep_all(&env, s.native_expiry).await;
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(e.clone()), "a renewed claim survives its first window");
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&e)).await, Some(e.clone()), "and its lease is fresh");
    env.clock.set(UnixMillis(e.expires_at.0 - 1));
    sweep_all(&env, s.native_expiry).await;
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(e.clone()));
    env.clock.set(e.expires_at);
    assert_eq!(get(env.store.as_ref(), r.id).await, None, "gone at the raised expires_at");
}

/// An owner whose lease ran out, but whom nobody reclaimed, still renews; the renewed lease
/// then blocks a retry.
pub async fn extend_after_the_lease_ran_out_applies_while_nobody_reclaimed(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS * 3);
    let now = env.clock.now_ms();
    let e = extended(env.store.as_ref(), &r, LEASE).await;
    assert_eq!(e, Record { lease_expires_at: UnixMillis(now + LEASE_MS), ..r.clone() });
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&r)).await, Some(e.clone()));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(e));
}

/// Extend presenting a token that is not the current one (from the future, from before,
/// the floor) is `LeaseLost` with the current token and changes nothing.
pub async fn extend_with_a_wrong_token_is_lease_lost_and_changes_nothing(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS - 1);
    for wrong in [r.token.next(), FencingToken(r.token.0 - 1), FencingToken::FIRST] {
        assert_lease_lost(env.store.extend(r.id, wrong, LEASE).await, r.id, wrong, Some(r.token));
    }
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r.clone()));
    env.clock.advance_ms(1);
    assert_eq!(reclaimed(env.store.as_ref(), reclaim_req(&r)).await.token, r.token.next(), "the lease was not renewed");
}

/// Extend of a completed record is `LeaseLost`, even by the token that completed it; the
/// response and every time stay.
pub async fn extend_of_a_completed_record_is_lease_lost(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    env.clock.advance_ms(1_000);
    assert_lease_lost(env.store.extend(r.id, r.token, LEASE).await, r.id, r.token, Some(r.token));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// Extend of a failed record is `LeaseLost`, even by the token that failed it; the record
/// stays failed, reclaimable at once.
pub async fn extend_of_a_failed_record_is_lease_lost(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    assert_lease_lost(env.store.extend(r.id, r.token, LEASE).await, r.id, r.token, Some(r.token));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(f.clone()));
    assert_eq!(reclaimed(env.store.as_ref(), reclaim_req(&f)).await.token, r.token.next());
}

/// After a reclaim, the earlier owner's extend is `LeaseLost` with the new token and changes
/// nothing: a lost claim cannot be renewed back.
pub async fn extend_by_a_reclaimed_owner_is_lease_lost(env: Env) {
    let old = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS + 500);
    let new = reclaimed(env.store.as_ref(), reclaim_req(&old)).await;
    env.clock.advance_ms(100);
    assert_lease_lost(env.store.extend(old.id, old.token, LEASE * 10).await, old.id, old.token, Some(new.token));
    assert_eq!(get(env.store.as_ref(), old.id).await, Some(new));
}

/// Extend of a record that was never claimed is `LeaseLost` with no current token and
/// creates nothing.
pub async fn extend_of_an_absent_record_is_lease_lost(env: Env) {
    let id = claim_req(&env, "p", "never-claimed", b"body").id();
    assert_lease_lost(env.store.extend(id, FencingToken::FIRST, LEASE).await, id, FencingToken::FIRST, None);
    assert_eq!(get(env.store.as_ref(), id).await, None);
}

/// Extend of an in-flight record past `expires_at` is `LeaseLost` with no current token:
/// renewal cannot bring a record back; one ms earlier it reads unchanged.
pub async fn extend_of_an_expired_record_is_lease_lost(env: Env) {
    let r = must_claim(&env, claim_req_timed(&env, "p", "k", b"body", Duration::from_secs(1), Duration::from_secs(2)))
        .await;
    env.clock.set(r.expires_at);
    assert_lease_lost(env.store.extend(r.id, r.token, LEASE).await, r.id, r.token, None);
    assert_eq!(get(env.store.as_ref(), r.id).await, None);
    env.clock.set(UnixMillis(r.expires_at.0 - 1));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r), "the refused renewal changed nothing");
}

/// A renewed lease makes a retry's reclaim conflict until the new lease end, seen from any
/// handle; at the new end the retry takes over and the earlier owner can no longer renew.
pub async fn renewed_lease_refuses_a_retry_until_its_new_end(env: Env) {
    let peer = env.peer().await;
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let t0 = r.created_at.0;
    env.clock.set(UnixMillis(t0 + 4_000));
    let e = extended(env.store.as_ref(), &r, LEASE).await;
    assert_eq!(e.lease_expires_at.0, t0 + 9_000);
    for at in [5_000, 5_001, 8_999] {
        env.clock.set(UnixMillis(t0 + at));
        let (seen, now) = existing(peer.as_ref(), claim_req(&env, "p", "k", b"body")).await;
        assert_eq!(seen, e);
        assert!(seen.lease_is_fresh(now), "at +{at} ms the renewed lease is fresh");
        assert_eq!(conflict(peer.as_ref(), reclaim_req(&r)).await, Some(e.clone()), "a retry at +{at} ms");
    }
    env.clock.set(UnixMillis(t0 + 9_000));
    let n = reclaimed(peer.as_ref(), reclaim_req(&e)).await;
    assert_eq!(n.token, r.token.next());
    assert_lease_lost(env.store.extend(r.id, r.token, LEASE).await, r.id, r.token, Some(n.token));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(n));
}

/// At the exact lease end, the owner's extend racing 8 reclaimers (on two handles) leaves
/// one outcome: either the renewal won and every reclaim conflicts, or one reclaim won and
/// the renewal is `LeaseLost`.
pub async fn extend_racing_reclaimers_leaves_one_outcome(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.set(r.lease_expires_at);
    let now = env.clock.now_ms();
    let stores: [Arc<dyn Store>; 2] = [Arc::clone(&env.store), env.peer().await];
    let outcomes = race(9, |i| {
        let store = Arc::clone(&stores[i % 2]);
        let r = r.clone();
        async move {
            if i == 0 {
                Err(store.extend(r.id, r.token, LEASE).await)
            } else {
                Ok(store.reclaim(reclaim_req(&r)).await.expect("reclaim"))
            }
        }
    })
    .await;
    let mut renewed = None;
    let mut winners = Vec::new();
    for o in outcomes {
        match o {
            Err(Ok(e)) => renewed = Some(e),
            Err(Err(e)) => assert!(e.is_lease_lost(), "the renewal lost with LeaseLost, got {e:?}"),
            Ok(ReclaimOutcome::Reclaimed(n)) => winners.push(n),
            Ok(ReclaimOutcome::Conflict { .. }) => {}
        }
    }
    let current = get(env.store.as_ref(), r.id).await.expect("record present");
    if let Some(e) = renewed {
        assert!(winners.is_empty(), "a reclaim won after the lease was renewed: {winners:?}");
        assert_eq!(current, Record { lease_expires_at: UnixMillis(now + LEASE_MS), ..r.clone() });
        assert_eq!(Receipt::of(&current), e);
    } else {
        assert_eq!(winners.len(), 1, "exactly one reclaim wins when the renewal lost");
        assert_eq!(Some(current), winners.pop());
    }
}

/// A renewal keeps the record's journal: entries written before it stay, and the owner
/// keeps journalling with its token after it.
pub async fn extend_keeps_the_journal(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    if !env.capabilities().journal {
        env.report("journal unsupported: renewal checked without entries");
        let e = extended(env.store.as_ref(), &r, LEASE * 2).await;
        assert_eq!(get(env.store.as_ref(), r.id).await, Some(e));
        return;
    }
    env.report("journal");
    let put =
        |name: &'static str, value: &'static [u8]| env.store.journal_put(r.id, r.token, name, value.to_vec(), false);
    assert_eq!(put("s:before", b"1").await.expect("put"), JournalWrite::Written);
    env.clock.advance_ms(1_000);
    extended(env.store.as_ref(), &r, LEASE * 2).await;
    assert_eq!(env.store.journal_get(r.id, "s:before").await.expect("get"), Some(b"1".to_vec()));
    assert_eq!(put("s:after", b"2").await.expect("put"), JournalWrite::Written);
    assert_eq!(put("s:before", b"x").await.expect("put"), JournalWrite::Exists(b"1".to_vec()));
}
