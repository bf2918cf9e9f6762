//! Two handles on one store, as two servers or processes share it: a fresh claim is never
//! taken over from the other handle, a stale owner is fenced after a reclaim, racing first
//! claims have one winner, and a dead owner's claim is freed by its lease. Each pins an
//! entry of the failure catalogue (`docs/failures.md`); isolation between principals and
//! endpoints is in [`super::scope`](mod@super::scope), the clock edges in [`super::clock`].

use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimOutcome, Record, RecordState, Settlement, Settlements, Store, StoredResponse, UnixMillis};

use super::{
    assert_lease_lost, claim_req, claim_req_timed, completed, conflict, existing, get, race, reclaim_req, reclaimed,
    response,
};
use crate::Env;

/// A fresh claim made through one handle is never reclaimable through another, at any
/// point of its lease, and its owner completes it
/// (`docs/failures.md#live-claim-taken-over-as-an-orphan`).
pub async fn fresh_claim_is_never_reclaimable_from_another_handle(env: Env) {
    let a: Arc<dyn Store> = Arc::clone(&env.store);
    let b = env.peer().await;
    let r = super::claimed(a.as_ref(), claim_req(&env, "P", "K", b"b")).await;
    for at in [0, 1, 2_500, 4_999] {
        env.clock.set(UnixMillis(r.created_at.0 + at));
        let (seen, now) = existing(b.as_ref(), claim_req(&env, "P", "K", b"b")).await;
        assert_eq!(seen, r);
        assert!(seen.lease_is_fresh(now), "at +{at} ms the claim is fresh");
        assert_eq!(conflict(b.as_ref(), reclaim_req(&seen)).await, Some(r.clone()), "reclaimed at +{at} ms");
    }
    let done = completed(a.as_ref(), &r, response()).await;
    assert_eq!(existing(b.as_ref(), claim_req(&env, "P", "K", b"b")).await.0, done, "B's retry gets the replay");
}

/// The stale owner's complete and fail after a reclaim are fenced; the new claim stays
/// (`docs/failures.md#stale-owner-overwrites-the-new-attempt`).
pub async fn stale_owner_is_fenced_and_the_new_claim_stays(env: Env) {
    let lease = Duration::from_secs(1);
    let a = super::must_claim(&env, claim_req_timed(&env, "P", "K", b"b", lease, Duration::from_secs(60))).await;
    let t0 = a.created_at.0;
    env.clock.set(UnixMillis(t0 + 1_500));
    let mut req = reclaim_req(&a);
    req.lease_ttl = Duration::from_secs(5);
    let b = reclaimed(env.peer().await.as_ref(), req).await;
    env.clock.set(UnixMillis(t0 + 3_000));
    let stale = StoredResponse::new(200, vec![], b"from A".to_vec());
    assert_lease_lost(env.store.complete(a.id, a.token, stale).await, a.id, a.token, Some(b.token));
    assert_lease_lost(env.store.fail(a.id, a.token).await, a.id, a.token, Some(b.token));
    env.clock.set(UnixMillis(t0 + 3_100));
    let (seen, now) = existing(env.store.as_ref(), claim_req(&env, "P", "K", b"b")).await;
    assert_eq!(seen, b, "B's claim is intact");
    assert!(seen.lease_is_fresh(now), "C gets 409-busy: B's lease is fresh");
    let done = completed(env.store.as_ref(), &b, response()).await;
    assert_eq!(done.token, a.token.next());
}

/// Two handles race a first claim of one key: exactly one wins, the loser sees its record
/// (`docs/failures.md#concurrent-first-requests-both-run`).
pub async fn two_handles_racing_a_first_claim_have_one_winner(env: Env) {
    let stores: [Arc<dyn Store>; 2] = [Arc::clone(&env.store), env.peer().await];
    for round in 0..8 {
        let req = claim_req(&env, "P", &format!("K{round}"), b"b");
        let outcomes = race(2, |i| {
            let store = Arc::clone(&stores[i]);
            let req = req.clone();
            async move { store.claim(req).await.expect("claim: a key conflict is not a store failure") }
        })
        .await;
        let winners: Vec<_> =
            outcomes.iter().filter_map(|o| if let ClaimOutcome::Claimed(r) = o { Some(r) } else { None }).collect();
        assert_eq!(winners.len(), 1, "round {round}: exactly one claim wins: {outcomes:?}");
        for o in &outcomes {
            if let ClaimOutcome::Existing { record, .. } = o {
                assert_eq!(record, winners[0], "the loser sees the winner's claim");
            }
        }
    }
}

