//! Claim: create-if-absent.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimOutcome, FencingToken, RecordState, UnixMillis};

use super::{claim_req, claim_req_timed, completed, existing, failed, get, must_claim, race, response};
use crate::Env;

/// A claim on an absent record wins, in flight, with the first token of its time
/// (`FencingToken::first_at(now)`), and finite lease and retention.
pub async fn absent_record_is_claimed_with_the_first_token_of_its_time(env: Env) {
    let now = env.clock.now_ms();
    let r = must_claim(&env, claim_req(&env, "p", "k1", b"body")).await;
    assert_eq!(r.token, FencingToken::first_at(UnixMillis(now)));
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

/// A claim stores the request's scope, key and fingerprint exactly, with no response.
pub async fn claim_stores_scope_key_and_fingerprint(env: Env) {
    let req = claim_req(&env, "p", "k-scope", b"the body");
    let r = must_claim(&env, req.clone()).await;
    assert_eq!(r.id, req.id());
    assert_eq!(&r.scope, req.scope());
    assert_eq!(&r.key, req.key());
    assert_eq!(r.fingerprint, req.fingerprint());
    assert_eq!(r.response, None);
    assert_eq!(r.started_at, r.created_at);
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}

/// A claim of a completed record returns it, response included, and changes nothing.
pub async fn claim_of_completed_record_returns_it_with_response(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    env.clock.advance_ms(1_000);
    let (seen, now) = existing(env.store.as_ref(), claim_req(&env, "p", "k", b"body")).await;
    assert_eq!(seen, done);
    assert_eq!(seen.response, Some(response()));
    assert_eq!(now.0, env.clock.now_ms());
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// A claim of a failed record returns it failed; only a reclaim takes a failed record over.
pub async fn claim_of_failed_record_returns_it_failed(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    env.clock.advance_ms(10);
    let (seen, _) = existing(env.store.as_ref(), claim_req(&env, "p", "k", b"body")).await;
    assert_eq!(seen, f);
    assert_eq!(seen.state, RecordState::Failed);
}

/// A claim never replaces an in-flight record whose lease expired: it reports it, unchanged.
pub async fn claim_never_takes_over_a_stale_in_flight_record(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.set(UnixMillis(r.lease_expires_at.0 + 1_000));
    let (seen, _) = existing(env.store.as_ref(), claim_req(&env, "p", "k", b"body")).await;
    assert_eq!(seen, r, "the stale claim is reported as is, token {}", r.token);
}

/// A retention shorter than the lease is raised to the lease: `expires_at = now + lease`.
pub async fn retention_shorter_than_lease_is_raised_to_the_lease(env: Env) {
    let now = env.clock.now_ms();
    let req = claim_req_timed(&env, "p", "k", b"body", Duration::from_secs(30), Duration::from_secs(2));
    let r = must_claim(&env, req).await;
    assert_eq!(r.lease_expires_at.0, now + 30_000);
    assert_eq!(r.expires_at.0, now + 30_000);
}

/// Two keys in one scope are two records: claiming one leaves the other absent.
pub async fn distinct_keys_in_one_scope_are_distinct_records(env: Env) {
    let a = must_claim(&env, claim_req(&env, "p", "key-a", b"body")).await;
    let b_req = claim_req(&env, "p", "key-b", b"body");
    assert_ne!(a.id, b_req.id());
    assert_eq!(get(env.store.as_ref(), b_req.id()).await, None);
    let b = must_claim(&env, b_req).await;
    assert_eq!(b.token, FencingToken::first_at(UnixMillis(env.clock.now_ms())));
    assert_eq!(get(env.store.as_ref(), a.id).await, Some(a));
}

/// 16 tasks claim 16 different keys at once: every one wins its own record.
pub async fn concurrent_claims_of_distinct_keys_all_win(env: Env) {
    let env = Arc::new(env);
    let outcomes = race(16, |i| {
        let env = Arc::clone(&env);
        async move { env.store.claim(claim_req(&env, "p", &format!("key-{i}"), b"body")).await.expect("claim") }
    })
    .await;
    for (i, o) in outcomes.into_iter().enumerate() {
        match o {
            ClaimOutcome::Claimed(r) => {
                assert_eq!(r.key.as_str(), format!("key-{i}"));
                assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
            }
            other => panic!("key-{i}: expected Claimed, got {other:?}"),
        }
    }
}
