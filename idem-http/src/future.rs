//! [`ResponseFuture`], and the drop guard that marks a record failed when its handler
//! does not finish.
//!
//! The layer's work is one `async fn` (`Pipeline::walk`), boxed: it awaits the store
//! several times around the handler, which a hand-written state machine would spell out
//! as a dozen states for no gain at this layer's cost (one allocation per request next to
//! at least one store call).

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use http::Response;
use idem_core::{FencingToken, RecordId};
use tracing::Instrument;

use crate::body::ResponseBody;
use crate::store::LayerStore;

/// Where the rest of a request's work goes if its response future is dropped first: the
/// runtime the request was claimed on, and the span its task runs in.
type DetachTo = (tokio::runtime::Handle, tracing::Span);

/// The layer's whole work for one request, boxed.
type Work<B, E> = BoxFuture<'static, Result<Response<ResponseBody<B>>, E>>;

thread_local! {
    /// How the layer's work, deep inside a poll of its [`ResponseFuture`], tells that
    /// future "from here on I must outlive you" without a shared allocation per request:
    /// [`detach_on_drop`] puts the work's span here, and the innermost `ResponseFuture`
    /// being polled on this thread takes it when the poll returns. Each poll saves and
    /// restores the value it found, so nested layers each see only their own mark.
    static DETACH_MARK: Cell<Option<tracing::Span>> = const { Cell::new(None) };
}

/// Called by the work inside a [`ResponseFuture`]'s poll, on the tokio runtime it claimed
/// on: from now on, dropping that response future moves the rest of its work to a task of
/// its own on that runtime instead of cancelling it ([`crate::HandlerExecution::Detached`]).
pub(crate) fn detach_on_drop() {
    DETACH_MARK.set(Some(tracing::Span::current()));
}

/// Puts back the mark an enclosing poll left in [`DETACH_MARK`], also when the inner poll
/// unwinds.
struct RestoreOuter(Option<tracing::Span>);

impl Drop for RestoreOuter {
    fn drop(&mut self) {
        DETACH_MARK.set(self.0.take());
    }
}

/// Future returned by [`crate::Idempotency`]'s `call`.
///
/// Under [`crate::HandlerExecution::Detached`] it polls the claimed work in place while the
/// client waits; dropped before that work finished (the client went away), it hands the
/// rest to the tokio runtime as a task of its own, which runs it to its end and stores its
/// outcome. The common case, a client that waits, costs no task, no join handle and no
/// cross-task wake-up.
pub struct ResponseFuture<B, E> {
    /// `None` once finished, and while it is being polled: a future that panics is never
    /// handed to the runtime from the unwinding drop.
    inner: Option<Work<B, E>>,
    /// Set once the work must outlive this future.
    detach_to: Option<DetachTo>,
    /// Spawns the rest of `inner`; a function pointer made where the output type is known
    /// to be `'static`, so the struct itself needs no bounds.
    spawn: fn(Work<B, E>, DetachTo),
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(inner: Work<B, E>) -> Self
    where
        B: 'static,
        E: 'static,
    {
        Self { inner: Some(inner), detach_to: None, spawn: spawn_rest::<Result<Response<ResponseBody<B>>, E>> }
    }
}

/// Runs `work` to its end on a task of its own; its output is dropped (the work stored it,
/// and the client's retry replays it). A panic in the task is the handler's own, after the
/// work marked the record failed. If the runtime is shutting down the task never runs, and
/// the work's drop guard spawns the `fail` if it still can, else the lease frees the record.
fn spawn_rest<T: 'static>(work: BoxFuture<'static, T>, (runtime, span): DetachTo) {
    drop(runtime.spawn(async move { drop(work.await) }.instrument(span)));
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // `ResponseFuture` is `Unpin` (the work is boxed), so its fields move freely.
        let Some(mut inner) = self.inner.take() else {
            panic!("ResponseFuture polled after it finished");
        };
        let outer = RestoreOuter(DETACH_MARK.take());
        let poll = inner.as_mut().poll(cx);
        let mark = DETACH_MARK.take();
        drop(outer);
        if poll.is_pending() {
            // The runtime is looked up only now: work that ends within the poll that marked
            // it (most requests) can never be left behind. The work was claimed on the
            // runtime polling it, in this poll or an earlier one.
            if let Some(span) = mark
                && self.detach_to.is_none()
                && let Ok(runtime) = tokio::runtime::Handle::try_current()
            {
                self.detach_to = Some((runtime, span));
            }
            self.inner = Some(inner);
        }
        poll
    }
}

impl<B, E> Drop for ResponseFuture<B, E> {
    fn drop(&mut self) {
        if let (Some(inner), Some(to)) = (self.inner.take(), self.detach_to.take()) {
            (self.spawn)(inner, to);
        }
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("finished", &self.inner.is_none())
            .field("detached_on_drop", &self.detach_to.is_some())
            .finish_non_exhaustive()
    }
}

