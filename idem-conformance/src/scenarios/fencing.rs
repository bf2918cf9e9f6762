//! Fencing: complete, fail and reclaim presenting a token that is not the record's current
//! claim change nothing (the record reads the same before and after) and report the exact
//! typed refusal, `StoreError::LeaseLost` or `ReclaimOutcome::Conflict`.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{FencingToken, Record, RecordState, StoredResponse, UnixMillis};

use super::{
    LEASE_MS, assert_lease_lost, claim_req, claim_req_timed, completed, conflict, failed, get, must_claim, race,
    reclaim_req, reclaimed, response,
};
use crate::Env;

/// Claims, lets the lease pass and reclaims: returns (the stale owner's record, the new claim).
async fn taken_over(env: &Env) -> (Record, Record) {
    let old = must_claim(env, claim_req(env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS + 500);
    let new = reclaimed(env.store.as_ref(), reclaim_req(&old)).await;
    (old, new)
}

/// A complete with a stale token after a reclaim is `LeaseLost` and changes nothing.
pub async fn stale_complete_is_fenced_and_changes_nothing(env: Env) {
    let (old, new) = taken_over(&env).await;
    let before = get(env.store.as_ref(), old.id).await;
    let res = env.store.complete(old.id, old.token, StoredResponse::new(200, vec![], b"stale".to_vec())).await;
    assert_lease_lost(res, old.id, old.token, Some(new.token));
    assert_eq!(get(env.store.as_ref(), old.id).await, before);
    assert_eq!(before, Some(new));
}

/// A fail with a stale token after a reclaim is `LeaseLost` and changes nothing.
pub async fn stale_fail_is_fenced_and_changes_nothing(env: Env) {
    let (old, new) = taken_over(&env).await;
    let before = get(env.store.as_ref(), old.id).await;
    assert_lease_lost(env.store.fail(old.id, old.token).await, old.id, old.token, Some(new.token));
    assert_eq!(get(env.store.as_ref(), old.id).await, before);
    assert_eq!(before, Some(new));
}

/// A reclaim with a stale token conflicts and changes nothing, even once the new lease passed.
pub async fn stale_reclaim_is_fenced_and_changes_nothing(env: Env) {
    let (old, new) = taken_over(&env).await;
    env.clock.set(new.lease_expires_at);
    let before = get(env.store.as_ref(), old.id).await;
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&old)).await, Some(new.clone()));
    assert_eq!(get(env.store.as_ref(), old.id).await, before);
    assert_eq!(before, Some(new));
}

/// A complete presenting a token above the current one is `LeaseLost` and changes nothing.
pub async fn complete_with_a_future_token_is_lease_lost(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let res = env.store.complete(r.id, FencingToken(r.token.0 + 1), response()).await;
    assert_lease_lost(res, r.id, FencingToken(r.token.0 + 1), Some(r.token));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}

/// A complete of a record that does not exist is `LeaseLost` with no current token, and creates none.
pub async fn complete_of_absent_record_is_lease_lost(env: Env) {
    let id = claim_req(&env, "p", "never-claimed", b"body").id();
    assert_lease_lost(env.store.complete(id, FencingToken::FIRST, response()).await, id, FencingToken::FIRST, None);
    assert_eq!(get(env.store.as_ref(), id).await, None);
}

/// A fail of a record that does not exist is `LeaseLost` with no current token, and creates none.
pub async fn fail_of_absent_record_is_lease_lost(env: Env) {
    let id = claim_req(&env, "p", "never-claimed", b"body").id();
    assert_lease_lost(env.store.fail(id, FencingToken::FIRST).await, id, FencingToken::FIRST, None);
    assert_eq!(get(env.store.as_ref(), id).await, None);
}

/// After a fail, a complete with the same token is `LeaseLost`; the record stays failed.
pub async fn complete_after_fail_is_lease_lost(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    assert_lease_lost(env.store.complete(r.id, r.token, response()).await, r.id, r.token, Some(r.token));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(f));
}

/// After a complete, a fail with the same token is `LeaseLost`; the response stays.
pub async fn fail_after_complete_is_lease_lost(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    assert_lease_lost(env.store.fail(r.id, r.token).await, r.id, r.token, Some(r.token));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// Complete and fail of an in-flight record past `expires_at` are `LeaseLost` with no current token.
pub async fn writes_to_an_expired_record_are_lease_lost(env: Env) {
    let r = must_claim(&env, claim_req_timed(&env, "p", "k", b"body", Duration::from_secs(1), Duration::from_secs(2)))
        .await;
    env.clock.set(r.expires_at);
    assert_lease_lost(env.store.complete(r.id, r.token, response()).await, r.id, r.token, None);
    assert_lease_lost(env.store.fail(r.id, r.token).await, r.id, r.token, None);
    assert_eq!(get(env.store.as_ref(), r.id).await, None);
    env.clock.set(UnixMillis(r.expires_at.0 - 1));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r), "the refused writes changed nothing");
}

/// A late owner's complete racing 8 reclaimers: either the complete wins and every reclaim
/// conflicts, or one reclaim wins and the complete is `LeaseLost`.
pub async fn late_owner_racing_reclaimers_leaves_one_outcome(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS);
    let env = Arc::new(env);
    let outcomes = race(9, |i| {
        let env = Arc::clone(&env);
        let r = r.clone();
        async move {
            if i == 0 {
                Err(env.store.complete(r.id, r.token, response()).await)
            } else {
                Ok(env.store.reclaim(reclaim_req(&r)).await.expect("reclaim"))
            }
        }
    })
    .await;
    let mut complete_won = false;
    let mut reclaim_winners = Vec::new();
    for o in outcomes {
        match o {
            Err(Ok(done)) => {
                assert_eq!(done.token, r.token, "the completion's receipt carries its claim's token");
                complete_won = true;
            }
            Err(Err(e)) => assert!(e.is_lease_lost(), "the late complete lost with LeaseLost, got {e:?}"),
            Ok(idem_core::ReclaimOutcome::Reclaimed(n)) => reclaim_winners.push(n),
            Ok(idem_core::ReclaimOutcome::Conflict { .. }) => {}
        }
    }
    let now = get(env.store.as_ref(), r.id).await.expect("record present");
    if complete_won {
        assert!(reclaim_winners.is_empty(), "a reclaim won after the record completed: {reclaim_winners:?}");
        assert_eq!(now.state, RecordState::Completed);
        assert_eq!(now.response, Some(response()));
    } else {
        assert_eq!(reclaim_winners.len(), 1, "exactly one reclaim wins when the complete lost");
        assert_eq!(Some(now), reclaim_winners.pop());
    }
}
