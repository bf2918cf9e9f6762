//! The named scenarios. Each is a plain `pub async fn(Env)` whose doc line says what must
//! hold. Add a scenario: write it in its group and list it in `__for_each_scenario!`.

use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Record, Scope};

use crate::Env;

pub mod claim;

/// The lease used by scenarios unless they say otherwise.
pub const LEASE: Duration = Duration::from_secs(5);
/// The retention used by scenarios unless they say otherwise.
pub const RETENTION: Duration = Duration::from_secs(60);

/// A claim request for `key` under `principal` (inside the env's namespace) on `POST /e`.
#[must_use]
pub fn claim_req(env: &Env, principal: &str, key: &str, body: &[u8]) -> ClaimRequest {
    let scope = Scope::new(env.principal(principal), Endpoint::new("POST", "/e")).expect("non-empty principal");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("valid key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(body), LEASE, RETENTION)
}

/// Claims and expects to win.
pub async fn must_claim(env: &Env, req: ClaimRequest) -> Record {
    match env.store.claim(req).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

#[doc(hidden)]
#[macro_export]
macro_rules! __for_each_scenario {
    ($m:path, $backend:expr) => {
        $m!($backend, claim::absent_record_is_claimed_with_token_one);
        $m!($backend, claim::second_claim_sees_existing_record);
        $m!($backend, claim::concurrent_claims_have_exactly_one_winner);
    };
}
