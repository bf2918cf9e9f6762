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

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt as _;
use idem_core::key::DEFAULT_MAX_KEY_LEN;
use idem_core::{
    ClaimOutcome, ClaimRequest, Decision, Endpoint, FencingToken, Fingerprint, IdempotencyKey, KeyError, LeaseWatch,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, RequestParts, Resumable, Scope, ScopeError, Store,
    StoreError, StoredResponse, decide,
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
    subject: Option<&'a str>,
    payload: &'a [u8],
    attempt: u32,
}

impl<'a> Delivery<'a> {
    /// A message from `source` (the stream or queue: the endpoint half of the scope), sent
    /// by `principal` (the tenant or producer the consumer trusts it to come from), with
    /// idempotency key `key` (a header or field; `None` when the message has none) and
    /// `payload` (fingerprinted byte for byte).
    ///
    /// The key is taken as it is: visible ASCII (0x21-0x7E), 1 to 255 bytes. Unlike an
    /// HTTP header value it is neither trimmed nor unquoted, so ` job-1` and `"job-1"` are
    /// refused rather than folded into `job-1`.
    #[must_use]
    pub fn new(source: &'a str, principal: &'a str, key: Option<&'a [u8]>, payload: &'a [u8]) -> Self {
        Self { source, principal, key, subject: None, payload, attempt: 1 }
    }

    /// The subject or routing key the message was published to, fingerprinted with the
    /// payload: the same key on `jobs.create` and on `jobs.delete` is a mismatch, not a
    /// replay.
    #[must_use]
    pub fn with_subject(mut self, subject: &'a str) -> Self {
        self.subject = Some(subject);
        self
    }

    /// The broker's count of deliveries of this message, this one included (JetStream's
    /// `delivered`, RabbitMQ's `x-delivery-count`); 1 when unknown. Used to count handler
    /// failures only on a store without a journal ([`Config::with_max_failures`]).
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
    /// The handler returned an error or panicked. The record is marked failed, and the
    /// next delivery takes it over and runs the handler again (if the store refused the
    /// mark, after the lease runs out).
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
    /// The handler failed `failures` times for this key ([`Config::with_max_failures`]).
    #[error("the handler failed {failures} times; last error: {error}")]
    HandlerFailed {
        /// The failures counted.
        failures: u32,
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
    store_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            retry_after: Duration::from_secs(1),
            max_in_flight_wait: Duration::from_secs(30),
            max_failures: 5,
            store_timeout: Duration::from_secs(5),
        }
    }
}

impl Config {
    /// The delay before a delivery whose handler failed, or whose store was down, comes back.
    #[must_use]
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// How long a claim holds the key without renewal (default 30 s). The engine renews it
    /// every third of this while the handler runs, and a consumer that dies leaves the key
    /// to the next delivery after at most this long.
    #[must_use]
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        // Bounded above so that instants computed from it cannot overflow.
        self.lease_ttl = ttl.clamp(Duration::from_millis(30), Duration::from_secs(366 * 24 * 3600));
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

    /// After how many handler failures of one key its message is dead-lettered instead of
    /// redelivered (default 5). The failures are counted in the record's journal, so
    /// redeliveries for other reasons (a key in flight, a store outage) do not count; on a
    /// store without a journal the broker's delivery count stands in
    /// ([`Delivery::with_attempt`]). A later delivery of a key that reached the limit is
    /// dead-lettered without running.
    #[must_use]
    pub fn with_max_failures(mut self, failures: u32) -> Self {
        self.max_failures = failures.max(1);
        self
    }

    /// How long one store call may take before it counts as a store outage (default 5 s):
    /// before the claim the message is redelivered, after the handler the completion is
    /// retried while the lease lasts.
    #[must_use]
    pub fn with_store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
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

/// The journal entry counting a key's handler failures: `"{count}\n{last error}"`.
const FAILURES: &str = "idem-consumer:failures";
/// The longest error text kept in the journal and in a dead letter.
const MAX_ERROR_LEN: usize = 1024;

/// Parses a message's key as given: no trimming, no unquoting (see [`Delivery::new`]).
fn message_key(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
    if raw.is_empty() {
        return Err(KeyError::Empty);
    }
    if raw.len() > DEFAULT_MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: raw.len(), max: DEFAULT_MAX_KEY_LEN });
    }
    if let Some(offset) = raw.iter().position(|b| !(0x21..=0x7E).contains(b)) {
        return Err(KeyError::InvalidByte { byte: raw[offset], offset });
    }
    if raw[0] == b'"' {
        return Err(KeyError::MalformedString);
    }
    // Visible ASCII, checked above, is valid UTF-8.
    std::str::from_utf8(raw).ok().and_then(IdempotencyKey::from_stored).ok_or(KeyError::MalformedString)
}

