//! Lease renewal while a claimed handler runs, and the lease state the handler can watch.
//!
//! The renewal is a loop of tokio timers and fenced `Store::extend` calls, polled
//! together with the attempt's own work ([`Renewal::during`]): the handler, then its
//! completion, which may be resent for a whole lease while the store is out. It lives
//! exactly as long as that work, moves with it to a task of its own under
//! [`crate::HandlerExecution::Detached`], and is cancelled with it under
//! [`crate::HandlerExecution::Inline`]. A process that dies or stalls stops renewing with
//! it, so a retry reclaims the record once its lease runs out. A streamed gRPC response,
//! whose status comes after the request's future has returned, renews on a task of its
//! own (`crate::grpc`).
//!
//! Time here is tokio's ([`tokio::time::Instant`]), so tests drive renewals with
//! `tokio::time::pause` and `advance`. The lease itself is measured by the store's clock;
//! this side only keeps a local estimate of when it ends (the send time of the last
//! successful renewal plus the lease TTL, which is never later than the store's own end),
//! to know how long a failing renewal may be retried.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use idem_core::{FencingToken, LeaseWatch, RecordId, StoreError};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::LayerStore;

/// First pause before a failed renewal (or a completion, `crate::store`) is sent again; it
/// doubles per failure.
pub(crate) const RETRY_FIRST: Duration = Duration::from_millis(25);
/// Longest pause between two tries of one failing renewal or completion.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(1);

/// A request extension: the wall-clock instant at which the handler will be stopped from
/// outside the process (AWS Lambda's `Context::deadline()`), set by a layer outside the
/// idempotency layer. A handler killed there writes nothing, so with a fixed lease its retry
/// would get 409 for a whole lease TTL. With it the layer claims a lease of min(lease TTL,
/// time left) and never renews past the deadline, so a retry reclaims from the deadline
/// on; with under 1 ms left it answers 503 `deadline-passed` (`Retry-After: 1`), claiming
/// nothing and not running the handler. The time left is read once, on the system clock,
/// as the request enters the layer. Without the extension nothing changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseDeadline(SystemTime);

impl LeaseDeadline {
    /// The deadline at `at`, on the system clock.
    #[must_use]
    pub fn at(at: SystemTime) -> Self {
        Self(at)
    }

    /// The time left from now, on tokio's clock; `None` under 1 ms (the stores count ms).
    pub(crate) fn instant(self) -> Option<Instant> {
        let left = self.0.duration_since(SystemTime::now()).ok().filter(|left| left.as_millis() > 0)?;
        Some(Instant::now() + left)
    }
}

/// min(`ttl`, time left until `deadline`): the lease a claim or a renewal asks for.
pub(crate) fn capped(ttl: Duration, deadline: Option<Instant>) -> Duration {
    deadline.map_or(ttl, |deadline| ttl.min(deadline.saturating_duration_since(Instant::now())))
}

/// What one attempt knows about its lease, shared by the renewal loop (which writes it)
/// and the handler's [`crate::IdempotencyContext`] and [`crate::Resumable`] (which read it).
#[derive(Clone, Debug)]
pub(crate) struct LeaseState(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    lost: AtomicBool,
    /// Wakes every [`LeaseState::lost`] future once `lost` is set.
    notify: Notify,
    /// Successful renewals so far (the span's `renewals` field).
    renewals: AtomicU64,
}

impl LeaseState {
    pub(crate) fn new() -> Self {
        Self(Arc::new(Shared { lost: AtomicBool::new(false), notify: Notify::new(), renewals: AtomicU64::new(0) }))
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.0.lost.load(Ordering::Acquire)
    }

    fn renewed(&self) {
        self.0.renewals.fetch_add(1, Ordering::Relaxed);
    }

    /// How many renewals moved the lease so far.
    pub(crate) fn renewals(&self) -> u64 {
        self.0.renewals.load(Ordering::Relaxed)
    }

