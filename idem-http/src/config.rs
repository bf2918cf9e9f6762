//! The layer's settings: the types of its HTTP knobs, and [`Settings`], every value one
//! [`crate::IdempotencyLayer`] was configured with.
//!
//! `layer` (which sets them) and `pipeline` (which prepares them once per layer and reads
//! them per request) both import this module; neither imports the other's settings code.

use std::sync::Arc;
use std::time::Duration;

use idem_core::key::DEFAULT_MAX_KEY_LEN;
use idem_core::{FingerprintMode, Policy, Store};

use crate::deadline::StoreDeadlines;
use crate::principal::{BearerToken, PrincipalResolver};

/// What the layer does with a non-safe request that has no `Idempotency-Key` field.
///
/// A field that is present but empty, blank or otherwise invalid is always a 400, whatever
/// this says: a client that meant to send a key must not silently lose its protection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyRequirement {
    /// 400 with a [`crate::ProblemKind::MissingKey`] problem (default). The layer is put on
    /// routes that create or change things; a retry without a key cannot be made safe, so
    /// the safe default is to say so rather than run unprotected.
    #[default]
    Required,
    /// Run the handler without idempotency and store nothing (Stripe's behaviour). Every
    /// keyless request runs: two keyless requests are never merged into one record.
    Optional,
}

/// What the layer does with a keyed request whose principal the resolver cannot find.
///
/// Never a shared bucket: records are always scoped by a real principal, so one tenant can
/// neither replay nor block another's key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingPrincipal {
    /// 401 with a [`crate::ProblemKind::MissingPrincipal`] problem; the handler does not
    /// run (default).
    #[default]
    Reject,
    /// Run the handler without idempotency and store nothing, as for a keyless request
    /// under [`KeyRequirement::Optional`]. For APIs with anonymous endpoints that accept
    /// duplicates. Applies to "no principal" (`None`) only: a blank principal (refused by
    /// [`idem_core::Principal::new`]) is answered 401 in this mode too.
    SkipIdempotency,
}

/// Status of the answer to a fingerprint mismatch (same key, different request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MismatchStatus {
    /// 409 Conflict (default).
    #[default]
    Conflict,
    /// 422 Unprocessable Content, as draft-ietf-httpapi-idempotency-key-header §2.7 suggests.
    UnprocessableContent,
    /// 400 Bad Request.
    BadRequest,
}

impl MismatchStatus {
    /// The numeric status.
    pub(crate) fn code(self) -> u16 {
        match self {
            MismatchStatus::Conflict => 409,
            MismatchStatus::UnprocessableContent => 422,
            MismatchStatus::BadRequest => 400,
        }
    }
}

/// What the layer does when the store cannot be reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreFailureMode {
    /// Answer 503 with `Retry-After`; the handler never runs without a claim (default).
    #[default]
    FailClosed,
    /// Run the handler without idempotency protection. Only for endpoints whose handler is
    /// already safe to repeat; the layer logs every such request.
    FailOpen,
}

/// Where the handler runs once a request holds the claim (first claim or reclaim).
///
/// The choice decides what a client disconnect does to the operation. A server (hyper,
/// axum) drops a request's response future when its client goes away; whatever that
/// future owns is cancelled at its next await point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandlerExecution {
    /// The handler call, the bounded reading of its response body and the `complete` or
    /// `fail` write are work that outlives the response future (default). While the client
    /// waits, the response future polls that work in place (no task per request); if the
    /// response future is dropped before the work finished, the work moves to a task of its
    /// own (`tokio::spawn` on the runtime current when the request was claimed) and runs
    /// to its end there.
    ///
    /// A client that disconnects takes nothing with it: the work finishes, its outcome is
    /// stored, and the client's retry gets 409 `in-flight` while it runs, then the replay.
    /// The handler runs once. This is the right mode for infrastructure APIs, whose
    /// handlers allocate things (a node, a lease, a VM) in steps that a cancellation can cut
    /// in half.
    ///
    /// A handler panic still marks the record failed (inside the work) and is then
    /// re-raised from the response future, if that is still alive. If the runtime shuts
    /// down before a moved task finished, the record is marked failed when the runtime can
    /// still run the write, or frees itself when its lease ends.
    ///
    /// Do not rely on task-locals (`tokio::task_local!`) in the handler: they are visible
    /// while the work is polled in place and gone once it moved to its own task. The current
    /// tracing span is carried over. Outside a tokio runtime the handler runs inline.
    #[default]
    Detached,
    /// The handler runs inside the response future, as a plain tower middleware would run
    /// it: when the client disconnects, the handler is cancelled at its next await point
    /// and the record is marked failed, so a retry runs the handler again.
    ///
    /// Only safe when a cancelled handler leaves nothing behind: its side effects are
    /// transactional with its response, or keyed downstream by a sub-key from
    /// [`crate::IdempotencyContext`]. Work that outlives the cancelled future (a
    /// `spawn_blocking` transaction, a downstream call already sent, a spawned task)
    /// completes, and the retry does it again. For handlers that must be cancellable, or
    /// that rely on task-locals.
    Inline,
}

