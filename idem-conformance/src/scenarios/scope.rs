//! Scope isolation: the same key under another principal or endpoint is another record,
//! so tenants never see or block each other (`docs/failures.md#key-shared-across-endpoints`,
//! `docs/failures.md#key-shared-across-principals`).

use idem_core::{ClaimRequest, Endpoint, FencingToken, RecordState, Scope, UnixMillis};

use super::{LEASE, RETENTION, claim_req, claimed, completed, existing, fp, get, key, must_claim, response};
use crate::Env;

fn req_in(env: &Env, principal: &str, method: &str, route: &str, k: &str, body: &[u8]) -> ClaimRequest {
    let scope = Scope::new(env.principal(principal), Endpoint::new(method, route)).expect("non-empty principal");
    ClaimRequest::new(scope, key(k), fp(body), LEASE, RETENTION)
}

/// The same key from another principal is its own record and never sees the first's response.
pub async fn same_key_other_principal_is_another_record(env: Env) {
    let p = must_claim(&env, req_in(&env, "P", "POST", "/orders", "K", b"b")).await;
    completed(env.store.as_ref(), &p, response()).await;
    let q = claimed(env.store.as_ref(), req_in(&env, "Q", "POST", "/orders", "K", b"b")).await;
    assert_ne!(q.id, p.id);
    assert_eq!(q.token, FencingToken::first_at(UnixMillis(env.clock.now_ms())), "Q's record starts its own generation");
    assert_eq!(q.response, None, "Q never sees P's response");
}

/// A principal holding a key in flight does not block another principal's same key.
pub async fn in_flight_claim_of_one_principal_does_not_block_another(env: Env) {
    let q = must_claim(&env, req_in(&env, "Q", "POST", "/orders", "K", b"b")).await;
    let p = claimed(env.store.as_ref(), req_in(&env, "P", "POST", "/orders", "K", b"b")).await;
    assert_eq!(p.state, RecordState::InFlight);
    assert_eq!(get(env.store.as_ref(), q.id).await, Some(q));
}

/// The same key on another endpoint (`POST /projects`, `POST /applications`) is another record.
pub async fn same_key_other_endpoint_is_another_record(env: Env) {
    let projects = must_claim(&env, req_in(&env, "P", "POST", "/projects", "K", b"b1")).await;
    completed(env.store.as_ref(), &projects, response()).await;
    let apps = claimed(env.store.as_ref(), req_in(&env, "P", "POST", "/applications", "K", b"b2")).await;
    assert_ne!(apps.id, projects.id);
    assert_eq!(apps.response, None, "the second endpoint runs on its own and never gets proj_1");
}

/// The same key on `PUT /tickets/1` and `PUT /tickets/2` gives two records.
pub async fn same_key_other_path_is_another_record(env: Env) {
    let one = must_claim(&env, req_in(&env, "P", "PUT", "/tickets/1", "K", b"b")).await;
    let two = claimed(env.store.as_ref(), req_in(&env, "P", "PUT", "/tickets/2", "K", b"b")).await;
    assert_ne!(one.id, two.id);
    let get_one = claimed(env.store.as_ref(), req_in(&env, "P", "GET", "/tickets/1", "K", b"b")).await;
    assert_ne!(get_one.id, one.id, "the method is part of the endpoint");
}

/// Completing a key in one scope leaves the same key in another scope in flight.
pub async fn completing_in_one_scope_leaves_the_other_untouched(env: Env) {
    let a = must_claim(&env, claim_req(&env, "A", "K", b"body")).await;
    let b = must_claim(&env, claim_req(&env, "B", "K", b"body")).await;
    completed(env.store.as_ref(), &a, response()).await;
    assert_eq!(get(env.store.as_ref(), b.id).await, Some(b.clone()));
    let (seen, _) = existing(env.store.as_ref(), claim_req(&env, "B", "K", b"body")).await;
    assert_eq!(seen.state, RecordState::InFlight);
}

/// Moving bytes between principal and endpoint (`ab`+`c` vs `a`+`bc`) gives another record.
pub async fn moving_bytes_between_scope_fields_is_another_record(env: Env) {
    let a = must_claim(&env, req_in(&env, "ab", "POST", "c", "K", b"b")).await;
    let b = claimed(env.store.as_ref(), req_in(&env, "a", "POST", "bc", "K", b"b")).await;
    assert_ne!(a.id, b.id);
    assert_eq!(get(env.store.as_ref(), a.id).await.map(|r| r.scope), Some(a.scope));
    assert_eq!(get(env.store.as_ref(), b.id).await.map(|r| r.scope), Some(b.scope));
}