    fn set_lost(&self) {
        self.0.lost.store(true, Ordering::Release);
        self.0.notify.notify_waiters();
    }

    /// Resolves once the lease is lost; pending forever otherwise.
    pub(crate) fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let shared = Arc::clone(&self.0);
        async move {
            loop {
                let mut notified = pin!(shared.notify.notified());
                // Registered before the flag is read, so a loss between the read and the
                // await still wakes this future.
                notified.as_mut().enable();
                if shared.lost.load(Ordering::Acquire) {
                    return;
                }
                notified.await;
            }
        }
    }
}

impl LeaseWatch for LeaseState {
    fn is_lease_lost(&self) -> bool {
        self.is_lost()
    }
}

/// The lease one claimed attempt renews: the terms of its claim.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lease {
    pub(crate) id: RecordId,
    pub(crate) token: FencingToken,
    pub(crate) ttl: Duration,
    pub(crate) interval: Duration,
    /// Sent time of the claim or reclaim that gave this attempt its lease.
    pub(crate) claimed_at: Instant,
    /// The request's [`LeaseDeadline`]: no renewal moves the lease past it.
    pub(crate) deadline: Option<Instant>,
}

/// How one renewal (with its retries) ended.
enum Renewed {
    /// The store moved the lease; the call was sent at this instant.
    Yes(Instant),
    /// Transient failures until the local estimate of the lease ran out: try again at the
    /// next interval (the store still extends a lease that ran out, until someone reclaims).
    NotYet,
    /// The attempt is over (`LeaseLost`), or the store cannot extend: stop renewing.
    Stop,
}

/// Renews `lease` every interval until it is lost or the store cannot extend; then
/// returns (the caller keeps awaiting the work alone). Without a tokio runtime to time it
/// (an executor other than tokio) it returns at once: nothing renews.
pub(crate) async fn renew(store: &LayerStore, lease: Lease, state: &LeaseState) {
    if tokio::runtime::Handle::try_current().is_err() {
        tracing::debug!(record = %lease.id, "no tokio runtime: the lease is not renewed");
        return;
    }
    let mut lease_end = lease.claimed_at + capped(lease.ttl, lease.deadline);
    let mut next = lease.claimed_at + lease.interval;
    loop {
        tokio::time::sleep_until(next).await;
        match renew_once(store, &lease, state, lease_end).await {
            Renewed::Yes(sent) => {
                lease_end = sent + capped(lease.ttl, lease.deadline);
                next = sent + lease.interval;
            }
            Renewed::NotYet => next = Instant::now() + lease.interval,
            Renewed::Stop => return,
        }
    }
}

async fn renew_once(store: &LayerStore, lease: &Lease, state: &LeaseState, lease_end: Instant) -> Renewed {
    let (id, token) = (lease.id, lease.token);
    let mut pause = RETRY_FIRST;
    loop {
        let sent = Instant::now();
        // At the deadline the lease already ends there, and the handler is about to stop.
        let ttl = capped(lease.ttl, lease.deadline);
        if ttl.is_zero() {
            return Renewed::Stop;
        }
        // A hung call must not outlast the lease it tries to keep: past that, it counts
        // as a transient failure and the next interval tries again.
        let limit = lease_end.saturating_duration_since(sent).max(lease.interval);
        let result = match tokio::time::timeout(limit, store.extend(id, token, ttl)).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::unavailable("idem-http", "lease renewal", true, TimedOut)),
        };
        match result {
            Ok(receipt) => {
                state.renewed();
                tracing::trace!(record = %id, token = %token, lease_expires_at = %receipt.lease_expires_at, "lease renewed");
                return Renewed::Yes(sent);
            }
            Err(e) if e.is_lease_lost() => {
                state.set_lost();
                tracing::warn!(
                    record = %id, token = %token, error = %e,
                    "lease lost while the handler runs: another attempt may own the record; renewal stopped, \
                     resumable steps refuse to start, and this attempt's response will not be stored"
                );
                return Renewed::Stop;
            }
            // A non-retryable `Unavailable` (a full disk, an I/O error) is retried like a
            // blip: the handler runs on, and the store may well recover (the disk freed)
            // before anyone reclaims; giving up would let the lease run out under a
            // running handler and a retry run it twice. The fence keeps a renewal after
            // a reclaim harmless (`LeaseLost`).
            Err(e) if e.is_retryable() || matches!(e, StoreError::Unavailable { .. }) => {
                let retry_at = Instant::now() + pause;
                if retry_at >= lease_end {
                    tracing::warn!(
                        record = %id, token = %token, error = %e,
                        "lease renewal keeps failing and the lease may run out; trying again at the next interval"
                    );
                    return Renewed::NotYet;
                }
                tracing::debug!(record = %id, token = %token, error = %e, "lease renewal failed; retrying");
                tokio::time::sleep_until(retry_at).await;
                pause = (pause * 2).min(RETRY_MAX);
            }
            Err(e) => {
                tracing::error!(
                    record = %id, token = %token, error = %e,
                    "lease renewal failed for good; renewal stopped, and the lease runs out as if it were off"
                );
                return Renewed::Stop;
            }
        }
    }
}