/// How often the layer renews the lease of a claimed request while its handler runs.
///
/// A renewal is a fenced [`idem_core::Store::extend`]: it moves the lease to the store's
/// `now` + the lease TTL, and only while this attempt still holds the claim. It runs
/// inside the request's own work (the handler's future and the renewal timer are polled
/// together), so it starts when the handler starts and stops when the handler ends, is
/// cancelled with it, or panics; no task is spawned for it.
///
/// With renewal, the lease TTL no longer has to cover the longest handler: a lease of
/// seconds keeps a 30-minute firmware flash claimed as long as its process is alive, and
/// a killed process stops renewing, so a retry reclaims its record within one lease.
///
/// A renewal the store refuses with `LeaseLost` (a retry reclaimed the record after the
/// lease ran out, or the record is gone) stops renewing, flips the handler's
/// [`crate::IdempotencyContext::is_lease_lost`], resolves
/// [`crate::IdempotencyContext::lease_lost`], makes further [`crate::Resumable`] steps
/// refuse with [`idem_core::StepError::LeaseLost`], and logs a warning; the response is
/// still returned to the client, and the store refuses to store it (the newer attempt owns
/// the record). A renewal that fails transiently (`StoreError::is_retryable`) is retried
/// with a short backoff (25 ms, doubling, at most 1 s) while the lease still has time,
/// then once per interval; so is one the store reports unavailable without retry (a full
/// disk, an I/O error: the store may recover while the handler runs on). A renewal that
/// fails for good (the store cannot extend: `Unsupported`, `Corrupt`) stops renewing and
/// logs an error; the lease then runs out as without renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseRenewal {
    /// Never renew: the lease TTL must outlast the slowest handler, or a retry that
    /// arrives after it runs the handler a second time while the first still runs.
    Off,
    /// Renew this long after the claim and after each successful renewal. Intervals
    /// under 10 ms are taken as 10 ms. An interval at or above the lease TTL lets the lease
    /// run out between two renewals; keep it well below (a third of the lease leaves room
    /// for two failed renewals).
    Every(Duration),
    /// Renew every lease TTL / n (default n = 3, so two renewals in a row may fail
    /// transiently before the lease runs out). n below 2 is taken as 2: renewing only as
    /// the lease ends would lose it to any retry that arrives first.
    Fraction(u32),
}

impl Default for LeaseRenewal {
    fn default() -> Self {
        LeaseRenewal::Fraction(3)
    }
}

impl LeaseRenewal {
    /// The shortest renewal interval: a shorter one would keep the store busy without
    /// making the lease any safer.
    pub const MIN_INTERVAL: Duration = Duration::from_millis(10);

    /// The renewal interval for a lease of `lease_ttl`, or `None` when nothing renews:
    /// [`LeaseRenewal::Off`], or a zero lease, which no renewal can keep fresh.
    pub(crate) fn interval(self, lease_ttl: Duration) -> Option<Duration> {
        if lease_ttl.is_zero() {
            return None;
        }
        match self {
            LeaseRenewal::Off => None,
            LeaseRenewal::Every(every) => Some(every.max(Self::MIN_INTERVAL)),
            LeaseRenewal::Fraction(n) => Some((lease_ttl / n.max(2)).max(Self::MIN_INTERVAL)),
        }
    }
}

/// The default largest `Retry-After` on an in-flight 409: a short poll, so a client whose
/// request is still running hears about its outcome seconds after it is stored, instead of
/// sleeping out a lease that renewal may keep extending for half an hour.
pub(crate) const DEFAULT_IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(2);

/// Default most header fields that enter the fingerprint (all values of every configured
/// name together).
pub(crate) const DEFAULT_MAX_FINGERPRINT_FIELDS: usize = 32;
/// Default most bytes (names plus values) of the header fields that enter the fingerprint.
pub(crate) const DEFAULT_MAX_FINGERPRINT_HEADER_BYTES: usize = 16 * 1024;

/// An application callback (a key rule, an event callback, a replay edit), shown as its
/// type's name only in `Debug`.
pub(crate) struct Callback<F: ?Sized>(pub(crate) Arc<F>);

