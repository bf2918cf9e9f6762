//! Tenant isolation through the layer: two principals send the same key to the
//! same endpoint with the same body while the first one's record is in every row of the
//! decision table (in flight, completed, failed, mismatched, lease expired and reclaimed,
//! retention expired). The second tenant's request must run its own handler exactly once
//! and get its own answer: never the first tenant's status, headers, body, problem detail,
//! `Retry-After` or in-flight state.
//!
//! Tenant A is bearer `tok-a`, tenant B bearer `tok-b`; both send `POST
//! /v1/workers` with key `k1` and the same JSON body. The handler answers with the tenant's
//! own status, secret header and body, so any crossing shows.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use http::{HeaderMap, StatusCode};
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, FingerprintMode, IdempotencyKey, RecordId, RecordState,
    RequestParts, Scope,
};
use idem_http::{BearerToken, IdempotencyLayer};
use tokio::sync::Notify;

use super::HttpEnv;
use super::fixtures::{Got, Req, policy, post as post_req};
use super::frozen::on_io;
use super::lease::{LEASE, advance, answer, settle, start};

const ROUTE: &str = "/v1/workers";
const KEY: &str = "k1";
const BODY: &str = r#"{"pool":"gpu"}"#;
const A: &str = "tok-a";
const B: &str = "tok-b";

/// What a tenant's handler does on its next run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    Created,
    Fail,
    Hold,
}

/// The app: one handler that counts runs per tenant and answers with the tenant's own data.
#[derive(Clone, Default)]
struct Tenants {
    runs: Arc<Mutex<HashMap<String, usize>>>,
    plans: Arc<Mutex<HashMap<String, Plan>>>,
    started: Arc<Notify>,
    release: Arc<Notify>,
}

impl Tenants {
    fn runs(&self, tenant: &str) -> usize {
        self.runs.lock().unwrap().get(tenant).copied().unwrap_or(0)
    }

    fn plan(&self, tenant: &str, plan: Plan) {
        self.plans.lock().unwrap().insert(tenant.to_owned(), plan);
    }

    fn app(&self, layer: IdempotencyLayer) -> Router {
        let me = self.clone();
        Router::new()
            .route(
                ROUTE,
                post(move |headers: HeaderMap| {
                    let me = me.clone();
                    async move {
                        let auth = headers["authorization"].to_str().unwrap().to_owned();
                        let tenant = auth.trim_start_matches("Bearer ").to_owned();
                        *me.runs.lock().unwrap().entry(tenant.clone()).or_default() += 1;
                        let plan = me.plans.lock().unwrap().get(&tenant).copied().unwrap_or(Plan::Created);
                        if plan == Plan::Hold {
                            me.started.notify_one();
                            me.release.notified().await;
                        }
                        let status =
                            if plan == Plan::Fail { StatusCode::INTERNAL_SERVER_ERROR } else { status_of(&tenant) };
                        (status, [("x-secret", format!("{tenant}-secret"))], format!("{{\"owner\":\"{tenant}\"}}"))
                    }
                }),
            )
            .layer(layer)
    }
}

/// Each tenant's own success status, so a crossed status shows too.
fn status_of(tenant: &str) -> StatusCode {
    if tenant == A { StatusCode::CREATED } else { StatusCode::ACCEPTED }
}

fn req(tenant: &str) -> Req {
    post_req(ROUTE).token(tenant).key(KEY).body(BODY)
}

fn layer(b: &HttpEnv) -> IdempotencyLayer {
    IdempotencyLayer::new(b.dyn_store())
        .with_policy(policy(|p| (p.lease_ttl, p.retention) = (LEASE, Duration::from_secs(60))))
}

async fn send(app: &Router, r: &Req) -> Got {
    super::fixtures::send(app, r).await
}

