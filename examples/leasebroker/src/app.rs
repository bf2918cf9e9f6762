//! The leasebroker HTTP API, with the idempotency layer on every route that changes
//! something, and a fault layer in front that loses responses after the work is done.
//!
//! The firmware route is the long one: a flash takes tens of seconds, many times the
//! lease, and only the layer's lease renewal keeps a retry from reclaiming the record
//! and starting a second flash, which bricks the node.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_core::{Policy, Store};
use idem_core::{Reconciled, StepError};
use idem_http::{
    BearerToken, IdempotencyContext, IdempotencyLayer, KeyRequirement, LeaseRenewal, Problem, ResponseCaching,
};
use rand::Rng;

use crate::crash::CrashPlan;
use crate::state::{FirmwareSpec, Flash, FlashProgress, Infra, StateError, Worker, WorkerSpec};

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

/// How long the simulated BMC takes to flash firmware by default, ms: tens of seconds, as
/// a real one takes minutes.
pub const DEFAULT_FLASH_MS: u64 = 20_000;

/// Which simulated BMC flashes firmware (see [`crate::state`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bmc {
    /// A BMC with a task monitor (Redfish `UpdateService` style, the default): a flash is a
    /// task named by the caller's tag and can be looked up later. The firmware route runs
    /// it as an intent: a retry that finds the task, running or done, waits for it and
    /// adopts it instead of flashing again, even after the process that started it was
    /// killed.
    #[default]
    Tasks,
    /// An older BMC that takes no caller id and cannot be asked what it is doing. The
    /// flash is one journalled step; only lease renewal keeps a second attempt away while
    /// it runs, and a flash whose caller dies mid-flash is flashed again by the retry
    /// (nothing can be reconciled). Kept to show what renewal alone protects.
    Blind,
}

/// How the API is served.
#[derive(Clone, Debug)]
pub struct Config {
    /// The record rules (lease TTL, retention) of every idempotent route.
    pub policy: Policy,
    /// How the layer renews the lease of a running handler (default every lease / 3).
    /// [`LeaseRenewal::Off`] exists to show what renewal prevents: a flash that outlives
    /// its lease is started again by a retry, and the node bricks.
    pub lease_renewal: LeaseRenewal,
    /// Faults injected (none by default).
    pub faults: Faults,
    /// How long the simulated BMC takes to flash firmware, ms (default
    /// [`DEFAULT_FLASH_MS`]).
    pub flash_ms: u64,
    /// Which BMC flashes (default [`Bmc::Tasks`]).
    pub bmc: Bmc,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            lease_renewal: LeaseRenewal::default(),
            faults: Faults::default(),
            flash_ms: DEFAULT_FLASH_MS,
            bmc: Bmc::default(),
        }
    }
}

#[derive(Clone, Debug)]
struct AppState {
    infra: Infra,
    faults: Faults,
    flash: Duration,
    bmc: Bmc,
}