/// The winner of a first-claim race completes before the loser re-reads: the loser gets the
/// completed record.
pub async fn loser_rereading_after_completion_gets_the_response(env: Env) {
    let peer = env.peer().await;
    let winner = super::must_claim(&env, claim_req(&env, "P", "K", b"b")).await;
    let done = completed(env.store.as_ref(), &winner, response()).await;
    let (seen, _) = existing(peer.as_ref(), claim_req(&env, "P", "K", b"b")).await;
    assert_eq!(seen, done);
    assert_eq!(seen.state, RecordState::Completed);
    assert_eq!(get(peer.as_ref(), winner.id).await, Some(done));
}

/// A claim whose process died (its handle dropped mid-request) blocks retries only
/// until its lease passes; then a retry through another handle reclaims and completes it
/// (`docs/failures.md#orphaned-claim-blocks-retries`).
pub async fn dead_owners_claim_is_freed_by_its_lease(env: Env) {
    let dying = env.peer().await;
    let r = super::claimed(dying.as_ref(), claim_req(&env, "P", "K", b"b")).await;
    drop(dying);
    env.clock.advance_ms(1_000);
    let (seen, now) = existing(env.store.as_ref(), claim_req(&env, "P", "K", b"b")).await;
    assert_eq!(seen, r);
    assert!(seen.lease_is_fresh(now), "at +1 s the retry gets 409-busy");
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&r)).await, Some(r.clone()));
    env.clock.set(UnixMillis(r.lease_expires_at.0 + 1_000));
    let n = reclaimed(env.store.as_ref(), reclaim_req(&r)).await;
    assert_eq!(n.token, r.token.next());
    let done = completed(env.store.as_ref(), &n, response()).await;
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// A waiter registered on one handle ([`Store::settlements`]) is woken when the peer handle
/// completes the record, and when it fails one. A store on a server (one that declares
/// [`idem_core::Capabilities::server_clock`]) hears every handle's outcomes through it; an
/// in-process store wakes the waiters of its own handle only (another handle on the same
/// file polls), so there the same handle settles. A store without
/// wake-ups (its waiters poll) runs nothing here. A store that
/// hears other handles over a connection of its own (`LISTEN`, `SUBSCRIBE`) may still be
/// opening it when the first waiter registers, so records are settled until one wakes its
/// waiter before the two checks; the only timing is a generous bound on "woken at all".
pub async fn settling_a_record_wakes_its_waiter(env: Env) {
    const WOKEN_WITHIN: Duration = Duration::from_secs(5);
    let Some(hub) = env.store.settlements() else {
        env.report("no wake-ups: Store::settlements is None, waiters poll");
        return;
    };
    let peer = if env.capabilities().server_clock {
        env.report("wake-ups: the peer's complete and fail wake a waiter on this handle");
        env.peer().await
    } else {
        env.report("wake-ups: this handle's complete and fail wake its waiter (in-process store)");
        Arc::clone(&env.store)
    };
    let started = tokio::time::Instant::now();
    for n in 0.. {
        let (_, woken) = settle(&env, hub, peer.as_ref(), &format!("warm-up-{n}"), false).await;
        if tokio::time::timeout(Duration::from_millis(100), woken).await.is_ok() {
            break;
        }
        assert!(started.elapsed() < WOKEN_WITHIN, "no waiter was woken within {WOKEN_WITHIN:?} of settling");
    }
    for fail in [false, true] {
        let (r, woken) = settle(&env, hub, peer.as_ref(), &format!("fail-{fail}"), fail).await;
        assert!(
            tokio::time::timeout(WOKEN_WITHIN, woken).await.is_ok(),
            "fail={fail}: the waiter of {r:?} was not woken"
        );
    }
}

/// Claims `key` through `peer`, registers a waiter on `hub`, then completes or fails the
/// record through `peer`.
async fn settle<'h>(
    env: &Env,
    hub: &'h Settlements,
    peer: &dyn Store,
    key: &str,
    fail: bool,
) -> (Record, Settlement<'h>) {
    let r = super::claimed(peer, claim_req(env, "P", key, b"b")).await;
    let woken = hub.watch(r.id);
    if fail {
        super::failed(peer, &r).await;
    } else {
        completed(peer, &r, response()).await;
    }
    (r, woken)
}
