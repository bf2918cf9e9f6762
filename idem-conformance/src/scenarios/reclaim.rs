//! Reclaim: compare-and-set takeover of a stale claim or a failed record, and the races
//! between reclaimers. Of N reclaims presenting the same token exactly one wins.

use std::sync::Arc;

use idem_core::{ClaimOutcome, FencingToken, ReclaimOutcome, Record, RecordState, Store};

use super::{
    LEASE_MS, claim_req, completed, conflict, existing, failed, fp, get, must_claim, race, reclaim_req, reclaimed,
    response,
};
use crate::Env;

/// Races `n` reclaims of `record` (alternating between the env's store and a peer handle)
/// and checks exactly one wins with token + 1 and every loser sees the winner.
async fn one_winner_of(env: &Env, record: &Record, n: usize) -> Record {
    let stores: [Arc<dyn Store>; 2] = [Arc::clone(&env.store), env.peer().await];
    let outcomes = race(n, |i| {
        let store = Arc::clone(&stores[i % 2]);
        let req = reclaim_req(record);
        async move { store.reclaim(req).await.expect("reclaim") }
    })
    .await;
    let mut winners = Vec::new();
    let mut losers = Vec::new();
    for o in outcomes {
        match o {
            ReclaimOutcome::Reclaimed(r) => winners.push(r),
            ReclaimOutcome::Conflict { current, .. } => losers.push(current),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one of {n} reclaimers wins, got {winners:?}");
    let winner = winners.remove(0);
    assert_eq!(winner.token, record.token.next());
    assert_eq!(winner.state, RecordState::InFlight);
    for current in losers {
        assert_eq!(current.as_ref(), Some(&winner), "a loser sees the winner's record");
    }
    assert_eq!(get(env.store.as_ref(), record.id).await, Some(winner.clone()));
    winner
}

/// 8 reclaimers of one stale claim: exactly one wins, the others see its record.
pub async fn eight_reclaimers_of_a_stale_claim_have_one_winner(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS);
    one_winner_of(&env, &r, 8).await;
}

/// 8 reclaimers of one failed record: exactly one wins, the others see its record.
pub async fn eight_reclaimers_of_a_failed_record_have_one_winner(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    one_winner_of(&env, &f, 8).await;
}

/// A reclaim of a completed record conflicts, however late, and the response stays.
pub async fn reclaim_of_completed_record_conflicts(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    env.clock.advance_ms(LEASE_MS * 4);
    assert_eq!(conflict(env.store.as_ref(), reclaim_req(&done)).await, Some(done.clone()));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// A reclaim of a stale claim with another fingerprint conflicts and changes nothing.
pub async fn reclaim_with_wrong_fingerprint_conflicts(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS + 1);
    let mut req = reclaim_req(&r);
    req.fingerprint = fp(b"another body");
    assert_eq!(conflict(env.store.as_ref(), req).await, Some(r.clone()));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}

/// A reclaim of a record that does not exist conflicts with no current record and creates none.
pub async fn reclaim_of_absent_record_conflicts_with_none(env: Env) {
    let req = claim_req(&env, "p", "never-claimed", b"body");
    let reclaim = idem_core::ReclaimRequest {
        id: req.id(),
        expected: FencingToken::FIRST,
        fingerprint: req.fingerprint(),
        lease_ttl: super::LEASE,
        retention: super::RETENTION,
    };
    assert_eq!(conflict(env.store.as_ref(), reclaim).await, None);
    assert_eq!(get(env.store.as_ref(), req.id()).await, None);
}

/// A reclaim presenting a token the record never had (current + 1) conflicts.
pub async fn reclaim_with_a_future_token_conflicts(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS + 1);
    let mut req = reclaim_req(&r);
    req.expected = r.token.next();
    assert_eq!(conflict(env.store.as_ref(), req).await, Some(r.clone()));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}

/// Five takeovers in a row raise the token by one each: first + 1, ..., first + 5.
pub async fn each_reclaim_raises_the_token_by_one(env: Env) {
    let mut r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let first = r.token;
    for n in 1..=5 {
        env.clock.advance_ms(LEASE_MS);
        r = reclaimed(env.store.as_ref(), reclaim_req(&r)).await;
        assert_eq!(r.token, FencingToken(first.0 + n));
    }
}

/// Claims racing reclaims of a stale claim never replace it: one reclaim wins, claims see a record.
pub async fn claims_racing_reclaims_never_replace_the_record(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(LEASE_MS);
    let env = Arc::new(env);
    let outcomes = race(16, |i| {
        let env = Arc::clone(&env);
        let r = r.clone();
        async move {
            if i % 2 == 0 {
                Err(env.store.claim(claim_req(&env, "p", "k", b"body")).await.expect("claim"))
            } else {
                Ok(env.store.reclaim(reclaim_req(&r)).await.expect("reclaim"))
            }
        }
    })
    .await;
    let mut winners = 0;
    for o in outcomes {
        match o {
            Err(ClaimOutcome::Existing { record, .. }) => assert_eq!(record.id, r.id),
            Err(other) => panic!("a claim replaced a live record: {other:?}"),
            Ok(ReclaimOutcome::Reclaimed(n)) => {
                winners += 1;
                assert_eq!(n.token, r.token.next());
            }
            Ok(ReclaimOutcome::Conflict { .. }) => {}
        }
    }
    assert_eq!(winners, 1, "exactly one reclaim wins");
    let (now_record, _) = existing(env.store.as_ref(), claim_req(&env, "p", "k", b"body")).await;
    assert_eq!(now_record.token, r.token.next());
}