/// Owns the duty to end a claim. Armed from the claim until `complete` or `fail` has been
/// written; if it is dropped while armed (the handler panicked through it; under
/// `HandlerExecution::Inline` the request future was dropped because the client went away;
/// under `Detached` the runtime cancelled the handler's task while shutting down), it
/// spawns the `fail` on the current tokio runtime so a retry can reclaim at once instead of
/// waiting out the lease.
///
/// It borrows the layer's store from the request's work, which owns it; only a guard that
/// must outlive that work (a gRPC stream's, [`FailGuard::into_owned`]) or the drop path
/// holds a reference count of its own.
pub(crate) struct FailGuard<'a> {
    armed: Option<(StoreRef<'a>, RecordId, FencingToken)>,
}

enum StoreRef<'a> {
    Borrowed(&'a Arc<LayerStore>),
    #[cfg(feature = "grpc")]
    Owned(Arc<LayerStore>),
}

impl StoreRef<'_> {
    fn get(&self) -> &Arc<LayerStore> {
        match self {
            StoreRef::Borrowed(store) => store,
            #[cfg(feature = "grpc")]
            StoreRef::Owned(store) => store,
        }
    }
}

impl<'a> FailGuard<'a> {
    pub(crate) fn new(store: &'a Arc<LayerStore>, id: RecordId, token: FencingToken) -> Self {
        Self { armed: Some((StoreRef::Borrowed(store), id, token)) }
    }

    /// The same duty, held past the request's work.
    #[cfg(feature = "grpc")]
    pub(crate) fn into_owned(mut self) -> FailGuard<'static> {
        let armed = self.armed.take().map(|(store, id, token)| (StoreRef::Owned(Arc::clone(store.get())), id, token));
        FailGuard { armed }
    }

    /// The duty is done (or handed on): dropping no longer writes.
    pub(crate) fn disarm(&mut self) {
        self.armed = None;
    }

    /// Writes `fail` now and disarms. If this future is itself dropped mid-write, the
    /// guard is still armed and the drop path retries the write.
    pub(crate) async fn fail_now(&mut self, why: &'static str) {
        if let Some((store, id, token)) = &self.armed {
            log_fail(store.get().fail(*id, *token).await, *id, *token, why);
        }
        self.disarm();
    }
}

impl Drop for FailGuard<'_> {
    fn drop(&mut self) {
        let Some((store, id, token)) = self.armed.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let store = Arc::clone(store.get());
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

fn log_fail(result: Result<idem_core::Receipt, idem_core::StoreError>, id: RecordId, token: FencingToken, why: &str) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use bytes::Bytes;
    use futures::FutureExt;
    use http_body_util::Empty;

    use super::*;

    type Rf = ResponseFuture<Empty<Bytes>, ()>;

    fn done() -> Result<Response<ResponseBody<Empty<Bytes>>>, ()> {
        Err(())
    }

    /// A detached request's work was cancelled with its response future instead of moving to a task of its own.
    #[tokio::test]
    async fn marked_work_runs_to_its_end_after_the_response_future_is_dropped() {
        let (finished, gate) = (Arc::new(AtomicBool::new(false)), Arc::new(tokio::sync::Notify::new()));
        let (f, g) = (Arc::clone(&finished), Arc::clone(&gate));
        let mut rf = Rf::new(Box::pin(async move {
            detach_on_drop();
            g.notified().await;
            f.store(true, Ordering::SeqCst);
            done()
        }));
        assert!((&mut rf).now_or_never().is_none());
        assert!(format!("{rf:?}").contains("detached_on_drop: true"));
        drop(rf);
        gate.notify_one();
        for _ in 0..100 {
            if finished.load(Ordering::SeqCst) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the work did not finish on its own task");
    }

    /// A layer nested inside another's handler took its inner layer's detach mark (or lost its own).
    #[tokio::test]
    async fn a_mark_stays_with_the_innermost_response_future() {
        let inner = Rf::new(Box::pin(async {
            detach_on_drop();
            futures::future::pending().await
        }));
        // A future of its own around the inner one, as the outer layer's work would be.
        let mut outer = Rf::new(Box::pin(inner.map(|out| out)));
        assert!((&mut outer).now_or_never().is_none());
        assert!(format!("{outer:?}").contains("detached_on_drop: false"), "{outer:?}");

        let inner = Rf::new(Box::pin(futures::future::pending()));
        let mut outer = Rf::new(Box::pin(async move {
            detach_on_drop();
            inner.await
        }));
        assert!((&mut outer).now_or_never().is_none());
        assert!(format!("{outer:?}").contains("detached_on_drop: true"), "{outer:?}");
        assert!(DETACH_MARK.take().is_none(), "no mark leaks out of a poll");
    }

    /// Unmarked work (inline execution, or before the claim) is cancelled with its response future.
    #[tokio::test]
    async fn unmarked_work_is_cancelled_with_its_response_future() {
        let finished = Arc::new(AtomicBool::new(false));
        let f = Arc::clone(&finished);
        let mut rf = Rf::new(Box::pin(async move {
            tokio::task::yield_now().await;
            f.store(true, Ordering::SeqCst);
            done()
        }));
        assert!((&mut rf).now_or_never().is_none());
        drop(rf);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!finished.load(Ordering::SeqCst));
    }
}
