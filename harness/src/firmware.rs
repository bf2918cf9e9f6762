//! `POST /v1/workers/{id}/firmware`, the rig's long route, served next to the demo's routes
//! (through `leasebroker::app::Config::routes`, so the demo's fault layer holds its answers
//! too): a flash takes tens of seconds, many times the lease, and only the layer's lease
//! renewal keeps a retry from reclaiming the record and starting a second flash, which
//! bricks the node ([`crate::bmc`]). The chaos run's firmware operations, the renewal test
//! in `tests/storm.rs` and `storm --mode firmware` drive it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_core::{Reconciled, StepError, Store};
use idem_http::{IdempotencyContext, IdempotencyLayer, Problem, ResponseCaching};
use leasebroker::app::{Config, owner, problem};
use leasebroker::server::{Server, StoreSpec, open};
use leasebroker::state::{Infra, StateError};
use tokio::net::TcpListener;

use crate::bmc::{BmcError, Bmcs, FirmwareSpec, Flash, FlashProgress};

/// How long the simulated BMC takes to flash firmware by default, ms: tens of seconds, as
/// a real one takes minutes.
pub const DEFAULT_FLASH_MS: u64 = 20_000;

/// Which simulated BMC flashes firmware (see [`crate::bmc`]).
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

#[derive(Clone, Debug)]
struct Firmware {
    infra: Infra,
    bmcs: Bmcs,
    flash: Duration,
    bmc: Bmc,
}

/// Why a flash failed: the worker lookup or the BMC.
#[derive(Debug, thiserror::Error)]
enum FlashError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Bmc(#[from] BmcError),
}

/// The route behind its own idempotency layer (`config`'s policy and lease renewal, the
/// key required), and `GET /admin/bmc` (the BMCs' counts, [`crate::bmc::BmcStats`]).
/// Every flash takes `flash_ms`, on `bmc`.
pub fn router(store: Arc<dyn Store>, config: &Config, infra: Infra, bmcs: Bmcs, flash_ms: u64, bmc: Bmc) -> Router {
    let layer =
        IdempotencyLayer::new(store).with_policy(config.policy.clone()).with_lease_renewal(config.lease_renewal);
    Router::new()
        .route("/v1/workers/{id}/firmware", post(firmware))
        .route_layer(layer)
        .route("/admin/bmc", get(stats))
        .with_state(Firmware { infra, bmcs, flash: Duration::from_millis(flash_ms), bmc })
}

/// The demo's server plus the firmware route on `listener`: the store and the infra state
/// as `serve` opens them, the BMCs in a redb file next to the state file
/// (`<state>.bmc.redb`, so they survive a SIGKILL of the server as the VMs do).
///
/// # Errors
/// When the store, the state or the BMCs' file cannot be opened.
pub async fn start(
    listener: TcpListener,
    spec: &StoreSpec,
    state: &Path,
    config: Config,
    flash_ms: u64,
    bmc: Bmc,
) -> Result<Server, Box<dyn std::error::Error + Send + Sync>> {
    let (store, infra) = open(spec, state).await?;
    let bmcs = Bmcs::new(Arc::new(redb::Database::create(state.with_extension("bmc.redb"))?))?;
    let routes = router(Arc::clone(&store), &config, infra.clone(), bmcs, flash_ms, bmc);
    Ok(Server::start(listener, store, infra, &Config { routes, ..config })?)
}

fn flash_error(e: FlashError) -> Response {
    match e {
        FlashError::State(StateError::NotFound) | FlashError::Bmc(BmcError::NotFound) => {
            problem(StatusCode::NOT_FOUND, "no such worker")
        }
        // A final answer, stored and replayed: the node stays bricked whoever asks again.
        FlashError::Bmc(e @ BmcError::Bricked { .. }) => {
            (axum::Extension(ResponseCaching::Store), problem(StatusCode::CONFLICT, &e.to_string())).into_response()
        }
        FlashError::State(StateError::Storage(m)) | FlashError::Bmc(BmcError::Storage(m)) => {
            problem(StatusCode::INTERNAL_SERVER_ERROR, &m)
        }
        FlashError::State(StateError::Hypervisor) => {
            problem(StatusCode::SERVICE_UNAVAILABLE, "the hypervisor failed to boot; retry")
        }
    }
}

async fn blocking<T: Send + 'static, E: Into<FlashError> + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, FlashError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(Into::into),
        Err(e) => Err(BmcError::Storage(e.to_string()).into()),
    }
}

/// `POST /v1/workers/{id}/firmware`: flashes the worker's node, which takes the route's
/// flash time (tens of seconds), many times the lease. Answers 200 with the flash, 404 for
/// an unknown worker, 409 (stored) for a bricked node. How a retry is kept from flashing
/// twice depends on the BMC ([`Bmc`]):
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
    State(s): State<Firmware>,
    ctx: Option<axum::Extension<IdempotencyContext>>,
    headers: HeaderMap,
    UrlPath(id): UrlPath<String>,
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
        Err(e) => return flash_error(e),
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
                StepError::Failed { source, .. } => flash_error(source),
                other => problem(StatusCode::INTERNAL_SERVER_ERROR, &other.to_string()),
            },
        },
    }
}

/// The blind BMC's flash: one step, started and awaited in this process.
async fn flash_blind(
    s: &Firmware,
    ctx: &IdempotencyContext,
    node: String,
    spec: FirmwareSpec,
) -> Result<Flash, StepError<FlashError>> {
    let (bmcs, flash_time) = (s.bmcs.clone(), s.flash);
    ctx.resumable()
        .step("flash", |_| async move {
            let (bmc, n) = (bmcs.clone(), node.clone());
            let number = blocking(move || bmc.start_flash(&n)).await?;
            tokio::time::sleep(flash_time).await;
            blocking(move || bmcs.finish_flash(&node, number, spec)).await
        })
        .await
}

/// The task BMC's flash: an intent (start the task, or adopt the one a previous attempt
/// started), then a wait on the task monitor. The wait reads the BMC only, so it needs
/// no journal entry of its own: every attempt that gets here waits for the same task.
async fn flash_task(
    s: &Firmware,
    ctx: &IdempotencyContext,
    node: String,
    spec: FirmwareSpec,
) -> Result<Flash, StepError<FlashError>> {
    let (issuer, finder) = (s.bmcs.clone(), s.bmcs.clone());
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
        let (bmcs, id) = (s.bmcs.clone(), task.clone());
        match blocking(move || bmcs.finish_flash_task(&id)).await {
            Ok(FlashProgress::Done(flash)) => return Ok(flash),
            Ok(FlashProgress::Running { ends_at_ms }) => {
                let left = ends_at_ms.saturating_sub(crate::bmc::unix_ms());
                // Polled at most every second: the task monitor is the source of truth, and
                // the wait stays short if the clock moves.
                tokio::time::sleep(Duration::from_millis(left.clamp(10, 1_000))).await;
            }
            Err(source) => return Err(StepError::Failed { name: "flash".into(), source }),
        }
    }
}

async fn stats(State(s): State<Firmware>) -> Response {
    match blocking(move || s.bmcs.stats()).await {
        Ok(st) => axum::Json(st).into_response(),
        Err(e) => flash_error(e),
    }
}
