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
use idem_core::{Policy, Reconciled, StepError, Store};
use idem_http::{BearerToken, IdempotencyContext, IdempotencyLayer, KeyRequirement, LeaseRenewal, Problem};
use rand::Rng;

use crate::crash::CrashPlan;
use crate::state::{Infra, StateError, Worker, WorkerSpec};

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
    /// Share of create calls whose hypervisor boot fails (answered 503; the node and the
    /// lease stay journalled, so the retry reuses them and only boots).
    pub hypervisor_fail_rate: f64,
    /// Crash points armed inside the create handler (none by default).
    pub crash: CrashPlan,
}

/// How the API is served.
#[derive(Clone, Debug, Default)]
pub struct Config {
    /// The record rules (lease TTL, retention) of every idempotent route.
    pub policy: Policy,
    /// How the layer renews the lease of a running handler (default every lease / 3;
    /// [`LeaseRenewal::Off`] shows what renewal prevents, in the rig's firmware tests).
    pub lease_renewal: LeaseRenewal,
    /// Faults injected (none by default).
    pub faults: Faults,
    /// More routes, served behind the same fault layer (the test rig adds its firmware
    /// route); none by default.
    pub routes: Router,
}

#[derive(Clone, Debug)]
struct AppState {
    infra: Infra,
    faults: Faults,
}

/// Builds the router: `POST /v1/workers`, `GET|DELETE /v1/workers/{id}`,
/// `POST /v1/workers/{id}/reboot`, `GET /admin/stats` (unauthenticated counters),
/// `GET /openapi.json` ([`crate::openapi`]) and [`Config::routes`].
pub fn router(infra: Infra, store: Arc<dyn Store>, config: &Config) -> Router {
    let state = AppState { infra, faults: config.faults };
    // POST requires a key; DELETE takes one when sent (a retried DELETE replays its 204).
    let post_layer = IdempotencyLayer::new(Arc::clone(&store))
        .with_policy(config.policy.clone())
        .with_lease_renewal(config.lease_renewal);
    let delete_layer = IdempotencyLayer::new(store)
        .with_policy(config.policy.clone())
        .with_lease_renewal(config.lease_renewal)
        .with_key_requirement(KeyRequirement::Optional);
    let mutating = Router::new()
        .route("/v1/workers", post(create))
        .route("/v1/workers/{id}/reboot", post(reboot))
        .route_layer(post_layer);
    let deleting = Router::new().route("/v1/workers/{id}", get(show).delete(remove)).route_layer(delete_layer);
    Router::new()
        .merge(mutating)
        .merge(deleting)
        .route("/admin/stats", get(stats))
        .route("/openapi.json", get(openapi))
        .with_state(state)
        .merge(config.routes.clone())
        .layer(middleware::from_fn_with_state(config.faults, lose_responses))
}

/// A request carrying this header is never held by the fault layer (the chaos run's probe).
pub const NO_FAULTS: &str = "x-leasebroker-no-faults";

/// The fault layer: runs the request (the idempotency layer has stored the outcome by
/// the time it returns), then sometimes holds the response past the client's timeout,
/// and passes the `after_completion` crash point for creates.
async fn lose_responses(State(faults): State<Faults>, req: Request, next: Next) -> Response {
    let is_create = req.method() == axum::http::Method::POST && req.uri().path() == "/v1/workers";
    // The chaos run's probe measures how fast the server answers; holding its answer would
    // measure the hold.
    let exempt = req.headers().contains_key(NO_FAULTS);
    let response = next.run(req).await;
    if is_create && response.status().is_success() {
        faults.crash.point("after_completion").await;
    }
    if !exempt && faults.drop_rate > 0.0 && rand::rng().random_bool(faults.drop_rate.clamp(0.0, 1.0)) {
        tokio::time::sleep(Duration::from_millis(faults.hold_ms)).await;
    }
    response
}

/// The principal of a request's `Authorization: Bearer` token, as the layer scopes keys.
#[must_use]
pub fn owner(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty())
        .then(|| BearerToken::principal_for(token.trim().as_bytes()))
}

