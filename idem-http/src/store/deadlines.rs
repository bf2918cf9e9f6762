//! A deadline on every store call ([`crate::deadline::StoreDeadlines`]): a call with no
//! answer by then is abandoned and counts as a transient `StoreError::Unavailable`
//! ([`crate::deadline::DeadlineMissed`]), so a stalled store costs a request its deadline,
//! not the client's whole patience.
//!
//! The timer is set when the call first waits: a call the store answers at once (an
//! in-memory store, a record in a cache) needs none, so the common request sets no timer
//! at all. Outside a tokio runtime nothing can time a call, and it runs without one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::future::BoxFuture;
use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, Receipt, ReclaimOutcome, ReclaimRequest, Record, RecordId,
    Store, StoreError, StoredResponse, SweepOutcome,
};
use tokio::time::Sleep;

use super::Calls;
use crate::deadline::{DeadlineMissed, StoreDeadlines};

/// The given store, each call bounded by its deadline.
pub(crate) struct Deadlined {
    store: Arc<dyn Store>,
    deadlines: StoreDeadlines,
}

impl Deadlined {
    pub(crate) fn new(store: Arc<dyn Store>, deadlines: StoreDeadlines) -> Self {
        Self { store, deadlines }
    }

    /// The store itself, called through its vtable: `Arc<dyn Store>` is a `Store` too,
    /// whose every call would box one more future around the store's own.
    fn store(&self) -> &dyn Store {
        &*self.store
    }
}

/// `call`, abandoned `limit` (at least 1 ms) after it first waited, as a transient failure
/// named `what`.
fn within<'a, T>(limit: Duration, what: &'static str, call: BoxFuture<'a, Result<T, StoreError>>) -> Within<'a, T> {
    Within { call, limit: limit.max(Duration::from_millis(1)), what, timer: None }
}

/// The future of [`within`].
pub(crate) struct Within<'a, T> {
    call: BoxFuture<'a, Result<T, StoreError>>,
    limit: Duration,
    what: &'static str,
    /// Set at the first poll that found the call waiting.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<T> Future for Within<'_, T> {
    type Output = Result<T, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Poll::Ready(answer) = this.call.as_mut().poll(cx) {
            return Poll::Ready(answer);
        }
        let timer = match &mut this.timer {
            Some(timer) => timer,
            // No tokio runtime, no timer: nothing can time the call out.
            None if tokio::runtime::Handle::try_current().is_err() => return Poll::Pending,
            None => this.timer.insert(Box::pin(tokio::time::sleep(this.limit))),
        };
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(DeadlineMissed::error(this.limit, this.what)))
    }
}

impl Calls for Deadlined {
    fn claim(&self, req: ClaimRequest) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send {
        within(self.deadlines.claim, "claim", self.store().claim(req))
    }

    fn reclaim(&self, req: ReclaimRequest) -> impl Future<Output = Result<ReclaimOutcome, StoreError>> + Send {
        within(self.deadlines.claim, "reclaim", self.store().reclaim(req))
    }

    fn complete<R>(
        &self,
        id: RecordId,
        token: FencingToken,
        mut response: R,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + Send
    where
        R: FnMut() -> StoredResponse + Send,
    {
        within(self.deadlines.complete, "complete", self.store().complete(id, token, response()))
    }

    fn fail(&self, id: RecordId, token: FencingToken) -> impl Future<Output = Result<Receipt, StoreError>> + Send {
        within(self.deadlines.complete, "fail", self.store().fail(id, token))
    }

    fn extend(
        &self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + Send {
        within(self.deadlines.extend, "extend", self.store().extend(id, token, lease_ttl))
    }

    fn get(&self, id: RecordId) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        within(self.deadlines.read, "get", self.store().get(id))
    }

    fn journal_put<'a>(
        &'a self,
        id: RecordId,
        token: FencingToken,
        name: &'a str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> impl Future<Output = Result<JournalWrite, StoreError>> + Send {
        within(self.deadlines.journal, "journal_put", self.store().journal_put(id, token, name, value, overwrite))
    }

    fn journal_get<'a>(
        &'a self,
        id: RecordId,
        name: &'a str,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send {
        within(self.deadlines.read, "journal_get", self.store().journal_get(id, name))
    }

    /// No deadline: the layer never sweeps (the sweeper in `idem_core::sweeper` does).
    fn sweep(&self, limit: usize) -> impl Future<Output = Result<SweepOutcome, StoreError>> + Send {
        self.store().sweep(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call answered at once set a timer (a timer per call is a timer per request).
    #[tokio::test(start_paused = true)]
    async fn a_call_answered_at_once_sets_no_timer() {
        let mut call = within(Duration::from_secs(2), "claim", Box::pin(async { Ok::<_, StoreError>(7) }));
        assert_eq!(Pin::new(&mut call).await.ok(), Some(7));
        let mut stalled = within::<()>(Duration::from_millis(5), "claim", Box::pin(std::future::pending()));
        assert!(futures::poll!(Pin::new(&mut stalled)).is_pending());
        assert!(stalled.timer.is_some(), "a waiting call is timed");
        assert!(matches!(stalled.await, Err(e) if e.is_retryable()), "missed: a transient failure");
    }
}
