//! `ResponseCaching::CompletedByHandler`: a handler that completed its record itself (in
//! its own database transaction, e.g. `idem_postgres::PostgresStore::complete_in`) gets no
//! second write from the layer, and retries replay what the handler stored.

use idem_conformance::{Forward, Forwarding};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use axum::extract::Extension;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use idem_core::{FencingToken, MemoryStore, RecordId, Store, StoreError, StoredResponse};
use idem_http::{IdempotencyContext, IdempotencyLayer, ResponseCaching};
use tower::ServiceExt;

/// A memory store that counts the completions and fails written to it.
#[derive(Debug, Default)]
struct Counting {
    inner: MemoryStore,
    completes: AtomicUsize,
    fails: AtomicUsize,
}

#[async_trait]
impl Forward for Counting {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        r: StoredResponse,
    ) -> Result<idem_core::Receipt, StoreError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(id, token, r).await
    }
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<idem_core::Receipt, StoreError> {
        self.fails.fetch_add(1, Ordering::SeqCst);
        self.inner.fail(id, token).await
    }
}

fn request() -> Request<Body> {
    Request::post("/v1/workers")
        .header("authorization", "Bearer t")
        .header("idempotency-key", "op-1")
        .body(Body::from("{}"))
        .expect("request")
}

// Pins: with CompletedByHandler the layer must write nothing after the handler (no second
// complete, and no fail of a 409 the handler already stored), and the retry must replay the
// response the handler stored.
#[tokio::test]
async fn the_layer_writes_nothing_after_a_handler_that_completed_its_record() {
    let store = Arc::new(Forwarding(Counting::default()));
    let handler = |Extension(ctx): Extension<IdempotencyContext>| async move {
        // A final business answer the policy would not store by status (409): the handler
        // stores it itself, as it would inside its own transaction.
        let stored = StoredResponse::new(409, vec![("content-type".into(), b"text/plain".to_vec())], b"taken".to_vec());
        ctx.store().complete(ctx.record_id(), ctx.token(), stored).await.expect("complete");
        (
            StatusCode::CONFLICT,
            [("content-type", "text/plain")],
            Extension(ResponseCaching::CompletedByHandler),
            "taken",
        )
            .into_response()
    };
    let app = Router::new().route("/v1/workers", post(handler)).layer(IdempotencyLayer::new(store.clone()));

    let first = app.clone().oneshot(request()).await.expect("first");
    assert_eq!(first.status(), StatusCode::CONFLICT);
    assert!(first.headers().get("idempotency-key-expires").is_some());
    assert_eq!(store.completes.load(Ordering::SeqCst), 1, "only the handler's own completion");
    assert_eq!(store.fails.load(Ordering::SeqCst), 0, "the layer must not fail a record the handler completed");

    let again = app.oneshot(request()).await.expect("retry");
    assert_eq!(again.status(), StatusCode::CONFLICT);
    assert_eq!(again.headers().get("idempotent-replayed").map(|v| v.as_bytes()), Some(&b"true"[..]));
    let body = axum::body::to_bytes(again.into_body(), 1024).await.expect("body");
    assert_eq!(&body[..], b"taken");
    assert_eq!(store.completes.load(Ordering::SeqCst), 1);
}

// Pins: a handler that set CompletedByHandler but whose completion never committed (its
// transaction rolled back after complete_in) left the record in flight with nobody running
// it: every retry got 409 in-flight until the lease ran out, and the client got a success.
// The layer now sees the record still in flight under the claim's token, fails it, answers
// 500, and the retry runs the handler again.
#[tokio::test]
async fn a_completion_that_rolled_back_fails_the_record_and_the_retry_runs_again() {
    let store = Arc::new(Forwarding(Counting::default()));
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    let handler = move |Extension(ctx): Extension<IdempotencyContext>| {
        let counter = Arc::clone(&counter);
        async move {
            // First run: its transaction (rows + complete_in) rolled back, and it sets the
            // marker anyway. Second run: the completion commits.
            if counter.fetch_add(1, Ordering::SeqCst) > 0 {
                let stored = StoredResponse::new(201, Vec::new(), b"created".to_vec());
                ctx.store().complete(ctx.record_id(), ctx.token(), stored).await.expect("complete");
            }
            (StatusCode::CREATED, Extension(ResponseCaching::CompletedByHandler), "created").into_response()
        }
    };
    let app = Router::new().route("/v1/workers", post(handler)).layer(IdempotencyLayer::new(store.clone()));

    let first = app.clone().oneshot(request()).await.expect("first");
    assert_eq!(
        first.status(),
        StatusCode::INTERNAL_SERVER_ERROR,
        "never a success for a completion that did not commit"
    );
    assert_eq!(store.fails.load(Ordering::SeqCst), 1, "the record is marked failed, not left in flight");
    assert_eq!(store.completes.load(Ordering::SeqCst), 0);

    let again = app.oneshot(request()).await.expect("retry");
    assert_eq!(again.status(), StatusCode::CREATED, "the retry runs the handler again instead of 409 in-flight");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(store.fails.load(Ordering::SeqCst), 1, "a completion that committed is not failed");
}
