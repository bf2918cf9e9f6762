#![doc = include_str!("../README.md")]
//!
//! # Layout
//! - `src/lib.rs`: [`Consumer`] (claim, run with lease renewal, settle), [`Delivery`],
//!   [`Settle`] and the reasons it carries.
//! - `src/nats.rs` (feature `nats`): `nats::JetStream`, the glue for JetStream messages.
//! - `src/amqp.rs` (feature `amqp`): `amqp::Amqp`, the glue for RabbitMQ deliveries.

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "nats")]
pub mod nats;

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Decision, Endpoint, Fingerprint, IdempotencyKey, KeyError, LeaseWatch, ReclaimOutcome,
    ReclaimRequest, Record, RequestParts, Resumable, Scope, ScopeError, Store, StoreError, StoredResponse, decide,
};
use tokio::time::Instant;

/// The method half of every consumer record's endpoint (`CONSUME {source}`): a message
/// scope never collides with an HTTP route's.
pub const METHOD: &str = "CONSUME";

/// One message as the engine sees it: where it came from, who sent it, its key and payload.
#[derive(Clone, Copy, Debug)]
pub struct Delivery<'a> {
    source: &'a str,
    principal: &'a str,
    key: Option<&'a [u8]>,
    payload: &'a [u8],
    attempt: u32,
}

impl<'a> Delivery<'a> {
    /// A message from `source` (the stream or queue: the endpoint half of the scope), sent
    /// by `principal` (the tenant or producer the consumer trusts it to come from), with
    /// idempotency key `key` (a header or field; `None` when the message has none) and
    /// `payload` (fingerprinted byte for byte).
    #[must_use]
    pub fn new(source: &'a str, principal: &'a str, key: Option<&'a [u8]>, payload: &'a [u8]) -> Self {
        Self { source, principal, key, payload, attempt: 1 }
    }

    /// The broker's count of deliveries of this message, this one included (JetStream's
    /// `delivered`, RabbitMQ's `x-delivery-count`); 1 when unknown. A failing handler is
    /// dead-lettered on the delivery [`Config::with_max_failures`] names.
    #[must_use]
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt.max(1);
        self
    }
}

/// What to do with the message at the broker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Acknowledge it: its effect is done.
    Ack(Acked),
    /// Leave it unacknowledged and have the broker deliver it again after `after`
    /// (JetStream `NAK` with a delay; RabbitMQ: held, then `basic.nack` with requeue).
    Redeliver {
        /// How long to wait before the next delivery.
        after: Duration,
        /// Why.
        why: Redeliver,
    },
    /// Move it to the dead-letter destination with `reason`; never deliver it again here.
    DeadLetter(DeadLetter),
}

/// Why a message is acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acked {
    /// This delivery claimed the key, ran the handler and completed the record.
    Ran,
    /// An earlier delivery completed the record: the handler did not run.
    AlreadyDone,
}

/// Why a message goes back to the broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Redeliver {
    /// Another delivery of the same key holds a live lease (a consumer still working on
    /// it, or one that died and whose lease has not run out).
    InFlight,
    /// The handler returned an error (the record is marked failed: the next delivery
    /// takes it over and runs the handler again).
    HandlerFailed,
    /// The store did not answer; nothing ran without a claim.
    StoreUnavailable,
    /// This delivery's lease was taken over while its handler ran; the handler was
    /// stopped and its result not stored.
    LeaseLost,
}

/// Why a message is dead-lettered; [`DeadLetter::code`] names it in a header.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeadLetter {
    /// The message carries no idempotency key.
    #[error("the message carries no idempotency key")]
    MissingKey,
    /// The key is not a valid idempotency key.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(KeyError),
    /// The principal is blank.
    #[error("invalid scope: {0}")]
    InvalidScope(ScopeError),
    /// The key was first used with another payload: running this one would apply a
    /// different job under a key that is already spent.
    #[error("the key was first used with a different payload")]
    Mismatch,
    /// The handler failed on `attempts` deliveries in a row; the last error is kept.
    #[error("the handler failed on {attempts} deliveries; last error: {error}")]
    HandlerFailed {
        /// The delivery count when the consumer gave up.
        attempts: u32,
        /// The last error, as displayed.
        error: String,
    },
}

