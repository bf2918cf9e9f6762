//! Step 3, run: the handler under the claim this request holds, its response captured
//! (`capture`) and kept (`keep`) before its answer is returned.
//!
//! The handler sees its claim as the [`IdempotencyContext`] request extension. Its lease is
//! renewed from the claim until the record is written, polled with that work, never on a
//! task of its own (why: [`crate::lease`]). Where the work runs, and what a disconnect does
//! to it: [`crate::HandlerExecution`] (`Detached` moves it to a task, [`crate::future`]).
//!
//! A handler panic marks the record failed, then goes on (a layer must not turn a panic
//! into a response); an error of the inner service marks it failed and is returned as is.

use std::panic::AssertUnwindSafe;
use std::pin::pin;

use bytes::Bytes;
use futures::FutureExt;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use idem_core::{BoxError, FencingToken, Record, RecordId, UnixMillis};
use tokio::time::Instant;
use tower::Service;

use super::{Pipeline, capture, keep};
use crate::answer::Answer;
use crate::config::HandlerExecution;
use crate::context::IdempotencyContext;
use crate::future::{FailGuard, detach_on_drop};
use crate::lease::{Lease, LeaseState, Renewal};
use crate::observe::{Observer, Outcome};

/// One claimed attempt, from its claim until its record is written.
pub(super) struct Attempt<'a> {
    pub(super) id: RecordId,
    pub(super) token: FencingToken,
    /// The record's retention end as claimed: the `Idempotency-Key-Expires` of a response
    /// whose write does not say otherwise.
    pub(super) expires_at: UnixMillis,
    /// Armed until `complete` or `fail` has been written.
    pub(super) guard: FailGuard<'a>,
    pub(super) lease: LeaseState,
    /// What the renewal renews, for a stream that renews on its own once this request's
    /// work is over; `None` when nothing renews.
    #[cfg(feature = "grpc")]
    pub(super) terms: Option<Lease>,
    pub(super) obs: &'a Observer,
    /// A gRPC request's endpoint: its stream's outcome is counted when the stream ends,
    /// after this request's observer is gone.
    #[cfg(feature = "grpc")]
    pub(super) grpc_endpoint: Option<idem_core::Endpoint>,
}

impl Attempt<'_> {
    /// Names the attempt's outcome, with the renewals so far; a lost lease wins over what
    /// the write said.
    pub(super) fn done(&self, outcome: Outcome) {
        let outcome = if self.lease.is_lost() { Outcome::LeaseLost } else { outcome };
        self.obs.outcome(outcome, self.lease.renewals());
    }

    /// Names the outcome of a write with this attempt's token that landed: the lease was
    /// still this attempt's, and a renewal refused because the record had just been
    /// written does not make it lost.
    pub(super) fn written(&self, outcome: Outcome) {
        self.obs.outcome(outcome, self.lease.renewals());
    }
}

/// Runs the handler under the claim in `record` (claimed by a call sent at `claimed_at`),
/// renewed never past `deadline`, then has the record completed or failed before the
/// answer is returned.
pub(super) async fn run<S, ReqBody, ResBody>(
    pipeline: &Pipeline,
    mut inner: S,
    mut parts: Parts,
    body: Bytes,
    record: Record,
    (claimed_at, deadline): (Instant, Option<Instant>),
    obs: &Observer,
) -> Result<Answer<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: From<Bytes>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if pipeline.settings.handler_execution == HandlerExecution::Detached {
        detach_on_drop();
    }
    // The record's scope and key move into the handler's context: nothing after the
    // handler reads them.
    let Record { id, token, scope, key, created_at, expires_at, .. } = record;
    let lease = LeaseState::new();
    let terms = pipeline.renewal_interval.map(|interval| Lease {
        id,
        token,
        ttl: pipeline.settings.policy.lease_ttl,
        interval,
        claimed_at,
        deadline,
    });
    let mut renewal = Renewal::new(&pipeline.store, terms, &lease);
    let mut attempt = Attempt {
        id,
        token,
        expires_at,
        guard: FailGuard::new(&pipeline.store, id, token),
        lease: lease.clone(),
        #[cfg(feature = "grpc")]
        terms,
        obs,
        #[cfg(feature = "grpc")]
        grpc_endpoint: crate::headers::is_grpc(&parts.headers).then(|| scope.endpoint.clone()),
    };
    parts.extensions.insert(IdempotencyContext {
        record_id: id,
        token,
        scope,
        key,
        lease: lease.clone(),
        created_at,
        store: pipeline.store.clone(),
        #[cfg(feature = "seal")]
        sealing: pipeline.settings.sealing.clone(),
    });
    let req = Request::from_parts(parts, ReqBody::from(body));
    // The handler's own future and the bounded reading of its body both run inside
    // catch_unwind: a streamed body that panics half-way is a handler panic too. In a
    // block of its own: the pinned work's storage ends here, and the completion
    // after it reuses the space in this future instead of adding to it.
    let captured = {
        let work = pin!(
            AssertUnwindSafe(async move {
                let res = inner.call(req).await?;
                Ok(capture::read(pipeline, res).await)
            })
            .catch_unwind()
        );
        match renewal.during(work).await {
            Err(panic) => {
                // Marked failed first, deterministically; then the panic goes on to whatever
                // catches panics above this layer.
                renewal.during(pin!(attempt.guard.fail_now("handler panicked"))).await;
                attempt.done(Outcome::Failed);
                std::panic::resume_unwind(panic);
            }
            Ok(Err(error)) => {
                renewal.during(pin!(attempt.guard.fail_now("handler returned an error"))).await;
                attempt.done(Outcome::Failed);
                return Err(error);
            }
            Ok(Ok(captured)) => captured,
        }
    };
    Ok(keep::keep(pipeline, captured, attempt, renewal).await)
}
