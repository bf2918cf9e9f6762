//! An axum API on AWS Lambda (`lambda_http`, API Gateway REST or HTTP API events) behind
//! idem's [`IdempotencyLayer`], its records in DynamoDB ([`DynamoStore`]).
//!
//! What Lambda changes: the runtime stops a handler at the invocation's deadline, and a
//! stopped handler writes nothing, so its record stays in flight until its lease runs out.
//! [`with_lease_deadline`] puts the invocation's deadline on each request as a
//! [`LeaseDeadline`]; the layer then cuts the lease there, and a retry after a timeout
//! reclaims at once instead of getting 409 for a whole lease TTL (five minutes by default).
//!
//! The principal is the `Authorization: Bearer` token (the layer's default resolver):
//! behind API Gateway, an authorizer should have checked it before the function runs.
//!
//! # Layout
//! - [`app`]: the router, the idempotency layer, the deadline layer outside it.
//! - [`Workers`]: the API's state, a count of handler runs and of workers created.
//! - [`store_from_env`]: the DynamoDB store from `IDEM_TABLE`, `IDEM_DYNAMODB_URL`,
//!   `IDEM_AUTO_MIGRATE`.
//! - `src/main.rs`: `lambda_http::run(app)`.
//! - `tests/invoke.rs` (feature `live-tests`): API Gateway events against a DynamoDB
//!   emulator: a lost response, a retry after a timeout, an in-flight retry, a mismatch.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use idem_dynamodb::{Config, DynamoStore};
use idem_http::{IdempotencyLayer, LeaseDeadline};
use lambda_http::RequestExt;
use tower::util::MapRequestLayer;

/// What the API did: every handler run, and every worker actually created. A run that the
/// runtime stopped counts as a run but created nothing.
#[derive(Clone, Debug, Default)]
pub struct Workers {
    runs: Arc<AtomicU64>,
    created: Arc<AtomicU64>,
}

impl Workers {
    /// Handler runs so far.
    #[must_use]
    pub fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }

    /// Workers created so far.
    #[must_use]
    pub fn created(&self) -> u64 {
        self.created.load(Ordering::SeqCst)
    }
}

/// The function's API: `POST /v1/workers` behind the idempotency layer on `store`, with
/// each request's [`LeaseDeadline`] taken from its Lambda context.
pub fn app(store: Arc<DynamoStore>, workers: Workers) -> Router {
    Router::new()
        .route("/v1/workers", post(create_worker))
        .with_state(workers)
        .layer(IdempotencyLayer::new(store))
        // Added last, so outside the idempotency layer: the deadline is on the request
        // before the layer claims.
        .layer(MapRequestLayer::new(with_lease_deadline::<axum::body::Body>))
}

/// Inserts the invocation's deadline (`Context::deadline`, ms since the Unix epoch, set by
/// the Lambda runtime) as the request's [`LeaseDeadline`]. A request without a Lambda
/// context (a local server, a test without one) is left as it is: the lease is the policy's.
pub fn with_lease_deadline<B>(mut req: Request<B>) -> Request<B> {
    if let Some(deadline) = req.lambda_context_ref().map(lambda_http::Context::deadline) {
        req.extensions_mut().insert(LeaseDeadline::at(deadline));
    }
    req
}

/// Creates a worker: `{"name": ...}`, 201 with the worker's id. The `x-provision-ms` header
/// (default 0) is how long provisioning takes, so a caller can steer a slow run (the
/// in-flight and timeout tests do); it is not fingerprinted, so a retry may change it.
async fn create_worker(State(workers): State<Workers>, headers: HeaderMap, body: String) -> impl IntoResponse {
    workers.runs.fetch_add(1, Ordering::SeqCst);
    let Ok(spec) = serde_json::from_str::<serde_json::Value>(&body) else {
        return (StatusCode::UNPROCESSABLE_ENTITY, r#"{"error":"the body is not JSON"}"#.to_owned());
    };
    let provision = headers.get("x-provision-ms").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(provision)).await;
    let id = workers.created.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, serde_json::json!({ "id": id, "name": spec["name"] }).to_string())
}

/// The store the function uses: table `IDEM_TABLE` (default `idem`), endpoint
/// `IDEM_DYNAMODB_URL` when set (a local emulator; unset on Lambda), the table created when
/// missing only with `IDEM_AUTO_MIGRATE=1` (on Lambda the table comes from infrastructure
/// as code, and the role needs no `CreateTable`). Credentials and region come from the
/// environment, as the Lambda runtime sets them.
///
/// # Errors
/// The store's start-up error: the table is missing (or has another key schema), or
/// DynamoDB cannot be reached.
pub async fn store_from_env() -> Result<DynamoStore, idem_dynamodb::Error> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let mut config = Config::default()
        .with_table(var("IDEM_TABLE").unwrap_or_else(|| idem_dynamodb::DEFAULT_TABLE.to_owned()))
        .with_auto_migrate(var("IDEM_AUTO_MIGRATE").as_deref() == Some("1"));
    if let Some(url) = var("IDEM_DYNAMODB_URL") {
        config = config.with_endpoint_url(url);
    }
    DynamoStore::connect(config).await
}
