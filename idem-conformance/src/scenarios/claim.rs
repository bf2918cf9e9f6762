//! Claim: create-if-absent.

use std::sync::Arc;

use idem_core::{ClaimOutcome, FencingToken, RecordState};

use super::{claim_req, must_claim};
use crate::Env;

/// A claim on an absent record wins, with token 1, in flight, and finite lease and retention.
pub async fn absent_record_is_claimed_with_token_one(env: Env) {
    let now = env.clock.now_ms();
    let r = must_claim(&env, claim_req(&env, "p", "k1", b"body")).await;
    assert_eq!(r.token, FencingToken::FIRST);
    assert_eq!(r.state, RecordState::InFlight);
    assert_eq!(r.created_at.0, now);
    assert_eq!(r.lease_expires_at.0, now + 5_000);
    assert_eq!(r.expires_at.0, now + 60_000);
    let got = env.store.get(r.id).await.expect("get").expect("record present");
    assert_eq!(got, r);
}

/// A second claim of the same id changes nothing and returns the stored record.
pub async fn second_claim_sees_existing_record(env: Env) {
    let first = must_claim(&env, claim_req(&env, "p", "k1", b"body")).await;
    env.clock.advance_ms(10);
    match env.store.claim(claim_req(&env, "p", "k1", b"other")).await.expect("claim") {
        ClaimOutcome::Existing { record, now } => {
            assert_eq!(record, first);
            assert_eq!(now.0, first.created_at.0 + 10);
        }
        other => panic!("expected Existing, got {other:?}"),
    }
}

/// 32 tasks claim one key at once: exactly one gets `Claimed`, the rest see its record.
pub async fn concurrent_claims_have_exactly_one_winner(env: Env) {
    let env = Arc::new(env);
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let env = Arc::clone(&env);
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            let req = claim_req(&env, "p", "race", b"body");
            barrier.wait().await;
            env.store.claim(req).await.expect("claim")
        }));
    }
    let mut winners = Vec::new();
    let mut seen = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            ClaimOutcome::Claimed(r) => winners.push(r),
            ClaimOutcome::Existing { record, .. } => seen.push(record),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one claim wins");
    assert!(seen.iter().all(|r| r.token == winners[0].token && r.fingerprint == winners[0].fingerprint));
}