/// `got` is `tenant`'s own fresh answer, and nothing in it names or comes from `other`.
#[track_caller]
fn own_answer(got: &Got, tenant: &str, other: &str) {
    assert_eq!(got.status, status_of(tenant), "{tenant} got someone's status: {}", got.text());
    assert_eq!(got.header("x-secret"), Some(format!("{tenant}-secret").as_str()));
    assert_eq!(got.text(), format!("{{\"owner\":\"{tenant}\"}}"));
    assert!(!got.replayed(), "{tenant}'s first answer is no replay");
    assert!(got.header("retry-after").is_none(), "{tenant} saw an in-flight or unavailable hint");
    never_names(got, other);
}

/// Nothing of `got` (headers, body, problem detail) carries `other`'s token, principal or data.
#[track_caller]
fn never_names(got: &Got, other: &str) {
    let principal = BearerToken::principal_for(other.as_bytes());
    let mut text = String::from_utf8_lossy(&got.body).into_owned();
    for (name, value) in &got.headers {
        text.push_str(&format!("\n{name}: {}", String::from_utf8_lossy(value.as_bytes())));
    }
    for needle in [other, principal.as_str(), &principal[7..], &format!("{other}-secret")] {
        assert!(!text.contains(needle), "an answer names the other tenant ({needle}):\n{text}");
    }
}

fn record_id(tenant: &str) -> RecordId {
    let scope = Scope::new(BearerToken::principal_for(tenant.as_bytes()), Endpoint::new("POST", ROUTE)).unwrap();
    scope.record_id(&IdempotencyKey::parse(KEY.as_bytes()).unwrap())
}

async fn state(b: &HttpEnv, tenant: &str) -> Option<(RecordState, u64)> {
    let store = b.dyn_store();
    let id = record_id(tenant);
    on_io(async move { store.get(id).await }).await.unwrap().map(|r| (r.state, r.token.0))
}

/// Row "in flight": A's handler is running; B runs its own, once, and gets its own answer.
pub async fn in_flight(b: HttpEnv) {
    let t = Tenants::default();
    let app = t.app(layer(&b));
    t.plan(A, Plan::Hold);
    let first = start(&app, &req(A));
    t.started.notified().await;
    settle(&b).await;
    assert_eq!(state(&b, A).await.map(|s| s.0), Some(RecordState::InFlight), "{}", b.name);

    let got = send(&app, &req(B)).await;
    own_answer(&got, B, A);
    assert_eq!((t.runs(A), t.runs(B)), (1, 1), "{}", b.name);
    // A's own duplicate still sees its own in-flight record.
    send(&app, &req(A)).await.problem(409, "in-flight");

    t.release.notify_one();
    settle(&b).await;
    advance(&b, Duration::from_millis(100)).await;
    own_answer(&answer(first).await, A, B);
    assert_eq!((t.runs(A), t.runs(B)), (1, 1), "{}", b.name);
}

/// Row "completed": A's stored response is never B's replay; each replays only its own.
pub async fn completed(b: HttpEnv) {
    let t = Tenants::default();
    let app = t.app(layer(&b));
    own_answer(&send(&app, &req(A)).await, A, B);
    own_answer(&send(&app, &req(B)).await, B, A);
    for (tenant, other) in [(A, B), (B, A)] {
        let replay = send(&app, &req(tenant)).await;
        assert!(replay.replayed(), "{}: {tenant}'s retry replays", b.name);
        assert_eq!(replay.status, status_of(tenant));
        assert_eq!(replay.header("x-secret"), Some(format!("{tenant}-secret").as_str()));
        never_names(&replay, other);
    }
    assert_eq!((t.runs(A), t.runs(B)), (1, 1), "{}", b.name);
}

/// Row "failed": A's failed record is neither reclaimed nor seen by B; A's retry reruns A.
pub async fn failed(b: HttpEnv) {
    let t = Tenants::default();
    let app = t.app(layer(&b));
    t.plan(A, Plan::Fail);
    let a = send(&app, &req(A)).await;
    assert_eq!(a.status, 500);
    never_names(&a, B);
    let (a_state, a_token) = state(&b, A).await.unwrap();
    assert_eq!(a_state, RecordState::Failed, "{}", b.name);

    own_answer(&send(&app, &req(B)).await, B, A);
    assert_eq!(state(&b, A).await, Some((RecordState::Failed, a_token)), "{}: B touched A's record", b.name);

    t.plan(A, Plan::Created);
    own_answer(&send(&app, &req(A)).await, A, B);
    assert_eq!((t.runs(A), t.runs(B)), (2, 1), "{}", b.name);
}

