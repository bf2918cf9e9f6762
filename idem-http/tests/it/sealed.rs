//! Sealed responses and handlers that complete their own record: a handler completing
//! under sealing stores the sealed form (`IdempotencyContext::stored_form`) or gets 503 on
//! retry, never a second run; a record that stops opening during a bounded wait is a 503.
//! The sealing story on every backend (replay, moved and flipped seals, stored bytes, key
//! rotation, unsealed records) is `idem_conformance::http::sealed`, run from each store
//! crate by `http_tests!`.

use idem_conformance::{Forward, Forwarding};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::seal::{SEALED_HEADER, SEALED_STATUS, Sealing, SealingKeys};
use idem_core::{Endpoint, IdempotencyKey, MemoryStore, RecordId, Scope, Store};
use idem_http::IdempotencyLayer;
use tower::ServiceExt;

const PRINCIPAL: &str = "tenant-sealed";

/// The handler: counts its runs, answers 201 with a secret in a header and in the body.
#[derive(Clone)]
struct App {
    runs: Arc<AtomicUsize>,
    secret: String,
}

impl App {
    fn new() -> Self {
        Self { runs: Arc::default(), secret: format!("bootstrap-{}", uuid::Uuid::new_v4().simple()) }
    }

    fn router(&self, layer: IdempotencyLayer) -> Router {
        let (runs, secret) = (self.runs.clone(), self.secret.clone());
        Router::new()
            .route(
                "/v1/workers",
                post(move || {
                    let (runs, secret) = (runs.clone(), secret.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        (
                            StatusCode::CREATED,
                            [("x-bootstrap-token", secret.clone())],
                            format!("{{\"token\":\"{secret}\"}}"),
                        )
                    }
                }),
            )
            .layer(layer.with_principal_resolver(|_: &http::request::Parts| Some(PRINCIPAL.to_owned())))
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

fn layer(store: Arc<dyn Store>, keys: Option<SealingKeys>) -> IdempotencyLayer {
    let layer = IdempotencyLayer::new(store);
    match keys {
        Some(keys) => layer.with_sealing(Sealing::new(keys)),
        None => layer,
    }
}

fn record_id(key: &str) -> RecordId {
    let scope = Scope::new(PRINCIPAL, Endpoint::new("POST", "/v1/workers")).expect("scope");
    scope.record_id(&IdempotencyKey::parse(key.as_bytes()).expect("key"))
}

/// Sends one keyed POST; returns status, `Idempotent-Replayed`, the token header and body.
async fn send(router: &Router, key: &str) -> (StatusCode, bool, Option<String>, String) {
    let req = Request::post("/v1/workers")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from("{\"image\":\"base\"}"))
        .expect("request");
    let res = router.clone().oneshot(req).await.expect("infallible");
    let status = res.status();
    let replayed = res.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let token = res.headers().get("x-bootstrap-token").map(|v| v.to_str().expect("ascii").to_owned());
    let body = res.into_body().collect().await.expect("body").to_bytes();
    (status, replayed, token, String::from_utf8_lossy(&body).into_owned())
}

fn keys_v1() -> SealingKeys {
    SealingKeys::new(1, [0x11; 32])
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// A router whose handler completes its own record on `raw` (the store without the
/// layer's wrappers, as `PostgresStore::complete_in` writes in the handler's transaction)
/// and says so with `CompletedByHandler`; `use_stored_form` picks what it stores.
fn completing_router(
    raw: Arc<MemoryStore>,
    keys: SealingKeys,
    runs: Arc<AtomicUsize>,
    use_stored_form: bool,
) -> Router {
    use axum::extract::Extension;
    use axum::response::IntoResponse;
    use idem_core::StoredResponse;
    use idem_http::{IdempotencyContext, ResponseCaching};
    let store: Arc<dyn Store> = raw.clone();
    let handler = move |Extension(ctx): Extension<IdempotencyContext>| {
        let (raw, runs) = (raw.clone(), runs.clone());
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let plain = StoredResponse::new(201, vec![], b"{\"token\":\"own-secret\"}".to_vec());
            let stored = if use_stored_form { ctx.stored_form(plain) } else { plain };
            raw.complete(ctx.record_id(), ctx.token(), stored).await.expect("the handler's own completion");
            (StatusCode::CREATED, Extension(ResponseCaching::CompletedByHandler), "{\"token\":\"own-secret\"}")
                .into_response()
        }
    };
    Router::new()
        .route("/v1/workers", post(handler))
        .layer(layer(store, Some(keys)).with_principal_resolver(|_: &http::request::Parts| Some(PRINCIPAL.to_owned())))
}

// Pins: a handler completing its own record (CompletedByHandler) under sealing had no way
// to seal with the layer's keys, so it stored the plain response: the secret sat in the
// store unsealed and every retry got 503. `IdempotencyContext::stored_form` seals it.
#[tokio::test]
async fn a_handler_completing_its_own_record_stores_it_sealed_and_retries_replay() {
    let raw = Arc::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let router = completing_router(raw.clone(), keys_v1(), runs.clone(), true);
    let (status, replayed, _, body) = send(&router, "own-1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert!(body.contains("own-secret"));
    let stored = raw.get(record_id("own-1")).await.expect("get").expect("record").response.expect("completed");
    assert_eq!(stored.status, SEALED_STATUS, "the handler's completion is stored sealed");
    assert!(stored.header(SEALED_HEADER).is_some());
    assert!(!contains(&idem_core::codec::encode_response(&stored), "own-secret"), "plaintext in the store");
    let (status, replayed, _, body) = send(&router, "own-1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true), "the retry replays the opened response");
    assert!(body.contains("own-secret"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// What a handler that stores the plain response anyway gets: its own answer (the
/// completion committed), then 503 for every retry and never a second run.
#[tokio::test]
async fn a_handler_completing_its_own_record_unsealed_gets_503_on_retry_not_a_rerun() {
    let raw = Arc::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let router = completing_router(raw.clone(), keys_v1(), runs.clone(), false);
    assert_eq!(send(&router, "own-2").await.0, StatusCode::CREATED);
    let (status, replayed, _, body) = send(&router, "own-2").await;
    assert_eq!((status, replayed), (StatusCode::SERVICE_UNAVAILABLE, false));
    assert!(!body.contains("own-secret"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A memory store on which the first attempt of a key finishes right after a duplicate's
/// claim found it in flight: its response is written plain (as by an instance without
/// sealing), so the duplicate's next read finds a completed record that does not open.
#[derive(Debug, Default)]
struct FinishesPlainAfterClaim {
    inner: MemoryStore,
}

#[async_trait::async_trait]
impl Forward for FinishesPlainAfterClaim {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(&self, req: idem_core::ClaimRequest) -> Result<idem_core::ClaimOutcome, idem_core::StoreError> {
        let out = self.inner.claim(req).await?;
        if let idem_core::ClaimOutcome::Existing { record, .. } = &out
            && record.state == idem_core::RecordState::InFlight
        {
            let plain = idem_core::StoredResponse::new(201, vec![], b"{\"token\":\"plain\"}".to_vec());
            self.inner.complete(record.id, record.token, plain).await?;
        }
        Ok(out)
    }
}

// Pins: with a bounded in-flight wait, a record that stopped opening while the duplicate
// waited (completed unsealed, or sealed with a key this instance lacks) was answered 409
// in-flight with Retry-After, inviting retries, instead of 503 with x-should-retry: false
// like every other read of a record that does not open.
#[tokio::test]
async fn a_record_that_does_not_open_during_a_bounded_wait_is_a_503_not_a_409() {
    let store = Arc::new(Forwarding(FinishesPlainAfterClaim::default()));
    // The first attempt: claimed with the fingerprint the duplicate's request has, still running.
    let headers: [(&str, &[u8]); 1] = [("content-type", b"application/json")];
    let fp = idem_core::Fingerprint::of(&idem_core::RequestParts {
        method: "POST",
        path: "/v1/workers",
        query: None,
        headers: &headers,
        body: b"{\"image\":\"base\"}",
    });
    let scope = Scope::new(PRINCIPAL, Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(b"wait-1").expect("key");
    let claim = idem_core::ClaimRequest::new(
        scope,
        key,
        fp,
        std::time::Duration::from_secs(60),
        std::time::Duration::from_secs(3600),
    );
    assert!(matches!(store.inner.claim(claim).await, Ok(idem_core::ClaimOutcome::Claimed(_))));
    let app = App::new();
    let waiting = layer(store.clone(), Some(keys_v1())).with_in_flight_wait(Some(std::time::Duration::from_secs(30)));
    let router = app.router(waiting);
    let req = Request::post("/v1/workers")
        .header("idempotency-key", "wait-1")
        .header("content-type", "application/json")
        .body(Body::from("{\"image\":\"base\"}"))
        .expect("request");
    let res = router.oneshot(req).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "a record that does not open is a 503");
    assert_eq!(res.headers().get("x-should-retry").map(|v| v.as_bytes()), Some(&b"false"[..]));
    assert_eq!(app.runs(), 0);
}