impl DeadLetter {
    /// A short machine-readable name: `missing-key`, `invalid-key`, `invalid-scope`,
    /// `mismatch`, `handler-failed`.
    #[must_use]
    pub fn code(&self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::InvalidKey(_) => "invalid-key",
            Self::InvalidScope(_) => "invalid-scope",
            Self::Mismatch => "mismatch",
            Self::HandlerFailed { .. } => "handler-failed",
        }
    }
}

/// The engine's settings. The defaults suit jobs of seconds to minutes.
#[derive(Clone, Debug)]
pub struct Config {
    lease_ttl: Duration,
    retention: Duration,
    retry_after: Duration,
    max_in_flight_wait: Duration,
    max_failures: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            retry_after: Duration::from_secs(1),
            max_in_flight_wait: Duration::from_secs(30),
            max_failures: 5,
        }
    }
}

impl Config {
    /// How long a claim holds the key without renewal (default 30 s). The engine renews it
    /// every third of this while the handler runs, and a consumer that dies leaves the key
    /// to the next delivery after at most this long.
    #[must_use]
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl.max(Duration::from_millis(30));
        self
    }

    /// How long a completed key is remembered (default 24 h): a redelivery or a publisher
    /// retry within it is acknowledged without running the handler; after it, it runs again.
    /// Keep it longer than the broker's redelivery horizon.
    #[must_use]
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The delay before a delivery whose handler failed, or whose store was down, comes
    /// back (default 1 s).
    #[must_use]
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// The longest delay asked for a delivery whose key is in flight elsewhere (default
    /// 30 s); below it the delay is the time left on the other delivery's lease.
    #[must_use]
    pub fn with_max_in_flight_wait(mut self, wait: Duration) -> Self {
        self.max_in_flight_wait = wait;
        self
    }

    /// On which delivery a failing handler is dead-lettered instead of redelivered
    /// (default 5; needs the broker's delivery count, [`Delivery::with_attempt`]).
    #[must_use]
    pub fn with_max_failures(mut self, deliveries: u32) -> Self {
        self.max_failures = deliveries.max(1);
        self
    }
}

/// Runs message handlers once per key: claims the key in the store, runs the handler
/// under a renewed lease, completes the record, and says how to settle the message.
#[derive(Clone, Debug)]
pub struct Consumer {
    store: Arc<dyn Store>,
    config: Config,
}

/// The lease watch a handler's [`Resumable`] asks before each step.
#[derive(Debug, Default)]
struct Watch(AtomicBool);