impl<F: ?Sized> Clone for Callback<F> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<F: ?Sized> std::fmt::Debug for Callback<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Callback(..)")
    }
}

/// `Err(detail)` refuses a key (`IdempotencyLayer::with_key_rule`).
pub(crate) type KeyRule = Callback<dyn Fn(&str) -> Result<(), String> + Send + Sync>;
/// Edits replayed heads (`IdempotencyLayer::with_replay_edit`).
pub(crate) type ReplayEdit = Callback<dyn Fn(&mut http::response::Parts) + Send + Sync>;
/// Hears every step (`IdempotencyLayer::with_events`).
pub(crate) type Events = Callback<crate::observe::EventFn>;

/// Everything one layer was configured with; [`crate::pipeline::Pipeline`] is made from it
/// once per layer.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn Store>,
    /// The record rules.
    pub(crate) policy: Policy,
    pub(crate) resolver: Arc<dyn PrincipalResolver>,
    pub(crate) key_requirement: KeyRequirement,
    /// Longest accepted key, bytes.
    pub(crate) max_key_len: usize,
    pub(crate) key_rule: Option<KeyRule>,
    pub(crate) key_source: crate::KeySource,
    /// What of the body enters the fingerprint.
    pub(crate) fingerprint_body: crate::FingerprintBody,
    /// The application's event callback.
    pub(crate) events: Option<Events>,
    /// Edits the head of every replayed response.
    pub(crate) replay_edit: Option<ReplayEdit>,
    pub(crate) missing_principal: MissingPrincipal,
    /// Largest request body buffered to fingerprint, bytes.
    pub(crate) max_request_body: usize,
    /// Request headers (lower-case) that enter the fingerprint.
    pub(crate) fingerprint_headers: Vec<String>,
    /// Most header fields that may enter the fingerprint.
    pub(crate) max_fingerprint_fields: usize,
    /// Most bytes (names plus values) of the header fields that enter the fingerprint.
    pub(crate) max_fingerprint_header_bytes: usize,
    pub(crate) fingerprint_mode: FingerprintMode,
    pub(crate) mismatch_status: MismatchStatus,
    pub(crate) store_failure_mode: StoreFailureMode,
    pub(crate) handler_execution: HandlerExecution,
    pub(crate) lease_renewal: LeaseRenewal,
    /// Largest `Retry-After` on an in-flight 409.
    pub(crate) in_flight_retry_after: Duration,
    /// How long a duplicate of an in-flight request waits for its outcome; `None`: 409 at once.
    pub(crate) in_flight_wait: Option<Duration>,
    /// When a response the layer may store is streamed instead of buffered.
    pub(crate) streaming: crate::streaming::Streaming,
    /// Retry hint headers on the layer's own answers.
    pub(crate) retry_hints: crate::hints::RetryHints,
    /// Per-operation store deadlines and the completion retry rule.
    pub(crate) store_deadlines: StoreDeadlines,
    /// Keys that seal stored responses, and whether plain ones are still replayed.
    #[cfg(feature = "seal")]
    pub(crate) sealing: Option<idem_core::seal::Sealing>,
}

impl Settings {
    /// The defaults over `store` (listed on [`crate::IdempotencyLayer`]).
    pub(crate) fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            policy: Policy::default(),
            resolver: Arc::new(BearerToken),
            key_requirement: KeyRequirement::default(),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            key_rule: None,
            key_source: crate::KeySource::default(),
            fingerprint_body: crate::FingerprintBody::default(),
            events: None,
            replay_edit: None,
            missing_principal: MissingPrincipal::default(),
            max_request_body: 1 << 20,
            fingerprint_headers: vec!["content-type".into()],
            max_fingerprint_fields: DEFAULT_MAX_FINGERPRINT_FIELDS,
            max_fingerprint_header_bytes: DEFAULT_MAX_FINGERPRINT_HEADER_BYTES,
            fingerprint_mode: FingerprintMode::default(),
            mismatch_status: MismatchStatus::default(),
            store_failure_mode: StoreFailureMode::default(),
            handler_execution: HandlerExecution::default(),
            lease_renewal: LeaseRenewal::default(),
            in_flight_retry_after: DEFAULT_IN_FLIGHT_RETRY_AFTER,
            in_flight_wait: None,
            streaming: crate::streaming::Streaming::default(),
            retry_hints: crate::hints::RetryHints::default(),
            store_deadlines: StoreDeadlines::default(),
            #[cfg(feature = "seal")]
            sealing: None,
        }
    }
}