/// `text` cut to at most `MAX_ERROR_LEN` bytes, on a character boundary.
fn bounded(mut text: String) -> String {
    if text.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    let what =
        panic.downcast_ref::<&str>().map(|s| (*s).to_owned()).or_else(|| panic.downcast_ref::<String>().cloned());
    format!("the handler panicked: {}", what.as_deref().unwrap_or("(no message)"))
}

/// Marks the record failed if the attempt is dropped before it settled (a shutdown that
/// stops `process` mid-handler), so the next delivery need not wait out the lease.
struct FailOnDrop {
    store: Arc<dyn Store>,
    id: RecordId,
    token: FencingToken,
    armed: bool,
}

impl Drop for FailOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, id, token) = (Arc::clone(&self.store), self.id, self.token);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { drop(store.fail(id, token).await) });
        }
    }
}

impl Consumer {
    /// An engine on `store`.
    #[must_use]
    pub fn new(store: Arc<dyn Store>, config: Config) -> Self {
        Self { store, config }
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A store call under the store timeout; a timeout is a retryable outage.
    async fn call<T>(
        &self,
        what: &'static str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.config.store_timeout, call).await {
            Ok(result) => result,
            Err(_) => {
                Err(StoreError::unavailable("idem-consumer", format!("{what}: no answer in time"), true, "timed out"))
            }
        }
    }

    /// Processes one delivery: never runs `handler` without holding the key's claim, and
    /// never for a key already completed.
    ///
    /// - A new key (or a failed one, or one whose lease ran out): claims it and runs
    ///   `handler` with a [`Resumable`] for its side effects (steps and intents keyed by
    ///   sub-keys, so a run after a crash converges instead of repeating them). While it
    ///   runs, and while its completion is written, the lease is renewed every third of
    ///   its length and `keep_alive` is called after each renewal (JetStream's
    ///   `in_progress`, keeping the broker's ack deadline in step). `Ok` completes the
    ///   record ([`Settle::Ack`]); `Err` or a panic marks it failed
    ///   ([`Redeliver::HandlerFailed`], or [`DeadLetter::HandlerFailed`] at the limit).
    /// - A completed key with the same payload: [`Acked::AlreadyDone`], handler not run.
    /// - A key in flight elsewhere: [`Redeliver::InFlight`] after the time left on its
    ///   lease, in whole seconds, at least 1 s and at most `max_in_flight_wait`.
    /// - A key first used with another payload (or subject), or no valid key:
    ///   [`Settle::DeadLetter`].
    /// - A store error or timeout before the claim: [`Redeliver::StoreUnavailable`];
    ///   nothing ran.
    ///
    /// If the lease is lost while the handler runs (a renewal refused, or no renewal got
    /// through before the lease ran out, so another delivery may take the key over), the
    /// handler is dropped at its next await point and the message redelivered: the new
    /// owner's result stands. If this future is dropped mid-handler, the record is marked
    /// failed in the background.
    pub async fn process<F, Fut, E, K, KFut>(&self, delivery: Delivery<'_>, keep_alive: K, handler: F) -> Settle
    where
        F: FnOnce(Resumable) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: fmt::Display,
        K: Fn() -> KFut,
        KFut: Future<Output = ()>,
    {
        let Some(raw_key) = delivery.key else { return Settle::DeadLetter(DeadLetter::MissingKey) };
        let key = match message_key(raw_key) {
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
            query: delivery.subject,
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
        // The lease is counted from before the call: the store's clock started it no later.
        let sent = Instant::now();
        let (mut record, mut now) = match self.call("claim", self.store.claim(req)).await {
            Ok(ClaimOutcome::Claimed(record)) => {
                return self.run(record, sent, delivery.attempt, keep_alive, handler).await;
            }
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
                    if record.as_ref().is_some_and(|r| r.state == RecordState::Failed) {
                        match self.failures(id).await {
                            Ok(Some((failures, error))) if failures >= c.max_failures => {
                                return Settle::DeadLetter(DeadLetter::HandlerFailed { failures, error });
                            }
                            Ok(_) => {}
                            Err(e) => return store_down(e),
                        }
                    }
                    let req =
                        ReclaimRequest { id, expected, fingerprint, lease_ttl: c.lease_ttl, retention: c.retention };
                    let sent = Instant::now();
                    match self.call("reclaim", self.store.reclaim(req)).await {
                        Ok(ReclaimOutcome::Reclaimed(record)) => {
                            return self.run(record, sent, delivery.attempt, keep_alive, handler).await;
                        }
                        Ok(ReclaimOutcome::Conflict { current, now: at }) => (record, now) = (current, at),
                        Err(e) => return store_down(e),
                    }
                }
            }
        }
        Settle::Redeliver { after: c.retry_after, why: Redeliver::InFlight }
    }

