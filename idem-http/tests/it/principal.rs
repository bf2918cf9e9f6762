//! The principal resolver's answers the layer refuses or pins: a blank principal
//! (empty or whitespace only) shared one bucket by every request that resolved to it, or
//! skipped idempotency under `SkipIdempotency`; a resolver asked twice for one request
//! could give its claim and its handler two different principals. And `BearerToken`'s
//! answers (its hash is pinned by the test vectors).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use idem_core::{MemoryStore, RecordId, RecordState, Store};
use idem_http::{BearerToken, IdempotencyContext, IdempotencyLayer, MissingPrincipal, PrincipalResolver};
use tower::{Layer, ServiceExt};

const ENDPOINT: &str = "POST /v1/workers";

/// Sends one keyed POST through `layer` with a handler that counts its runs and reports the
/// principal of its context; returns (status, problem type, runs, handler's principal).
async fn send(layer: &IdempotencyLayer, runs: &Arc<AtomicUsize>) -> (u16, String, Option<String>) {
    let seen = Arc::new(std::sync::Mutex::new(None));
    let handler = tower::service_fn({
        let (runs, seen) = (runs.clone(), seen.clone());
        move |req: Request<Full<Bytes>>| {
            runs.fetch_add(1, Ordering::SeqCst);
            *seen.lock().unwrap() =
                req.extensions().get::<IdempotencyContext>().map(|c| c.scope().principal.as_str().to_owned());
            async { Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
        }
    });
    let req = Request::post("/v1/workers")
        .header("idempotency-key", "k1")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let res = layer.layer(handler).oneshot(req).await.unwrap();
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let kind =
        serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v["type"].as_str().map(str::to_owned));
    let principal = seen.lock().unwrap().clone();
    (status, kind.unwrap_or_default(), principal)
}

/// Pins: a resolver answering "" or whitespace put every such request in one shared scope
/// (or, under SkipIdempotency, ran the handler unprotected); it must be a 401 problem,
/// nothing claimed, no handler run, in both MissingPrincipal modes.
#[tokio::test]
async fn a_blank_principal_is_refused_in_every_mode_and_claims_nothing() {
    for blank in ["", " ", "  \t ", "\u{a0}\u{2003}"] {
        for mode in [MissingPrincipal::Reject, MissingPrincipal::SkipIdempotency] {
            let store = Arc::new(MemoryStore::new());
            let owned = blank.to_owned();
            let layer = IdempotencyLayer::new(store.clone())
                .with_missing_principal(mode)
                .with_principal_resolver(move |_: &http::request::Parts| Some(owned.clone()));
            let runs = Arc::new(AtomicUsize::new(0));
            let (status, kind, _) = send(&layer, &runs).await;
            assert_eq!(status, 401, "{blank:?} {mode:?}");
            assert_eq!(kind, idem_http::ProblemKind::MissingPrincipal.type_uri(), "{blank:?} {mode:?}");
            assert_eq!(runs.load(Ordering::SeqCst), 0, "{blank:?} {mode:?}: the handler ran");
            let id = RecordId::derive(blank, ENDPOINT, "k1");
            assert_eq!(store.get(id).await.unwrap(), None, "{blank:?} {mode:?}: a record was claimed");
        }
    }
}

/// Pins: a blank principal was answered 401 without the resolver's `WWW-Authenticate`
/// challenge, which a missing one carries (RFC 9110 §15.5.2: a 401 sends one).
#[tokio::test]
async fn a_blank_principal_gets_the_resolvers_challenge() {
    struct Blank;
    impl idem_http::PrincipalResolver for Blank {
        fn resolve(&self, _: &http::request::Parts) -> Option<String> {
            Some(" ".to_owned())
        }
        fn challenge(&self) -> Option<http::HeaderValue> {
            Some(http::HeaderValue::from_static("Bearer realm=\"fleet\""))
        }
    }
    let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new())).with_principal_resolver(Blank);
    let handler = tower::service_fn(|_: Request<Full<Bytes>>| async {
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
    });
    let req = Request::post("/v1/workers").header("idempotency-key", "k1").body(Full::new(Bytes::new())).unwrap();
    let res = layer.layer(handler).oneshot(req).await.unwrap();
    assert_eq!(res.status(), 401);
    assert_eq!(res.headers()["www-authenticate"], "Bearer realm=\"fleet\"");
}

/// Pins: a resolver that answers differently each time it is asked (a rotating token
/// cache, a bug) must not give one request two principals: the layer asks once, and the
/// claim, the record and the handler's context all carry that one answer.
#[tokio::test]
async fn a_resolver_is_asked_once_per_request_and_its_answer_is_used_everywhere() {
    let store = Arc::new(MemoryStore::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(store.clone()).with_principal_resolver({
        let calls = calls.clone();
        move |_: &http::request::Parts| Some(format!("p-{}", calls.fetch_add(1, Ordering::SeqCst) + 1))
    });
    let runs = Arc::new(AtomicUsize::new(0));
    let (status, _, principal) = send(&layer, &runs).await;
    assert_eq!(status, 200);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the resolver is asked exactly once per request");
    assert_eq!(principal.as_deref(), Some("p-1"), "the handler's context carries the one answer");
    let first = store.get(RecordId::derive("p-1", ENDPOINT, "k1")).await.unwrap().expect("p-1's record");
    assert_eq!((first.state, first.scope.principal.as_str()), (RecordState::Completed, "p-1"));
    assert_eq!(store.get(RecordId::derive("p-2", ENDPOINT, "k1")).await.unwrap(), None, "nothing under a 2nd answer");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

fn parts(auth: &[&str]) -> http::request::Parts {
    let mut b = Request::builder();
    for a in auth {
        b = b.header(http::header::AUTHORIZATION, *a);
    }
    b.body(()).expect("request").into_parts().0
}

#[test]
fn bearer_tokens_are_hashed_and_scheme_is_case_insensitive() {
    let p = BearerToken.resolve(&parts(&["Bearer abc"])).expect("a principal");
    assert_eq!(p, BearerToken.resolve(&parts(&["bearer abc"])).expect("a principal"));
    assert!(p.starts_with("bearer:") && p.len() == 7 + 64);
    assert!(!p.contains("abc"));
    assert_ne!(p, BearerToken.resolve(&parts(&["Bearer abd"])).expect("a principal"));
}

#[test]
fn missing_or_odd_authorization_resolves_to_nobody() {
    for a in [&[][..], &["Basic dXNlcjpwYXNz"], &["Bearer "], &["Bearer    "], &["Bearer"], &["Bearer a", "Bearer b"]] {
        assert_eq!(BearerToken.resolve(&parts(a)), None, "{a:?}");
    }
}

/// The layer's blank rule is core's: Unicode whitespace only is blank, padding is not.
#[test]
fn closures_resolve_and_blank_is_core_s_rule() {
    let r = |_: &http::request::Parts| Some("acct-1".to_owned());
    assert_eq!(r.resolve(&parts(&[])).as_deref(), Some("acct-1"));
    assert!(idem_core::Principal::new(" \t\u{a0}").is_err() && idem_core::Principal::new(" a ").is_ok());
}
