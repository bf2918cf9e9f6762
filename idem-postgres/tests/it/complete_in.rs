//! `complete_in` under the fencing rules: a stale token after a reclaim, and a
//! completion whose transaction rolls back.

use crate::common;

use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ManualClock, Receipt, ReclaimOutcome,
    ReclaimRequest, RecordState, Scope, Store, StoreError, StoredResponse,
};

use common::{SchemaGuard, Via};

fn claim_req() -> ClaimRequest {
    ClaimRequest::new(
        Scope::new("p", Endpoint::new("POST", "/v1/workers")).expect("scope"),
        IdempotencyKey::parse(b"k").expect("key"),
        Fingerprint::of_bytes(b"{}"),
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
}

// Pins: complete_in with the token of an attempt whose lease ran out and was reclaimed must
// be refused (LeaseLost naming the new token) and write nothing, else the old attempt's
// rows and response would commit over the new owner's.
#[tokio::test]
async fn a_stale_token_after_a_reclaim_is_fenced_inside_the_transaction() {
    let guard = SchemaGuard::fresh().await;
    let clock = ManualClock::starting_now();
    let store = common::store(Via::Direct, &guard.name, Some(clock.clone()), 4).await;
    let ClaimOutcome::Claimed(old) = store.claim(claim_req()).await.expect("claim") else { panic!("claimed") };
    clock.advance(Duration::from_secs(31));
    let req = ReclaimRequest {
        id: old.id,
        expected: old.token,
        fingerprint: old.fingerprint,
        lease_ttl: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    let ReclaimOutcome::Reclaimed(new) = store.reclaim(req).await.expect("reclaim") else { panic!("reclaimed") };
    assert_ne!(new.token, old.token);

    let pool = common::pool(Via::Direct, 1).await;
    let mut tx = pool.begin().await.expect("begin");
    let stale = store.complete_in(&mut tx, old.id, old.token, StoredResponse::new(201, vec![], b"old".to_vec())).await;
    match stale {
        Err(StoreError::LeaseLost { presented, current, .. }) => {
            assert_eq!(presented, old.token);
            assert_eq!(current, Some(new.token));
        }
        other => panic!("expected LeaseLost, got {other:?}"),
    }
    tx.rollback().await.expect("rollback");
    let now = store.get(old.id).await.expect("get").expect("record");
    assert_eq!((now.state, now.token, now.response), (RecordState::InFlight, new.token, None));

    // A completion that rolls back leaves the owner's claim as it was: it can still complete.
    let mut tx = pool.begin().await.expect("begin");
    store.complete_in(&mut tx, new.id, new.token, StoredResponse::new(201, vec![], b"x".to_vec())).await.expect("in");
    tx.rollback().await.expect("rollback");
    let now = store.get(new.id).await.expect("get").expect("record");
    assert_eq!((now.state, now.token), (RecordState::InFlight, new.token), "the rollback undid the completion");
    let done = store.complete(new.id, new.token, StoredResponse::new(201, vec![], b"new".to_vec())).await;
    let receipt = done.expect("complete");
    let written = store.get(new.id).await.expect("get").expect("record");
    assert_eq!(receipt, Receipt::of(&written), "the receipt reports the record as written");
    assert_eq!(written.state, RecordState::Completed);
}
