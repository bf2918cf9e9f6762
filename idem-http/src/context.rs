//! The handler's side of the layer: [`IdempotencyContext`] (what it learns about the claim
//! it runs under) and [`ResponseCaching`] (what it can say about its response).

use std::future::Future;
use std::sync::Arc;

use idem_core::{FencingToken, IdempotencyKey, RecordId, Resumable, Scope, Store, StoredResponse, SubKey, UnixMillis};

use crate::lease::LeaseState;

/// Request extension the layer inserts before calling the handler of a claimed request.
///
/// It names the record the handler runs under and the fencing token of this attempt, and
/// carries the store, so that code inside the handler can derive stable sub-keys for
/// downstream calls ([`IdempotencyContext::subkey`]) and journal steps and intents in the
/// same store ([`IdempotencyContext::resumable`]; see the crate docs, "Resumable
/// handlers"). The token grows on every reclaim: a write made with an older token is
/// refused by the store.
///
/// While the handler runs, the layer renews its lease ([`crate::LeaseRenewal`]). A handler
/// doing long work can watch for the renewal being refused, which means a retry may have
/// taken over the record: [`IdempotencyContext::lease_lost`] resolves and
/// [`IdempotencyContext::is_lease_lost`] turns true, and steps of
/// [`IdempotencyContext::resumable`] refuse to start. Stop before the next side effect.
///
/// Present only when the handler runs under a claim: not for safe methods, keyless
/// requests, skipped principals, or fail-open runs.
///
/// ```
/// use axum::Extension;
/// use idem_http::IdempotencyContext;
///
/// async fn create(Extension(ctx): Extension<IdempotencyContext>) -> String {
///     format!("record {} attempt {}", ctx.record_id(), ctx.token())
/// }
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyContext {
    pub(crate) record_id: RecordId,
    pub(crate) token: FencingToken,
    pub(crate) scope: Scope,
    pub(crate) key: IdempotencyKey,
    pub(crate) lease: LeaseState,
    /// The record's `created_at`: names its generation, which sub-keys depend on.
    pub(crate) created_at: UnixMillis,
    pub(crate) store: Arc<dyn Store>,
    /// The layer's sealing (`IdempotencyLayer::with_sealing`); `Debug` shows key ids only.
    #[cfg(feature = "seal")]
    pub(crate) sealing: Option<idem_core::seal::Sealing>,
}

impl IdempotencyContext {
    /// The record this attempt runs under (hash of principal, endpoint and key).
    #[must_use]
    pub fn record_id(&self) -> RecordId {
        self.record_id
    }

