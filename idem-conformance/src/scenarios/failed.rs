//! The failed state: a handler error, panic or 5xx marks the record failed; a retry with
//! the same fingerprint reclaims it at once. Pins `docs/failures.md#orphaned-claim-blocks-retries`,
//! `docs/failures.md#server-error-cached-and-replayed` and
//! `docs/failures.md#partial-side-effect-repeated-after-a-failure` at the record level.

use idem_core::{FencingToken, RecordState};

use super::{claim_req, completed, conflict, failed, fp, get, must_claim, reclaim_req, reclaimed, response};
use crate::Env;

/// A failed record is reclaimable at once, without waiting for the lease.
pub async fn failed_record_is_reclaimable_at_once(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    let n = reclaimed(env.store.as_ref(), reclaim_req(&f)).await;
    assert_eq!(n.token, r.token.next());
    assert_eq!(n.state, RecordState::InFlight);
}

/// A failed record is reclaimed only by the same fingerprint; another request conflicts.
pub async fn failed_record_reclaim_needs_the_same_fingerprint(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    let mut req = reclaim_req(&f);
    req.fingerprint = fp(b"another body");
    assert_eq!(conflict(env.store.as_ref(), req).await, Some(f.clone()));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(f));
}

/// Fail ends the lease now (`lease_expires_at = now`), keeps the token, retention and no response.
pub async fn fail_ends_the_lease_and_keeps_retention(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(1_500);
    let now = env.clock.now_ms();
    let f = failed(env.store.as_ref(), &r).await;
    let mut expected = r.clone();
    expected.state = RecordState::Failed;
    expected.lease_expires_at = idem_core::UnixMillis(now);
    assert_eq!(f, expected);
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(f));
}

/// fail, reclaim, complete: the retry's response is stored under the next token.
pub async fn failed_then_reclaimed_record_completes(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let f = failed(env.store.as_ref(), &r).await;
    let n = reclaimed(env.store.as_ref(), reclaim_req(&f)).await;
    let done = completed(env.store.as_ref(), &n, response()).await;
    assert_eq!(done.token, r.token.next());
    assert_eq!(done.response, Some(response()));
    assert_eq!(done.created_at, r.created_at);
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// Repeated fail-then-reclaim cycles raise the token each time and never lose the record.
pub async fn repeated_failures_keep_raising_the_token(env: Env) {
    let mut r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let first = r.token;
    for round in 1..=4 {
        env.clock.advance_ms(100);
        let f = failed(env.store.as_ref(), &r).await;
        r = reclaimed(env.store.as_ref(), reclaim_req(&f)).await;
        assert_eq!(r.token, FencingToken(first.0 + round));
    }
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}
