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
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::future::BoxFuture;
use idem_core::StoreError;
use tokio::time::Sleep;

use super::Op;
use crate::deadline::DeadlineMissed;

/// `call`, abandoned `limit` (at least 1 ms) after it first waited, as a transient failure
/// of `op`.
pub(super) fn within<'a, T>(limit: Duration, op: Op, call: BoxFuture<'a, Result<T, StoreError>>) -> Within<'a, T> {
    Within { call, limit: limit.max(Duration::from_millis(1)), what: op.as_str(), timer: None }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A call answered at once set a timer (a timer per call is a timer per request).
    #[tokio::test(start_paused = true)]
    async fn a_call_answered_at_once_sets_no_timer() {
        let mut call = within(Duration::from_secs(2), Op::Claim, Box::pin(async { Ok::<_, StoreError>(7) }));
        assert_eq!(Pin::new(&mut call).await.ok(), Some(7));
        let mut stalled = within::<()>(Duration::from_millis(5), Op::Claim, Box::pin(std::future::pending()));
        assert!(futures::poll!(Pin::new(&mut stalled)).is_pending());
        assert!(stalled.timer.is_some(), "a waiting call is timed");
        assert!(matches!(stalled.await, Err(e) if e.is_retryable()), "missed: a transient failure");
    }
}
