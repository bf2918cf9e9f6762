//! What keeps a streamed gRPC response's claim alive: its lease renewal, on a task of its
//! own, and the watch that stops it once the client has stopped reading.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use futures::future::{Either, select};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use crate::lease::Lease;

/// [`Progress::phase`]: the stream flows.
const LIVE: u8 = 0;
/// [`Progress::phase`]: the stream ended; the renewal covers the final write.
const ENDED: u8 = 1;
/// [`Progress::phase`]: the client was taken for gone; the renewal stopped.
const GONE: u8 = 2;

/// How long past one lease TTL without a poll the idle watch looks: idle means longer than
/// one lease TTL, so a client that reads once per lease TTL still reads; one tick of
/// tokio's millisecond timers.
const IDLE_GRACE: Duration = Duration::from_millis(1);

/// How a stream's client reads, shared by the body (which records each poll, and the end)
/// and the idle watch beside the renewal (which may take the client for gone). The renewal
/// runs on its own task and would otherwise renew for as long as the body exists, read or
/// not: a client that stops reading without closing its connection (half-open, no HTTP/2
/// keepalive) would hold the key claimed for ever.
pub(super) struct Progress {
    /// Origin of [`Self::last_poll`].
    base: Instant,
    /// The last poll of the body: nanoseconds after `base`, shifted left by one, the low
    /// bit set when that poll returned `Pending`. One word, so the watch never reads the
    /// time of one poll with the outcome of another.
    last_poll: AtomicU64,
    /// [`LIVE`], [`ENDED`] or [`GONE`]. The body's end and the idle watch each move it from
    /// `LIVE`, and the first decides: an ended stream's write keeps its renewal, and a
    /// client taken for gone cannot end its stream with a write its lease no longer covers.
    phase: AtomicU8,
}

impl Progress {
    pub(super) fn new() -> Self {
        Self { base: Instant::now(), last_poll: AtomicU64::new(0), phase: AtomicU8::new(LIVE) }
    }

    /// Records a poll of the body, now, and whether it returned `Pending`.
    pub(super) fn polled(&self, pending: bool) {
        let nanos = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX).min(u64::MAX >> 1);
        self.last_poll.store((nanos << 1) | u64::from(pending), Ordering::Release);
    }

    /// When the body was last polled, and whether that poll returned `Pending`.
    fn last_poll(&self) -> (Instant, bool) {
        let word = self.last_poll.load(Ordering::Acquire);
        (self.base + Duration::from_nanos(word >> 1), word & 1 == 1)
    }

    pub(super) fn is_gone(&self) -> bool {
        self.phase.load(Ordering::Acquire) == GONE
    }

    /// The stream ended: `true` unless the client was taken for gone first.
    pub(super) fn end(&self) -> bool {
        self.phase.compare_exchange(LIVE, ENDED, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Resolves once the body has been left unpolled after a frame for longer than `ttl`,
    /// having taken the client for gone; never once the stream ended.
    async fn idle(self: Arc<Self>, ttl: Duration) {
        while self.phase.load(Ordering::Acquire) == LIVE {
            let (at, pending) = self.last_poll();
            let now = Instant::now();
            if pending {
                // The client waits for the handler's next frame: a handler slow to send is
                // no sign of a client gone. Looked at again a lease later; the poll that
                // hands that frame over moves `at`.
                tokio::time::sleep_until(now + ttl).await;
            } else if now.saturating_duration_since(at) > ttl {
                if self.phase.compare_exchange(LIVE, GONE, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    return;
                }
            } else {
                tokio::time::sleep_until(at + ttl + IDLE_GRACE).await;
            }
        }
        std::future::pending::<()>().await;
    }
}

/// A stream's lease renewal and the idle watch that stops it, on a task of their own (not
/// polled with the body, or a client that reads slowly would let the lease run out under
/// a live stream). Aborted when dropped, the renewal with it: a stream dropped half-way
/// stops renewing, so its lease runs out.
#[derive(Default)]
pub(super) struct Keeper {
    task: Option<tokio::task::JoinHandle<()>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Keeper {
    pub(super) fn start(
        renewal: impl Future<Output = ()> + Send + 'static,
        lease: Lease,
        progress: Arc<Progress>,
        runtime: &tokio::runtime::Handle,
        span: tracing::Span,
    ) -> Self {
        let (id, token, ttl) = (lease.id, lease.token, lease.ttl);
        let (stop, stopped) = oneshot::channel();
        let keep = async move {
            // A renewal that ended (lease lost, or the store cannot extend) leaves the
            // watch alone until the stop.
            let renew = async move {
                renewal.await;
                std::future::pending::<()>().await;
            };
            let (idle, renew) = (pin!(progress.idle(ttl)), pin!(renew));
            let watched = select(idle, renew);
            // Returning drops the renewal, wherever it is: stopped, or the client gone.
            if let Either::Left(_) = select(watched, stopped).await {
                tracing::warn!(
                    record = %id, token = %token,
                    "the client has not read the gRPC stream for longer than a lease TTL and is taken for gone: the \
                     lease is no longer renewed, and once it lapses a retry runs the call again"
                );
            }
        };
        Self { task: Some(runtime.spawn(keep.instrument(span))), stop: Some(stop) }
    }

    /// Stops the renewal and waits until it has: a renewal refused after the record was
    /// written would read as a lost lease.
    pub(super) async fn stop(mut self) {
        if let (Some(stop), Some(task)) = (self.stop.take(), self.task.take()) {
            let _ = stop.send(());
            let _ = task.await;
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