/// The source of a renewal that timed out.
#[derive(Debug, thiserror::Error)]
#[error("the store did not answer before the lease ran out")]
struct TimedOut;

/// An attempt's lease renewal ([`renew`]), polled only alongside the attempt's own work
/// ([`Renewal::during`]): it is started, as a future of its own, the first time that work
/// waits, so work that ends at once (most handlers, most completions) starts none.
pub(crate) struct Renewal<'a> {
    state: RenewalState<'a>,
}

enum RenewalState<'a> {
    /// Not started: what starting it takes; `None` when nothing renews.
    Idle(Option<(&'a LayerStore, Lease, &'a LeaseState)>),
    Running(Pin<Box<dyn Future<Output = ()> + Send + 'a>>),
    /// Ended (the lease was lost, or the store cannot extend): the work goes on alone.
    Over,
}

impl<'a> Renewal<'a> {
    /// The renewal of `lease` (`None`: nothing renews), which reports to `state`.
    pub(crate) fn new(store: &'a LayerStore, lease: Option<Lease>, state: &'a LeaseState) -> Self {
        Self { state: RenewalState::Idle(lease.map(|lease| (store, lease, state))) }
    }

    /// `work` (pinned by the caller, in its own frame), awaited while the lease is renewed.
    /// The renewal is polled only here: between two calls, and once the caller drops it, it
    /// does not run.
    pub(crate) fn during<'r, F: Future>(&'r mut self, work: Pin<&'r mut F>) -> During<'r, 'a, F> {
        During { renewal: self, work }
    }
}

/// The future of [`Renewal::during`]: the work, and the renewal polled whenever the work
/// waits.
pub(crate) struct During<'r, 'a, F> {
    renewal: &'r mut Renewal<'a>,
    work: Pin<&'r mut F>,
}

impl<F: Future> Future for During<'_, '_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        if let Poll::Ready(output) = this.work.as_mut().poll(cx) {
            return Poll::Ready(output);
        }
        let state = &mut this.renewal.state;
        if let RenewalState::Idle(Some((store, lease, lease_state))) = *state {
            *state = RenewalState::Running(Box::pin(renew(store, lease, lease_state)));
        }
        if let RenewalState::Running(renewal) = state
            && renewal.as_mut().poll(cx).is_ready()
        {
            *state = RenewalState::Over;
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `lost` future created before the loss never woke, or one created after it did not resolve.
    #[tokio::test]
    async fn lost_resolves_for_waiters_before_and_after_the_loss() {
        let state = LeaseState::new();
        let before = tokio::spawn(state.lost());
        tokio::task::yield_now().await;
        assert!(!before.is_finished() && !state.is_lost());
        state.set_lost();
        before.await.unwrap();
        state.lost().await;
        assert!(state.is_lease_lost());
    }
}