    /// The key's failure count and last error from its journal; `None` when none was
    /// counted (or the store has no journal).
    async fn failures(&self, id: RecordId) -> Result<Option<(u32, String)>, StoreError> {
        if !self.store.capabilities().journal {
            return Ok(None);
        }
        let Some(bytes) = self.call("journal_get", self.store.journal_get(id, FAILURES)).await? else {
            return Ok(None);
        };
        let text = String::from_utf8_lossy(&bytes);
        let (count, error) = text.split_once('\n').unwrap_or((&text, ""));
        Ok(count.parse().ok().map(|n| (n, error.to_owned())))
    }

    /// Runs the handler on a claimed `record` and settles it.
    async fn run<F, Fut, E, K, KFut>(
        &self,
        record: Record,
        claimed_at: Instant,
        attempt: u32,
        keep_alive: K,
        handler: F,
    ) -> Settle
    where
        F: FnOnce(Resumable) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: fmt::Display,
        K: Fn() -> KFut,
        KFut: Future<Output = ()>,
    {
        let (id, token) = (record.id, record.token);
        let mut guard = FailOnDrop { store: Arc::clone(&self.store), id, token, armed: true };
        let watch = Arc::new(Watch::default());
        let resumable = Resumable::new(Arc::clone(&self.store), id, token, record.created_at)
            .with_lease_watch(Arc::clone(&watch) as Arc<dyn LeaseWatch>);
        // Milliseconds from `claimed_at` to the lease's end as the last renewal left it.
        let lease_end = AtomicU64::new(u64::try_from(self.config.lease_ttl.as_millis()).unwrap_or(u64::MAX));
        let settle = {
            let attempt_done = async {
                let outcome = AssertUnwindSafe(handler(resumable)).catch_unwind().await;
                match outcome {
                    Ok(Ok(())) => self.complete(id, token, claimed_at, &lease_end).await,
                    Ok(Err(error)) => self.failed(id, token, attempt, bounded(error.to_string())).await,
                    Err(panic) => self.failed(id, token, attempt, bounded(panic_message(panic.as_ref()))).await,
                }
            };
            let mut attempt_done = pin!(attempt_done);
            let mut renewal = pin!(self.renew(id, token, claimed_at, &lease_end, &watch, &keep_alive));
            tokio::select! {
                biased;
                settle = &mut attempt_done => settle,
                () = &mut renewal => Settle::Redeliver { after: self.config.retry_after, why: Redeliver::LeaseLost },
            }
        };
        guard.armed = false;
        settle
    }