/// Builds the router: `POST /v1/workers`, `GET|DELETE /v1/workers/{id}`,
/// `POST /v1/workers/{id}/reboot`, `POST /v1/workers/{id}/firmware`, `GET /admin/stats`
/// (unauthenticated counters) and `GET /admin/inventory` (every node, lease, VM and
/// worker, for leak checks).
pub fn router(infra: Infra, store: Arc<dyn Store>, config: &Config) -> Router {
    let state =
        AppState { infra, faults: config.faults, flash: Duration::from_millis(config.flash_ms), bmc: config.bmc };
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
        .route("/v1/workers/{id}/firmware", post(firmware))
        .route_layer(post_layer);
    let deleting = Router::new().route("/v1/workers/{id}", get(show).delete(remove)).route_layer(delete_layer);
    Router::new()
        .merge(mutating)
        .merge(deleting)
        .route("/admin/stats", get(stats))
        .route("/admin/inventory", get(inventory))
        .layer(middleware::from_fn_with_state(config.faults, lose_responses))
        .with_state(state)
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
        // A final answer, stored and replayed: the node stays bricked whoever asks again.
        e @ StateError::Bricked { .. } => {
            (axum::Extension(ResponseCaching::Store), problem(StatusCode::CONFLICT, &e.to_string())).into_response()
        }
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

/// `POST /v1/workers/{id}/firmware`: flashes the worker's node, which takes
/// [`Config::flash_ms`] (tens of seconds), many times the lease. Answers 200 with the
/// flash, 404 for an unknown worker, 409 (stored) for a bricked node. How a retry is kept
/// from flashing twice depends on the BMC ([`Config::bmc`]):
///
/// - [`Bmc::Tasks`]: the flash is an intent named `flash`. `pending` is journalled, the
///   task is started with the intent's sub-key as its id, and `done(task id)` journalled;
///   then the handler waits on the BMC's task monitor until the flash ends. A retry that
///   finds `pending` (its predecessor was killed, or its journal write failed on a full
///   disk) asks the BMC for the task and adopts it if it exists; one that finds `done`
///   only waits. Either way it never starts a second flash of the operation.
/// - [`Bmc::Blind`]: the flash is one step: its outcome is journalled when it ended.
///   While it runs only the layer's lease renewal keeps the claim; a retry that found the
///   lease run out (renewal off, or the process killed) would run the step again and start
///   a second flash, which bricks the node: there is nothing to reconcile by.
async fn firmware(
    State(s): State<AppState>,
    ctx: Option<axum::Extension<IdempotencyContext>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let Some(owner) = owner(&headers) else {
        return problem(StatusCode::UNAUTHORIZED, "send Authorization: Bearer <token>");
    };
    let spec: FirmwareSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return problem(StatusCode::UNPROCESSABLE_ENTITY, &format!("invalid firmware spec: {e}")),
    };
    let Some(axum::Extension(ctx)) = ctx else {
        return problem(StatusCode::INTERNAL_SERVER_ERROR, "firmware ran without an idempotency claim");
    };
    let infra = s.infra.clone();
    let worker = match blocking(move || infra.get(&owner, &id)).await {
        Ok(w) => w,
        Err(e) => return state_error(e),
    };
    let flashed = match s.bmc {
        Bmc::Tasks => flash_task(&s, &ctx, worker.node.clone(), spec).await,
        Bmc::Blind => flash_blind(&s, &ctx, worker.node.clone(), spec).await,
    };
    match flashed {
        Ok(Flash { node, number, firmware }) => axum::Json(serde_json::json!({
            "worker": worker.id,
            "node": node,
            "image": firmware.image,
            "version": firmware.version,
            "flash": number,
        }))
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

/// The blind BMC's flash: one step, started and awaited in this process.
async fn flash_blind(
    s: &AppState,
    ctx: &IdempotencyContext,
    node: String,
    spec: FirmwareSpec,
) -> Result<Flash, StepError<StateError>> {
    let (infra, flash_time) = (s.infra.clone(), s.flash);
    ctx.resumable()
        .step("flash", |_| async move {
            let (bmc, n) = (infra.clone(), node.clone());
            let number = blocking(move || bmc.start_flash(&n)).await?;
            tokio::time::sleep(flash_time).await;
            blocking(move || infra.finish_flash(&node, number, spec)).await
        })
        .await
}

/// The task BMC's flash: an intent (start the task, or adopt the one a previous attempt
/// started), then a wait on the task monitor. The wait reads the BMC only, so it needs
/// no journal entry of its own: every attempt that gets here waits for the same task.
async fn flash_task(
    s: &AppState,
    ctx: &IdempotencyContext,
    node: String,
    spec: FirmwareSpec,
) -> Result<Flash, StepError<StateError>> {
    let (issuer, finder) = (s.infra.clone(), s.infra.clone());
    let flash_ms = u64::try_from(s.flash.as_millis()).unwrap_or(u64::MAX);
    let task = ctx
        .resumable()
        .intent(
            "flash",
            |tag| async move {
                blocking(move || issuer.start_flash_task(&node, tag.as_str(), spec, flash_ms)).await.map(|t| t.id)
            },
            |tag| async move {
                let found = blocking(move || finder.flash_task(tag.as_str())).await?;
                Ok(found.map_or(Reconciled::NotFound, |t| Reconciled::Found(t.id)))
            },
        )
        .await?;
    loop {
        let (infra, id) = (s.infra.clone(), task.clone());
        match blocking(move || infra.finish_flash_task(&id)).await {
            Ok(FlashProgress::Done(flash)) => return Ok(flash),
            Ok(FlashProgress::Running { ends_at_ms }) => {
                let left = ends_at_ms.saturating_sub(crate::state::unix_ms());
                // Polled at most every second: the task monitor is the source of truth, and
                // the wait stays short if the clock moves.
                tokio::time::sleep(Duration::from_millis(left.clamp(10, 1_000))).await;
            }
            Err(source) => return Err(StepError::Failed { name: "flash".into(), source }),
        }
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

async fn inventory(State(s): State<AppState>) -> Response {
    match blocking(move || s.infra.inventory()).await {
        Ok(inv) => axum::Json(inv).into_response(),
        Err(e) => state_error(e),
    }
}

async fn stats(State(s): State<AppState>) -> Response {
    match blocking(move || s.infra.stats()).await {
        Ok(st) => axum::Json(st).into_response(),
        Err(e) => state_error(e),
    }
}
