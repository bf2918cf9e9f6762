//! [`ResponseFuture`], and the drop guard that marks a record failed when its handler
//! does not finish.
//!
//! The layer's work is one `async fn` (see `service.rs`), boxed: it awaits the store
//! several times around the handler, which a hand-written state machine would spell out
//! as a dozen states for no gain at this layer's cost (one allocation per request next to
//! at least one store round trip).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use http::Response;
use idem_core::{FencingToken, RecordId, Store};
use tracing::Instrument;

use crate::body::ResponseBody;

/// Future returned by [`crate::Idempotency`]'s `call`.
pub struct ResponseFuture<B, E> {
    inner: BoxFuture<'static, Result<Response<ResponseBody<B>>, E>>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(inner: BoxFuture<'static, Result<Response<ResponseBody<B>>, E>>) -> Self {
        Self { inner }
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// The claimed work under [`crate::HandlerExecution::Detached`]: polled in place, inside
/// the response future, for as long as that future lives; handed to the tokio runtime as a
/// task of its own only if the response future is dropped first (the client went away).
///
/// Either way the work runs to its end and stores its outcome, so a disconnect never
/// cancels a handler; but the common case, a client that waits for its response, costs
/// no task, no join handle and no cross-task wake-up.
pub(crate) struct Detach<T: Send + 'static> {
    /// `None` once finished, and while it is being polled: a work future that panics is
    /// not handed to the runtime from the unwinding drop.
    work: Option<BoxFuture<'static, T>>,
    runtime: tokio::runtime::Handle,
    /// The span the work would have been spawned in, carried over if it is.
    span: tracing::Span,
}

impl<T: Send + 'static> Detach<T> {
    pub(crate) fn new(work: BoxFuture<'static, T>, runtime: tokio::runtime::Handle) -> Self {
        Self { work: Some(work), runtime, span: tracing::Span::current() }
    }
}

impl<T: Send + 'static> Future for Detach<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        // `Detach` is `Unpin` (the work is boxed), so the fields can be moved freely.
        let Some(mut work) = self.work.take() else {
            panic!("Detach polled after it finished");
        };
        let poll = work.as_mut().poll(cx);
        if poll.is_pending() {
            self.work = Some(work);
        }
        poll
    }
}

impl<T: Send + 'static> Drop for Detach<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else { return };
        // The output is dropped: the work stores it, and the client's retry replays it. A
        // panic in the task is the handler's own, after it marked the record failed. If the
        // runtime is shutting down the task never runs, and the work's drop guard spawns
        // the `fail` if it still can, else the lease frees the record.
        let span = std::mem::replace(&mut self.span, tracing::Span::none());
        drop(self.runtime.spawn(async move { drop(work.await) }.instrument(span)));
    }
}

impl<T: Send + 'static> fmt::Debug for Detach<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Detach").field("finished", &self.work.is_none()).finish_non_exhaustive()
    }
}

/// Owns the duty to end a claim. Armed from the claim until `complete` or `fail` has been
/// written; if it is dropped while armed (the handler panicked through it; under
/// `HandlerExecution::Inline` the request future was dropped because the client went away;
/// under `Detached` the runtime cancelled the handler's task while shutting down), it
/// spawns the `fail` on the current tokio runtime so a retry can reclaim at once instead of
/// waiting out the lease.
pub(crate) struct FailGuard {
    armed: Option<(Arc<dyn Store>, RecordId, FencingToken)>,
}

impl FailGuard {
    pub(crate) fn new(store: Arc<dyn Store>, id: RecordId, token: FencingToken) -> Self {
        Self { armed: Some((store, id, token)) }
    }

    /// The duty is done (or handed on): dropping no longer writes.
    pub(crate) fn disarm(&mut self) {
        self.armed = None;
    }

    /// Writes `fail` now and disarms. If this future is itself dropped mid-write, the
    /// guard is still armed and the drop path retries the write.
    pub(crate) async fn fail_now(&mut self, why: &'static str) {
        if let Some((store, id, token)) = &self.armed {
            log_fail(store.fail(*id, *token).await, *id, *token, why);
        }
        self.disarm();
    }
}

impl Drop for FailGuard {
    fn drop(&mut self) {
        let Some((store, id, token)) = self.armed.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    log_fail(store.fail(id, token).await, id, token, "request dropped before completion");
                });
            }
            Err(_) => tracing::warn!(
                record = %id, token = %token,
                "idempotency claim abandoned outside a tokio runtime; it frees itself when its lease ends"
            ),
        }
    }
}

fn log_fail(result: Result<idem_core::Record, idem_core::StoreError>, id: RecordId, token: FencingToken, why: &str) {
    match result {
        Ok(_) => tracing::debug!(record = %id, token = %token, why, "idempotency record marked failed"),
        Err(e) if e.is_lease_lost() => tracing::warn!(
            record = %id, token = %token, why, error = %e,
            "could not mark idempotency record failed: another attempt owns it now"
        ),
        Err(e) => tracing::error!(
            record = %id, token = %token, why, error = %e,
            "could not mark idempotency record failed; it stays in flight until its lease ends"
        ),
    }
}