/// An RFC 9457 problem answer.
#[must_use]
pub fn problem(status: StatusCode, detail: &str) -> Response {
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

/// `POST /v1/workers`: four side effects, each resumable, so a retry after a crash at any
/// point converges on one node, one lease, one VM and one worker row:
///
/// 1. `allocate` (step): the pool allocates a node for the step's sub-key (the pool is
///    idempotent by sub-key, which covers a crash between the allocation and the journal
///    write); the node is journalled.
/// 2. `lease` (step): the same for the lease on that node.
/// 3. `boot` (intent): the hypervisor takes no caller id, so `pending` is journalled
///    first and the sub-key is the VM's tag; a retry that finds `pending` lists boots by
///    tag and adopts the VM, or boots only if none exists.
/// 4. `worker` (step): the worker row, keyed by a sub-key-derived id.
async fn create(
    State(s): State<AppState>,
    ctx: Option<axum::Extension<IdempotencyContext>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let Some(owner) = owner(&headers) else {
        return problem(StatusCode::UNAUTHORIZED, "send Authorization: Bearer <token>");
    };
    let spec: WorkerSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return problem(StatusCode::UNPROCESSABLE_ENTITY, &format!("invalid worker spec: {e}")),
    };
    // The layer requires a key on this route and fails closed, so a create always runs
    // under a claim; without one its side effects could not be resumed.
    let Some(axum::Extension(ctx)) = ctx else {
        return problem(StatusCode::INTERNAL_SERVER_ERROR, "create ran without an idempotency claim");
    };
    if s.faults.work_ms > 0 {
        let ms = rand::rng().random_range(0..=s.faults.work_ms);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    match provision(&s, &ctx, owner, spec).await {
        Ok(w) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/v1/workers/{}", w.id)), (header::CONTENT_TYPE, "application/json".into())],
            serde_json::to_string(&w).unwrap_or_default(),
        )
            .into_response(),
        Err(e) => match Problem::from_step_error(&e) {
            Some(p) => p.into_response(),
            None => match e {
                StepError::Failed { source, .. } => state_error(source),
                other => problem(StatusCode::INTERNAL_SERVER_ERROR, &other.to_string()),
            },
        },
    }
}

async fn provision(
    s: &AppState,
    ctx: &IdempotencyContext,
    owner: String,
    spec: WorkerSpec,
) -> Result<Worker, StepError<StateError>> {
    let crash = s.faults.crash;
    let run = ctx.resumable();
    crash.point("before_allocate").await;
    let infra = s.infra.clone();
    let node: String = run.step("allocate", |sk| blocking(move || infra.allocate(sk.as_str()))).await?;
    crash.point("after_allocate").await;
    let (infra, n) = (s.infra.clone(), node.clone());
    let lease: String = run.step("lease", |sk| blocking(move || infra.write_lease(&n, sk.as_str()))).await?;
    crash.point("after_lease").await;
    let fail =
        s.faults.hypervisor_fail_rate > 0.0 && rand::rng().random_bool(s.faults.hypervisor_fail_rate.clamp(0.0, 1.0));
    let (issuer, finder, n) = (s.infra.clone(), s.infra.clone(), node.clone());
    let vm = run
        .intent(
            "boot",
            |tag| async move {
                crash.point("before_boot").await;
                let vm = blocking(move || issuer.boot(tag.as_str(), &n, fail)).await?;
                crash.point("after_boot").await;
                Ok(vm)
            },
            |tag| async move {
                let vms = blocking(move || finder.list_boots_by_tag(tag.as_str())).await?;
                // More than one VM per tag would be a double boot; adopt the oldest and let
                // the counters show it.
                Ok(vms.into_iter().next().map_or(Reconciled::NotFound, Reconciled::Found))
            },
        )
        .await?;
    crash.point("after_boot_recorded").await;
    let infra = s.infra.clone();
    let worker = Worker { id: String::new(), owner, node, lease, vm, spec, state: "booting".into(), reboots: 0 };
    let worker: Worker = run.step("worker", |sk| blocking(move || infra.put_worker(sk.as_str(), worker))).await?;
    crash.point("after_worker").await;
    Ok(worker)
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

async fn openapi() -> Response {
    axum::Json(crate::openapi::document()).into_response()
}

async fn stats(State(s): State<AppState>) -> Response {
    match blocking(move || s.infra.stats()).await {
        Ok(st) => axum::Json(st).into_response(),
        Err(e) => state_error(e),
    }
}