    /// This attempt's fencing token: a new record's first token comes from the store's
    /// clock ([`FencingToken::first_at`]), and every reclaim adds 1.
    #[must_use]
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The scope: principal and endpoint.
    #[must_use]
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The client's idempotency key.
    #[must_use]
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// Resolves when a renewal of this attempt's lease was refused with `LeaseLost` (a
    /// retry reclaimed the record after the lease ran out, or the record is gone); pending
    /// for as long as the lease is held. Race it against long work to stop at once:
    ///
    /// ```
    /// # async fn flash() {}
    /// use axum::{Extension, http::StatusCode};
    /// use idem_http::IdempotencyContext;
    ///
    /// async fn firmware(Extension(ctx): Extension<IdempotencyContext>) -> StatusCode {
    ///     tokio::select! {
    ///         () = flash() => StatusCode::OK,
    ///         // Another attempt may own the record: stop before the next side effect.
    ///         () = ctx.lease_lost() => StatusCode::CONFLICT,
    ///     }
    /// }
    /// ```
    ///
    /// Never resolves under [`crate::LeaseRenewal::Off`]: nothing watches the lease then.
    /// The future owns what it needs (`'static`), so it can move into a spawned task.
    pub fn lease_lost(&self) -> impl Future<Output = ()> + Send + 'static {
        self.lease.lost()
    }

    /// Whether a renewal of this attempt's lease was refused (see
    /// [`IdempotencyContext::lease_lost`]). Once true, stays true.
    #[must_use]
    pub fn is_lease_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// The store the record lives in.
    #[must_use]
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// `response` in the form this layer stores it: sealed for this record and claim with
    /// the layer's newest key when sealing is on (`IdempotencyLayer::with_sealing`), as is
    /// otherwise. A handler that completes its record itself
    /// ([`ResponseCaching::CompletedByHandler`], e.g. with
    /// `idem_postgres::PostgresStore::complete_in`) stores this, not the plain response:
    /// the layer cannot seal a write it does not make, and a plain response under sealing
    /// leaves the plaintext in the store and is refused on every replay (503).
    /// Completions through [`IdempotencyContext::store`] are sealed by that store; do not
    /// pass them through this first (they would be sealed twice and not replay).
    #[must_use]
    pub fn stored_form(&self, response: StoredResponse) -> StoredResponse {
        #[cfg(feature = "seal")]
        if let Some(sealing) = &self.sealing {
            return sealing.seal(self.record_id, self.token, &response);
        }
        response
    }

    /// The sub-key of step `name` for this record: `idem-` + 48 lower-case hex digits
    /// (53 ASCII bytes, `[0-9a-f-]`), derived from (principal, endpoint, key, the record's
    /// `created_at`, `name`), so every attempt of this operation, in every process, gets
    /// the same value, and the same key reused after retention (a new record) gets another
    /// ([`SubKey::derive`]). Send it as the idempotency key or client token of a
    /// downstream call.
    #[must_use]
    pub fn subkey(&self, name: &str) -> SubKey {
        SubKey::derive(self.record_id, self.created_at, name)
    }

    /// The handle for steps and intents of this record, fenced by this attempt's token:
    /// a write after a retry has reclaimed the record is refused with
    /// [`idem_core::StoreError::LeaseLost`], and once a renewal was refused
    /// ([`IdempotencyContext::is_lease_lost`]) no step or intent starts: they return
    /// [`idem_core::StepError::LeaseLost`] without calling anything. On a store without a journal
    /// ([`idem_core::Capabilities::journal`] false) `step` and `intent` return
    /// [`idem_core::StepError::Store`] with [`idem_core::StoreError::Unsupported`];
    /// [`crate::Problem::from_step_error`] turns that into a 500 `journal-unsupported`.
    /// Which tool fits which downstream call: `docs/contract.md#side-effects`.
    ///
    /// A step whose call is keyed by its sub-key, then an intent for a call that takes no
    /// caller id but carries a tag (`reconcile` looks the tag up when a dead attempt left
    /// the intent pending):
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use axum::{Extension, http::StatusCode, response::{IntoResponse, Response}};
    /// use idem_http::{IdempotencyContext, Problem, Reconciled};
    ///
    /// /// Booted VMs and their tags.
    /// type Vms = Arc<Mutex<Vec<(String, String)>>>;
    ///
    /// async fn create(Extension(ctx): Extension<IdempotencyContext>, Extension(vms): Extension<Vms>) -> Response {
    ///     let run = ctx.resumable();
    ///     let node = run.step("allocate", |subkey| async move {
    ///         // A pool that remembers which node a caller id got would take `subkey` here.
    ///         Ok::<_, std::convert::Infallible>(format!("node-{}", &subkey.as_str()[5..13]))
    ///     });
    ///     let node = match node.await {
    ///         Ok(node) => node,
    ///         Err(e) => return Problem::from_step_error(&e).map_or(StatusCode::BAD_GATEWAY.into_response(), |p| p.into_response()),
    ///     };
    ///     let (issue, find) = (Arc::clone(&vms), vms);
    ///     let vm = run.intent(
    ///         "boot",
    ///         |tag| async move {
    ///             let mut vms = issue.lock().unwrap();
    ///             let vm = format!("vm-{}", vms.len() + 1);
    ///             vms.push((vm.clone(), tag.to_string()));
    ///             Ok::<_, std::convert::Infallible>(vm)
    ///         },
    ///         |tag| async move {
    ///             let vms = find.lock().unwrap();
    ///             Ok(vms.iter().find(|(_, t)| *t == tag.as_str()).map_or(Reconciled::NotFound, |(vm, _)| Reconciled::Found(vm.clone())))
    ///         },
    ///     );
    ///     match vm.await {
    ///         Ok(vm) => (StatusCode::CREATED, format!("{node} {vm}")).into_response(),
    ///         Err(e) => Problem::from_step_error(&e).map_or(StatusCode::BAD_GATEWAY.into_response(), |p| p.into_response()),
    ///     }
    /// }
    /// ```
    #[must_use]
    pub fn resumable(&self) -> Resumable {
        Resumable::new(Arc::clone(&self.store), self.record_id, self.token, self.created_at)
            .with_lease_watch(Arc::new(self.lease.clone()))
    }
}

/// Response extension a handler may set to override the policy's status rule
/// ([`idem_core::Policy::is_cacheable`]) for one response.
///
/// The policy decides by status alone; the handler sometimes knows better. A 409 that
/// reports a final business decision ("that name is taken, and always will be") can be
/// stored, and a 200 that reports a partial, still-changing result can be left unstored.
///
/// ```
/// use axum::{http::StatusCode, response::IntoResponse, Extension};
/// use idem_http::ResponseCaching;
///
/// async fn create() -> impl IntoResponse {
///     (StatusCode::CONFLICT, Extension(ResponseCaching::Store), "name taken")
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResponseCaching {
    /// Store this response and replay it to every retry, whatever its status, except a
    /// 5xx: a server error is stored only as `Policy::cacheable_5xx` or
    /// [`ResponseCaching::StoreServerError`] says, because a 5xx usually comes from a
    /// proxy or a framework, not a decision of the handler.
    Store,
    /// Store this 5xx (or any response) and replay it to every retry until retention
    /// ends: the handler says its side effects are settled and a retry changes nothing
    /// (`docs/contract.md#cacheable-statuses`).
    StoreServerError,
    /// Do not store this response; mark the record failed, so a retry runs the handler
    /// again.
    DoNotStore,
    /// The handler has already completed the record itself, with this response stored,
    /// inside its own database transaction that has committed (e.g.
    /// `idem_postgres::PostgresStore::complete_in`): the layer writes nothing for it. Set
    /// it only after that commit succeeded; on any other outcome return the response
    /// without it, and the layer completes or fails the record as usual. The layer reads
    /// the record once to check: if it is still in flight under this claim's token (the
    /// handler's transaction rolled back after all), the layer marks it failed and answers
    /// 500 `response-body-failed` instead of the handler's response, so the client retries
    /// and the retry runs the handler again.
    CompletedByHandler,
}
