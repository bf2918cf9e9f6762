//! Replay and mismatch, at the record level: a completed record keeps its response
//! byte-exact and replays it to every reader; a request with another fingerprint changes
//! nothing. Pins `docs/failures.md#replay-loses-status-headers-or-body`,
//! `docs/failures.md#rejected-duplicate-deletes-the-record` and
//! `docs/failures.md#server-error-cached-and-replayed` at the record level.

use idem_core::{RecordState, StoredResponse};

use super::{assert_lease_lost, claim_req, completed, existing, get, must_claim, reclaim_req, response};
use crate::Env;

/// A completed record keeps the status, every header and the body bytes exactly.
pub async fn completed_record_keeps_status_headers_and_body(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let resp = StoredResponse::new(
        201,
        vec![
            ("content-type".to_owned(), b"application/json; charset=utf-8".to_vec()),
            ("location".to_owned(), b"/tickets/42".to_vec()),
            ("etag".to_owned(), b"W/\"0815\"".to_vec()),
            ("x-request-cost".to_owned(), b"".to_vec()),
        ],
        b"{\"id\":\"tkt_42\",\"labels\":{}}\n".to_vec(),
    );
    completed(env.store.as_ref(), &r, resp.clone()).await;
    let got = get(env.store.as_ref(), r.id).await.expect("record present");
    assert_eq!(got.state, RecordState::Completed);
    assert_eq!(got.response, Some(resp));
}

/// Repeated header names keep their order and every value (`link` twice, `vary` twice).
pub async fn completed_record_keeps_header_order_and_repeats(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let headers = vec![
        ("link".to_owned(), b"</a>; rel=\"next\"".to_vec()),
        ("vary".to_owned(), b"accept".to_vec()),
        ("link".to_owned(), b"</b>; rel=\"prev\"".to_vec()),
        ("vary".to_owned(), b"accept-encoding".to_vec()),
        ("content-type".to_owned(), b"text/plain".to_vec()),
    ];
    let resp = StoredResponse::new(200, headers.clone(), b"ok".to_vec());
    completed(env.store.as_ref(), &r, resp).await;
    let got = get(env.store.as_ref(), r.id).await.expect("record present").response.expect("response");
    assert_eq!(got.headers, headers);
}

/// Complete changes only state and response: token, fingerprint and all timestamps stay.
pub async fn complete_keeps_token_and_timestamps(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    env.clock.advance_ms(1_234);
    let done = completed(env.store.as_ref(), &r, response()).await;
    let mut expected = r.clone();
    expected.state = RecordState::Completed;
    expected.response = Some(response());
    assert_eq!(done, expected);
}

/// The record complete returns is the record get reads afterwards.
pub async fn complete_returns_what_get_reads(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// A completed record reads the same on every get, every claim and every handle.
pub async fn completed_record_reads_the_same_every_time(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    let peer = env.peer().await;
    for i in 0..3 {
        env.clock.advance_ms(1_000);
        assert_eq!(get(env.store.as_ref(), r.id).await.as_ref(), Some(&done), "get #{i}");
        assert_eq!(get(peer.as_ref(), r.id).await.as_ref(), Some(&done), "peer get #{i}");
        assert_eq!(existing(peer.as_ref(), claim_req(&env, "p", "k", b"body")).await.0, done, "claim #{i}");
    }
}

/// A claim with another fingerprint on a completed record changes nothing.
pub async fn mismatched_claim_leaves_completed_record_untouched(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    let (seen, _) = existing(env.store.as_ref(), claim_req(&env, "p", "k", b"another body")).await;
    assert_eq!(seen, done, "the record keeps the first request's fingerprint and response");
    let mut mismatched = reclaim_req(&done);
    mismatched.fingerprint = super::fp(b"another body");
    let current = super::conflict(env.store.as_ref(), mismatched).await;
    assert_eq!(current, Some(done.clone()));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// A cached client error keeps its exact status and body: 422 stays 422.
pub async fn cached_client_error_keeps_its_status(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let resp = StoredResponse::new(
        422,
        vec![("content-type".to_owned(), b"application/problem+json".to_vec())],
        br#"{"type":"about:blank","title":"invalid zone","status":422}"#.to_vec(),
    );
    completed(env.store.as_ref(), &r, resp.clone()).await;
    assert_eq!(get(env.store.as_ref(), r.id).await.expect("present").response, Some(resp));
}

/// A second complete (or a fail) by the owner after completion is `LeaseLost`; the first
/// response stays.
pub async fn second_complete_by_the_owner_is_lease_lost(env: Env) {
    let r = must_claim(&env, claim_req(&env, "p", "k", b"body")).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    let other = StoredResponse::new(500, vec![], b"overwritten".to_vec());
    assert_lease_lost(env.store.complete(r.id, r.token, other).await, r.id, r.token, Some(r.token));
    assert_lease_lost(env.store.fail(r.id, r.token).await, r.id, r.token, Some(r.token));
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}