impl LeaseWatch for Watch {
    fn is_lease_lost(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// How many times a claim is decided again after a reclaim lost a race.
const DECIDE_ROUNDS: usize = 3;

impl Consumer {
    /// An engine on `store`.
    #[must_use]
    pub fn new(store: Arc<dyn Store>, config: Config) -> Self {
        Self { store, config }
    }

    /// The store.
    #[must_use]
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Processes one delivery: never runs `handler` without holding the key's claim, and
    /// never for a key already completed.
    ///
    /// - A new key (or a failed one, or one whose lease ran out): claims it and runs
    ///   `handler` with a [`Resumable`] for its side effects (steps and intents keyed by
    ///   sub-keys, so a run after a crash converges instead of repeating them). While it
    ///   runs, the lease is renewed every third of its length and `keep_alive` is called
    ///   after each renewal (JetStream's `in_progress`, keeping the broker's ack deadline
    ///   in step). `Ok` completes the record ([`Settle::Ack`]); `Err` marks it failed
    ///   ([`Settle::Redeliver`], or [`DeadLetter::HandlerFailed`] on the last delivery).
    /// - A completed key with the same payload: [`Acked::AlreadyDone`], handler not run.
    /// - A key in flight elsewhere: [`Redeliver::InFlight`] after the time left on its lease.
    /// - A key first used with another payload, or no valid key: [`Settle::DeadLetter`].
    /// - A store error before the claim: [`Redeliver::StoreUnavailable`]; nothing ran.
    ///
    /// If the lease is lost while the handler runs (another delivery took the key over
    /// after renewals failed), the handler is dropped at its next await point and the
    /// message redelivered: the new owner's result stands.
    pub async fn process<F, Fut, E, K, KFut>(&self, delivery: Delivery<'_>, keep_alive: K, handler: F) -> Settle
    where
        F: FnOnce(Resumable) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: fmt::Display,
        K: Fn() -> KFut,
        KFut: Future<Output = ()>,
    {
        let Some(raw_key) = delivery.key else { return Settle::DeadLetter(DeadLetter::MissingKey) };
        let key = match IdempotencyKey::parse(raw_key) {
            Ok(key) => key,
            Err(e) => return Settle::DeadLetter(DeadLetter::InvalidKey(e)),
        };
        let scope = match Scope::new(delivery.principal, Endpoint::new(METHOD, delivery.source)) {
            Ok(scope) => scope,
            Err(e) => return Settle::DeadLetter(DeadLetter::InvalidScope(e)),
        };
        let fingerprint = Fingerprint::of(&RequestParts {
            method: METHOD,
            path: delivery.source,
            query: None,
            headers: &[],
            body: delivery.payload,
        });
        let c = &self.config;
        let req = ClaimRequest::new(scope, key, fingerprint, c.lease_ttl, c.retention);
        let id = req.id();
        let store_down = |e: StoreError| {
            tracing::warn!(record = %id, error = %e, "store unavailable; the message is redelivered");
            Settle::Redeliver { after: c.retry_after, why: Redeliver::StoreUnavailable }
        };
        let (mut record, mut now) = match self.store.claim(req).await {
            Ok(ClaimOutcome::Claimed(record)) => return self.run(record, delivery.attempt, keep_alive, handler).await,
            Ok(ClaimOutcome::Existing { record, now }) => (Some(record), now),
            Err(e) => return store_down(e),
        };
        for _ in 0..DECIDE_ROUNDS {
            match decide(record.as_ref(), &fingerprint, now) {
                Decision::Replay => return Settle::Ack(Acked::AlreadyDone),
                Decision::Mismatch => return Settle::DeadLetter(DeadLetter::Mismatch),
                Decision::InFlight { retry_after_secs } => {
                    let after = Duration::from_secs(retry_after_secs).min(c.max_in_flight_wait);
                    return Settle::Redeliver { after, why: Redeliver::InFlight };
                }
                // The record expired between the claim and now: the next delivery claims it.
                Decision::Claim => return Settle::Redeliver { after: Duration::ZERO, why: Redeliver::InFlight },
                Decision::Reclaim { expected } => {
                    let req =
                        ReclaimRequest { id, expected, fingerprint, lease_ttl: c.lease_ttl, retention: c.retention };
                    match self.store.reclaim(req).await {
                        Ok(ReclaimOutcome::Reclaimed(record)) => {
                            return self.run(record, delivery.attempt, keep_alive, handler).await;
                        }
                        Ok(ReclaimOutcome::Conflict { current, now: at }) => (record, now) = (current, at),
                        Err(e) => return store_down(e),
                    }
                }
            }
        }
        Settle::Redeliver { after: c.retry_after, why: Redeliver::InFlight }
    }

    /// Runs the handler on a claimed `record` and settles it.
    async fn run<F, Fut, E, K, KFut>(&self, record: Record, attempt: u32, keep_alive: K, handler: F) -> Settle
    where
        F: FnOnce(Resumable) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: fmt::Display,
        K: Fn() -> KFut,
        KFut: Future<Output = ()>,
    {
        let (id, token, c) = (record.id, record.token, &self.config);
        let watch = Arc::new(Watch::default());
        let resumable = Resumable::new(Arc::clone(&self.store), id, token, record.created_at)
            .with_lease_watch(Arc::clone(&watch) as Arc<dyn LeaseWatch>);
        let claimed_at = Instant::now();
        let outcome = {
            let mut work = pin!(handler(resumable));
            let mut renewal = pin!(self.renew(&record, claimed_at, &watch, &keep_alive));
            tokio::select! {
                biased;
                outcome = &mut work => Some(outcome),
                () = &mut renewal => None,
            }
        };
        let Some(outcome) = outcome else {
            return Settle::Redeliver { after: c.retry_after, why: Redeliver::LeaseLost };
        };
        match outcome {
            Ok(()) => self.complete(&record, claimed_at).await,
            Err(error) => {
                tracing::info!(record = %id, token = %token, %error, attempt, "handler failed");
                // A refused or failed `fail` leaves the record in flight: the next delivery
                // after the lease takes it over, as after a crash.
                if let Err(e) = self.store.fail(id, token).await {
                    tracing::warn!(record = %id, error = %e, "marking the record failed did not apply");
                }
                if attempt >= c.max_failures {
                    Settle::DeadLetter(DeadLetter::HandlerFailed { attempts: attempt, error: error.to_string() })
                } else {
                    Settle::Redeliver { after: c.retry_after, why: Redeliver::HandlerFailed }
                }
            }
        }
    }

    /// Stores the completion, retrying a transient error while the lease lasts.
    async fn complete(&self, record: &Record, claimed_at: Instant) -> Settle {
        let (id, token, c) = (record.id, record.token, &self.config);
        let lease_end = claimed_at + c.lease_ttl;
        let mut pause = Duration::from_millis(20);
        loop {
            match self.store.complete(id, token, StoredResponse::new(200, Vec::new(), Vec::new())).await {
                Ok(_) => return Settle::Ack(Acked::Ran),
                Err(e) if e.is_lease_lost() => {
                    tracing::warn!(record = %id, token = %token, "lease lost before completing; redelivered");
                    return Settle::Redeliver { after: c.retry_after, why: Redeliver::LeaseLost };
                }
                Err(e) if Instant::now() + pause < lease_end => {
                    tracing::debug!(record = %id, error = %e, "complete failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                // The record stays in flight: the redelivery after its lease takes it over,
                // and the handler's journalled steps keep its effects from repeating.
                Err(e) => {
                    tracing::warn!(record = %id, error = %e, "complete failed until the lease ran out");
                    return Settle::Redeliver { after: c.retry_after, why: Redeliver::StoreUnavailable };
                }
            }
        }
    }

    /// Renews the lease every third of its length and calls `keep_alive` after each
    /// renewal; returns only when the lease is lost (set in `watch`).
    async fn renew<K, KFut>(&self, record: &Record, claimed_at: Instant, watch: &Watch, keep_alive: &K)
    where
        K: Fn() -> KFut,
        KFut: Future<Output = ()>,
    {
        let ttl = self.config.lease_ttl;
        let interval = ttl / 3;
        let mut lease_end = claimed_at + ttl;
        loop {
            tokio::time::sleep(interval).await;
            let sent = Instant::now();
            let limit = lease_end.saturating_duration_since(sent).max(interval);
            match tokio::time::timeout(limit, self.store.extend(record.id, record.token, ttl)).await {
                Ok(Ok(_)) => {
                    lease_end = sent + ttl;
                    keep_alive().await;
                }
                Ok(Err(e)) if e.is_lease_lost() => {
                    tracing::warn!(record = %record.id, token = %record.token, "lease lost; stopping the handler");
                    watch.0.store(true, Ordering::Release);
                    return;
                }
                // A blip: try again at the next interval. The store still extends a lease
                // that ran out until someone reclaims it, and then says so.
                Ok(Err(e)) => tracing::debug!(record = %record.id, error = %e, "lease renewal failed"),
                Err(_) => tracing::debug!(record = %record.id, "lease renewal timed out"),
            }
        }
    }
}
