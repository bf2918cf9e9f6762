//! The leasebroker HTTP API, with the idempotency layer on every route that changes
//! something, and a fault layer in front that loses responses after the work is done.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_core::{Policy, Store};
use idem_http::{BearerToken, IdempotencyLayer, KeyRequirement};
use rand::Rng;

use crate::state::{Infra, StateError, WorkerSpec};

/// Faults the server injects, each as a probability in `0.0..=1.0`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Share of responses held back after the work is done and stored, for `hold_ms`:
    /// the client's attempt times out, exactly as when a response is lost in transit.
    pub drop_rate: f64,
    /// How long a dropped response is held, ms (longer than the client's attempt timeout).
    pub hold_ms: u64,
    /// Upper bound of a random delay inside the handler, ms, while the claim is held: a
    /// retry that arrives meanwhile gets 409 + `Retry-After`. Keep it below the lease.
    pub work_ms: u64,
    /// Share of create calls whose hypervisor boot fails (answered 503; nothing is kept).
    pub hypervisor_fail_rate: f64,
}

#[derive(Clone, Debug)]
struct AppState {
    infra: Infra,
    faults: Faults,
}

/// Builds the router: `POST /v1/workers`, `GET|DELETE /v1/workers/{id}`,
/// `POST /v1/workers/{id}/reboot`, and `GET /admin/stats` (unauthenticated counters).
pub fn router(infra: Infra, store: Arc<dyn Store>, policy: Policy, faults: Faults) -> Router {
    let state = AppState { infra, faults };
    // POST requires a key; DELETE takes one when sent (a retried DELETE replays its 204).
    let post_layer = IdempotencyLayer::new(Arc::clone(&store)).with_policy(policy.clone());
    let delete_layer = IdempotencyLayer::new(store).with_policy(policy).with_key_requirement(KeyRequirement::Optional);
    let mutating = Router::new()
        .route("/v1/workers", post(create))
        .route("/v1/workers/{id}/reboot", post(reboot))
        .route_layer(post_layer);
    let deleting = Router::new().route("/v1/workers/{id}", get(show).delete(remove)).route_layer(delete_layer);
    Router::new()
        .merge(mutating)
        .merge(deleting)
        .route("/admin/stats", get(stats))
        .layer(middleware::from_fn_with_state(faults, lose_responses))
        .with_state(state)
}

/// The fault layer: runs the request (the idempotency layer has stored the outcome by
/// the time it returns), then sometimes holds the response past the client's timeout.
async fn lose_responses(State(faults): State<Faults>, req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    if faults.drop_rate > 0.0 && rand::rng().random_bool(faults.drop_rate.clamp(0.0, 1.0)) {
        tokio::time::sleep(Duration::from_millis(faults.hold_ms)).await;
    }
    response
}

fn owner(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty())
        .then(|| BearerToken::principal_for(token.trim().as_bytes()))
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    (status, [(header::CONTENT_TYPE, "application/problem+json")], body.to_string()).into_response()
}

fn state_error(e: StateError) -> Response {
    match e {
        StateError::NotFound => problem(StatusCode::NOT_FOUND, "no such worker"),
        StateError::Hypervisor => problem(StatusCode::SERVICE_UNAVAILABLE, "the hypervisor failed to boot; retry"),
        StateError::Storage(m) => problem(StatusCode::INTERNAL_SERVER_ERROR, &m),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StateError> + Send + 'static,
) -> Result<T, StateError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(StateError::Storage(e.to_string())))
}

async fn create(State(s): State<AppState>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let Some(owner) = owner(&headers) else {
        return problem(StatusCode::UNAUTHORIZED, "send Authorization: Bearer <token>");
    };
    let spec: WorkerSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return problem(StatusCode::UNPROCESSABLE_ENTITY, &format!("invalid worker spec: {e}")),
    };
    if s.faults.work_ms > 0 {
        let ms = rand::rng().random_range(0..=s.faults.work_ms);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let fail =
        s.faults.hypervisor_fail_rate > 0.0 && rand::rng().random_bool(s.faults.hypervisor_fail_rate.clamp(0.0, 1.0));
    match blocking(move || s.infra.create(&owner, spec, fail)).await {
        Ok(w) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/v1/workers/{}", w.id)), (header::CONTENT_TYPE, "application/json".into())],
            serde_json::to_string(&w).unwrap_or_default(),
        )
            .into_response(),
        Err(e) => state_error(e),
    }
}

async fn show(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let Some(owner) = owner(&headers) else {
        return problem(StatusCode::UNAUTHORIZED, "send Authorization: Bearer <token>");
    };
    match blocking(move || s.infra.get(&owner, &id)).await {
        Ok(w) => axum::Json(w).into_response(),
        Err(e) => state_error(e),
    }
}

async fn remove(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let Some(owner) = owner(&headers) else {
        return problem(StatusCode::UNAUTHORIZED, "send Authorization: Bearer <token>");
    };
    match blocking(move || s.infra.delete(&owner, &id)).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => state_error(e),
    }
}

async fn reboot(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let Some(owner) = owner(&headers) else {
        return problem(StatusCode::UNAUTHORIZED, "send Authorization: Bearer <token>");
    };
    match blocking(move || s.infra.reboot(&owner, &id)).await {
        Ok(w) => {
            (StatusCode::ACCEPTED, axum::Json(serde_json::json!({"id": w.id, "reboots": w.reboots}))).into_response()
        }
        Err(e) => state_error(e),
    }
}

async fn stats(State(s): State<AppState>) -> Response {
    match blocking(move || s.infra.stats()).await {
        Ok(st) => axum::Json(st).into_response(),
        Err(e) => state_error(e),
    }
}