    /// Counts the failure in the journal, marks the record failed, and says whether the
    /// message goes back or to the dead letters.
    async fn failed(&self, id: RecordId, token: FencingToken, attempt: u32, error: String) -> Settle {
        let c = &self.config;
        tracing::info!(record = %id, token = %token, %error, "handler failed");
        let lost = || Settle::Redeliver { after: c.retry_after, why: Redeliver::LeaseLost };
        let journal = self.store.capabilities().journal;
        // Without a journal, or when it cannot be read, the broker's delivery count stands in
        // (and nothing is written over a count that could not be read).
        let failures = match self.failures(id).await {
            Ok(Some((n, _))) => Some(n.saturating_add(1)),
            Ok(None) if journal => Some(1),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(record = %id, error = %e, "reading the failure count failed");
                None
            }
        };
        if let Some(n) = failures {
            let entry = format!("{n}\n{error}").into_bytes();
            match self.call("journal_put", self.store.journal_put(id, token, FAILURES, entry, true)).await {
                // Another delivery owns the key: this failure is not the handler's verdict on
                // it (a step refused for the lost lease ends the handler with an error too).
                Err(e) if e.is_lease_lost() => return lost(),
                Err(e) => tracing::warn!(record = %id, error = %e, "counting the failure did not apply"),
                Ok(_) => {}
            }
        }
        let failures = failures.unwrap_or(attempt);
        // A failed `fail` leaves the record in flight: the next delivery after the lease
        // takes it over, as after a crash.
        match self.call("fail", self.store.fail(id, token)).await {
            Err(e) if e.is_lease_lost() => return lost(),
            Err(e) => tracing::warn!(record = %id, error = %e, "marking the record failed did not apply"),
            Ok(_) => {}
        }
        if failures >= c.max_failures {
            Settle::DeadLetter(DeadLetter::HandlerFailed { failures, error })
        } else {
            Settle::Redeliver { after: c.retry_after, why: Redeliver::HandlerFailed }
        }
    }

    /// Stores the completion, retrying a transient error while the lease lasts (the
    /// renewal goes on meanwhile and moves `lease_end`).
    async fn complete(&self, id: RecordId, token: FencingToken, claimed_at: Instant, lease_end: &AtomicU64) -> Settle {
        let c = &self.config;
        let mut pause = Duration::from_millis(20);
        loop {
            let done = self.store.complete(id, token, StoredResponse::new(200, Vec::new(), Vec::new()));
            match self.call("complete", done).await {
                Ok(_) => return Settle::Ack(Acked::Ran),
                Err(e) if e.is_lease_lost() => {
                    tracing::warn!(record = %id, token = %token, "lease lost before completing; redelivered");
                    return Settle::Redeliver { after: c.retry_after, why: Redeliver::LeaseLost };
                }
                Err(e)
                    if Instant::now() + pause
                        < claimed_at + Duration::from_millis(lease_end.load(Ordering::Acquire)) =>
                {
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
    /// renewal; returns only when the lease is lost (set in `watch`): a renewal refused,
    /// or the lease's end reached with no renewal through, after which another delivery
    /// may take the key over.
    async fn renew<K, KFut>(
        &self,
        id: RecordId,
        token: FencingToken,
        claimed_at: Instant,
        lease_end: &AtomicU64,
        watch: &Watch,
        keep_alive: &K,
    ) where
        K: Fn() -> KFut,
        KFut: Future<Output = ()>,
    {
        let ttl = self.config.lease_ttl;
        let interval = ttl / 3;
        loop {
            tokio::time::sleep(interval).await;
            let sent = Instant::now();
            let end = claimed_at + Duration::from_millis(lease_end.load(Ordering::Acquire));
            if sent >= end {
                tracing::warn!(record = %id, token = %token, "no renewal got through before the lease ran out");
                break;
            }
            match tokio::time::timeout(end - sent, self.store.extend(id, token, ttl)).await {
                Ok(Ok(_)) => {
                    let end = (sent - claimed_at) + ttl;
                    lease_end.store(u64::try_from(end.as_millis()).unwrap_or(u64::MAX), Ordering::Release);
                    // A stalled broker must not hold up the next renewal or the lease check.
                    let _ = tokio::time::timeout(interval, keep_alive()).await;
                }
                Ok(Err(e)) if e.is_lease_lost() => {
                    tracing::warn!(record = %id, token = %token, "lease lost; stopping the handler");
                    break;
                }
                // A blip: the next interval tries again, until the lease's end.
                Ok(Err(e)) => tracing::debug!(record = %id, error = %e, "lease renewal failed"),
                Err(_) => tracing::debug!(record = %id, "lease renewal timed out"),
            }
        }
        watch.0.store(true, Ordering::Release);
    }
}
