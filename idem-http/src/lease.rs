//! Lease renewal while a claimed handler runs, and the lease state the handler can watch.
//!
//! The renewal is a loop of tokio timers and fenced [`Store::extend`] calls, polled
//! together with the attempt's own work ([`while_renewing`]): the handler, then its
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

use futures::future::{Either, select};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use idem_core::{FencingToken, LeaseWatch, RecordId, Store, StoreError};
use tokio::sync::Notify;
use tokio::time::Instant;

/// First pause before a failed renewal is tried again; it doubles per failure.
const RETRY_FIRST: Duration = Duration::from_millis(25);
/// Longest pause between two tries of one failing renewal.
const RETRY_MAX: Duration = Duration::from_secs(1);

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

/// The renewal duty of one claimed attempt.
#[derive(Debug)]
pub(crate) struct Renewal {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) id: RecordId,
    pub(crate) token: FencingToken,
    pub(crate) lease_ttl: Duration,
    pub(crate) interval: Duration,
    /// Sent time of the claim or reclaim that gave this attempt its lease.
    pub(crate) claimed_at: Instant,
    pub(crate) state: LeaseState,
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

impl Renewal {
    /// Renews every `interval` until the lease is lost or the store cannot extend; then
    /// returns (the caller keeps awaiting the handler alone).
    pub(crate) async fn run(self) {
        let mut lease_end = self.claimed_at + self.lease_ttl;
        let mut next = self.claimed_at + self.interval;
        loop {
            tokio::time::sleep_until(next).await;
            match self.renew_once(lease_end).await {
                Renewed::Yes(sent) => {
                    lease_end = sent + self.lease_ttl;
                    next = sent + self.interval;
                }
                Renewed::NotYet => next = Instant::now() + self.interval,
                Renewed::Stop => return,
            }
        }
    }

    async fn renew_once(&self, lease_end: Instant) -> Renewed {
        let (id, token) = (self.id, self.token);
        let mut pause = RETRY_FIRST;
        loop {
            let sent = Instant::now();
            // A hung call must not outlast the lease it tries to keep: past that, it counts
            // as a transient failure and the next interval tries again.
            let limit = lease_end.saturating_duration_since(sent).max(self.interval);
            let result = match tokio::time::timeout(limit, self.store.extend(id, token, self.lease_ttl)).await {
                Ok(result) => result,
                Err(_) => Err(StoreError::unavailable("idem-http", "lease renewal", true, TimedOut)),
            };
            match result {
                Ok(record) => {
                    self.state.renewed();
                    tracing::trace!(record = %id, token = %token, lease_expires_at = %record.lease_expires_at, "lease renewed");
                    return Renewed::Yes(sent);
                }
                Err(e) if e.is_lease_lost() => {
                    self.state.set_lost();
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
}

/// The source of a renewal that timed out.
#[derive(Debug, thiserror::Error)]
#[error("the store did not answer before the lease ran out")]
struct TimedOut;

/// Awaits `work` while `renewal` (the attempt's [`Renewal::run`], `None` without renewal)
/// renews its lease. The renewal is polled only here: between two calls, and once the
/// caller drops it, it does not run; one that ended (lease lost, or the store cannot
/// extend) is set to `None` and the work goes on alone.
pub(crate) async fn while_renewing<R, F>(mut renewal: Pin<&mut Option<R>>, work: F) -> F::Output
where
    R: Future<Output = ()>,
    F: Future,
{
    let Some(run) = renewal.as_mut().as_pin_mut() else { return work.await };
    let mut work = pin!(work);
    match select(work.as_mut(), run).await {
        Either::Left((output, _)) => output,
        Either::Right(((), work)) => {
            renewal.set(None);
            work.await
        }
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