/// Row "mismatch": A used the key with another body first; B's same-key request with
/// either body is B's own first use. A's mismatch problem names nothing of B's.
pub async fn mismatch(b: HttpEnv) {
    let t = Tenants::default();
    let app = t.app(layer(&b));
    own_answer(&send(&app, &post_req(ROUTE).token(A).key(KEY).body("{\"pool\":\"cpu\"}")).await, A, B);
    let a_mismatch = send(&app, &req(A)).await;
    a_mismatch.problem(409, "mismatch");
    never_names(&a_mismatch, B);

    own_answer(&send(&app, &req(B)).await, B, A);
    let b_mismatch = send(&app, &post_req(ROUTE).token(B).key(KEY).body("{\"pool\":\"cpu\"}")).await;
    b_mismatch.problem(409, "mismatch");
    never_names(&b_mismatch, A);
    assert_eq!((t.runs(A), t.runs(B)), (1, 1), "{}", b.name);
}

/// Row "in flight, lease expired": a crashed process of A left A's record claimed; after
/// the lease B still only runs its own, and only A's retry reclaims A's record (token + 1).
pub async fn reclaimed(b: HttpEnv) {
    let t = Tenants::default();
    let app = t.app(layer(&b));
    // The claim a killed process of A left behind, with the fingerprint A's requests have.
    let headers: [(&str, &[u8]); 1] = [("content-type", b"application/json")];
    let fingerprint = Fingerprint::of_mode(
        &RequestParts { method: "POST", path: ROUTE, query: None, headers: &headers, body: BODY.as_bytes() },
        FingerprintMode::Raw,
    );
    let scope = Scope::new(BearerToken::principal_for(A.as_bytes()), Endpoint::new("POST", ROUTE)).unwrap();
    let claim = ClaimRequest::new(
        scope,
        IdempotencyKey::parse(KEY.as_bytes()).unwrap(),
        fingerprint,
        LEASE,
        Duration::from_secs(60),
    );
    let store = b.dyn_store();
    let claimed = on_io(async move { store.claim(claim).await }).await.unwrap();
    let ClaimOutcome::Claimed(orphan) = claimed else { panic!("{}: A's key was taken", b.name) };

    // While A's orphan is fresh, A's retry waits and B runs.
    send(&app, &req(A)).await.problem(409, "in-flight");
    own_answer(&send(&app, &req(B)).await, B, A);
    advance(&b, LEASE + Duration::from_secs(1)).await;
    assert_eq!(state(&b, A).await, Some((RecordState::InFlight, orphan.token.0)), "{}: B reclaimed A's", b.name);
    let b_again = send(&app, &req(B)).await;
    assert!(b_again.replayed() && b_again.status == status_of(B), "{}: B's retry replays B's own", b.name);
    never_names(&b_again, A);

    own_answer(&send(&app, &req(A)).await, A, B);
    assert_eq!(state(&b, A).await, Some((RecordState::Completed, orphan.token.0 + 1)), "{}", b.name);
    assert_eq!((t.runs(A), t.runs(B)), (1, 1), "{}", b.name);
}

/// Retention passed: A's expired record does not leak into B's, and A's new use is A's.
pub async fn expired(b: HttpEnv) {
    let t = Tenants::default();
    let app = t.app(layer(&b));
    own_answer(&send(&app, &req(A)).await, A, B);
    advance(&b, Duration::from_secs(61)).await;
    assert_eq!(state(&b, A).await, None, "{}: A's record outlived its retention", b.name);
    own_answer(&send(&app, &req(B)).await, B, A);
    own_answer(&send(&app, &req(A)).await, A, B);
    let a_replay = send(&app, &req(A)).await;
    assert!(a_replay.replayed());
    never_names(&a_replay, B);
    assert_eq!((t.runs(A), t.runs(B)), (2, 1), "{}", b.name);
}
