//! [`IdempotencyLayer`]: every setting of the layer, and the tower [`Layer`] that wraps a
//! service in [`Idempotency`].
//!
//! The settings are prepared into a [`Pipeline`] (the store wrapped in its deadlines,
//! completion retries, sealing and metrics; header names parsed; intervals computed) once
//! per layer: on the first `layer` call, and shared by every service made from this layer
//! or its clones after that. A setter starts a new preparation, since the retry window
//! follows the lease TTL, whichever was set last.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::{FingerprintMode, Policy, Store};
use tower::Layer;

use crate::config::{
    HandlerExecution, KeyRequirement, LeaseRenewal, MismatchStatus, MissingPrincipal, Settings, StoreFailureMode,
};
use crate::deadline::StoreDeadlines;
use crate::hints::RetryHints;
use crate::observe::Event;
use crate::pipeline::Pipeline;
use crate::principal::PrincipalResolver;
use crate::select::{FingerprintBody, KeySource};
use crate::service::Idempotency;

/// Tower layer that makes the wrapped service idempotent per `Idempotency-Key`.
///
/// The record rules (retention, lease TTL, cacheable statuses, what a stored response
/// keeps) are one [`Policy`] value, set with [`IdempotencyLayer::with_policy`] (its fields
/// list their defaults). Every other setting decides how requests are read and answered,
/// one `with_*` method each:
///
/// | setting | default |
/// |---|---|
/// | [`with_policy`](Self::with_policy) | [`Policy::default`] |
/// | [`with_key_requirement`](Self::with_key_requirement) | [`KeyRequirement::Required`] |
/// | [`with_max_key_len`](Self::with_max_key_len) | 255 bytes |
/// | [`with_key_rule`](Self::with_key_rule) | none: the header syntax only |
/// | [`with_key_source`](Self::with_key_source) | the `Idempotency-Key` header field |
/// | [`with_principal_resolver`](Self::with_principal_resolver) | [`crate::BearerToken`] |
/// | [`with_missing_principal`](Self::with_missing_principal) | [`MissingPrincipal::Reject`] |
/// | [`with_max_request_body`](Self::with_max_request_body) | 1 MiB (1 048 576 bytes) |
/// | [`with_fingerprint_headers`](Self::with_fingerprint_headers) | `content-type` |
/// | [`with_max_fingerprint_headers`](Self::with_max_fingerprint_headers) | 32 fields, 16 KiB (16 384 bytes) |
/// | [`with_fingerprint_mode`](Self::with_fingerprint_mode) | [`FingerprintMode::Raw`] |
/// | [`with_fingerprint_body`](Self::with_fingerprint_body) | the whole body |
/// | [`with_mismatch_status`](Self::with_mismatch_status) | [`MismatchStatus::Conflict`] (409) |
/// | [`with_store_failure_mode`](Self::with_store_failure_mode) | [`StoreFailureMode::FailClosed`] |
/// | [`with_handler_execution`](Self::with_handler_execution) | [`HandlerExecution::Detached`] |
/// | [`with_lease_renewal`](Self::with_lease_renewal) | [`LeaseRenewal::Fraction`]`(3)`: every lease TTL / 3 |
/// | [`with_in_flight_retry_after`](Self::with_in_flight_retry_after) | 2 s |
/// | [`with_in_flight_wait`](Self::with_in_flight_wait) | `None`: a duplicate of a running request gets 409 at once |
/// | [`with_buffer_deadline`](Self::with_buffer_deadline) | 500 ms |
/// | [`with_streaming_content_types`](Self::with_streaming_content_types) | `text/event-stream` |
/// | [`with_retry_hints`](Self::with_retry_hints) | `x-should-retry` on, `Stripe-Should-Retry` off |
/// | [`with_store_deadlines`](Self::with_store_deadlines) | 2 s per store call; completions retried while the lease lasts |
/// | [`with_events`](Self::with_events), [`with_replay_edit`](Self::with_replay_edit) | none |
/// | `with_sealing` (feature `seal`) | off: responses stored as they are |
///
/// Cloning is cheap (two `Arc`s); clones share the prepared pipeline.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idem_core::MemoryStore;
/// use idem_http::{IdempotencyLayer, KeyRequirement, MismatchStatus, Policy};
///
/// let mut policy = Policy::default();
/// policy.retention = Duration::from_secs(7 * 86_400);
/// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()))
///     .with_policy(policy)
///     .with_key_requirement(KeyRequirement::Optional)
///     .with_mismatch_status(MismatchStatus::UnprocessableContent);
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    config: Arc<Settings>,
    /// The pipeline prepared from `config`, once, by the first `layer` call of this layer
    /// or of any clone made before a setter ran.
    prepared: Arc<OnceLock<Arc<Pipeline>>>,
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults above.
    #[must_use]
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self { config: Arc::new(Settings::new(store)), prepared: Arc::default() }
    }

    /// The settings, to change one of them. Copies them first if a clone of this layer
    /// still shares them, and drops the prepared pipeline: services made before keep the
    /// one they were made with.
    fn config(&mut self) -> &mut Settings {
        self.prepared = Arc::default();
        Arc::make_mut(&mut self.config)
    }

    idem_core::setters! {
        /// Sets the record rules (retention, lease TTL, uncacheable statuses, stored body
        /// limit, compression threshold, header deny list), all at once. The lease TTL bounds
        /// how long a dead holder blocks its key; while the handler runs, the layer renews it
        /// ([`Self::with_lease_renewal`]), so seconds are enough: `docs/contract.md#lease-ttl`.
        #[must_use]
        pub fn with_policy(policy: Policy) => config().policy = policy;

        /// Sets what happens to non-safe requests without a key (default
        /// [`KeyRequirement::Required`]).
        #[must_use]
        pub fn with_key_requirement(requirement: KeyRequirement) => config().key_requirement = requirement;

        /// Sets the longest accepted idempotency key, bytes after unquoting (default 255).
        /// A longer key is a 400 `invalid-idempotency-key`.
        #[must_use]
        pub fn with_max_key_len(bytes: usize) => config().max_key_len = bytes;

        /// Adds the API's own rule for keys (a minimum length, an alphabet), checked on
        /// the parsed key after the built-in syntax and before the principal or any store
        /// call: `Err(detail)` is a 400 `invalid-idempotency-key` with that detail.
        /// `docs/contract.md#key-rules-of-your-own`.
        #[must_use]
        pub fn with_key_rule(rule: impl Fn(&str) -> Result<(), String> + Send + Sync + 'static) =>
            config().key_rule = Some(crate::config::Callback(Arc::new(rule)));

        /// Sets where the key is read (default: the `Idempotency-Key` header field); a
        /// body field or a function of the request: [`KeySource`],
        /// `docs/contract.md#where-the-key-comes-from`.
        #[must_use]
        pub fn with_key_source(source: KeySource) => config().key_source = source;

        /// Sets what of the body enters the fingerprint (default: all of it): a function of
        /// the request, or (feature `canonical-json`) chosen JSON fields: [`FingerprintBody`].
        #[must_use]
        pub fn with_fingerprint_body(body: FingerprintBody) => config().fingerprint_body = body;

        /// Calls `callback` with every decision and every attempt's end ([`Event`]), on the
        /// request's task, before the answer is sent: keep it short and non-blocking (a
        /// counter, a channel send). The same facts as the span's fields, without a tracing
        /// subscriber. `docs/contract.md#lifecycle-events`.
        #[must_use]
        pub fn with_events(callback: impl Fn(&Event<'_>) + Send + Sync + 'static) =>
            config().events = Some(crate::config::Callback(Arc::new(callback)));

        /// Lets the application edit the head (status, header fields) of every replayed
        /// response before it is sent, after the layer set `Idempotent-Replayed` and
        /// `Idempotency-Key-Expires`; the stored record and body are not changed.
        /// `docs/contract.md#lifecycle-events`.
        #[must_use]
        pub fn with_replay_edit(edit: impl Fn(&mut http::response::Parts) + Send + Sync + 'static) =>
            config().replay_edit = Some(crate::config::Callback(Arc::new(edit)));

        /// Replaces the principal resolver (default [`crate::BearerToken`]).
        #[must_use]
        pub fn with_principal_resolver(resolver: impl PrincipalResolver) => config().resolver = Arc::new(resolver);

        /// Sets what happens to keyed requests without a principal (default
        /// [`MissingPrincipal::Reject`]).
        #[must_use]
        pub fn with_missing_principal(rule: MissingPrincipal) => config().missing_principal = rule;

        /// Sets the largest request body the layer buffers to fingerprint, bytes (default
        /// 1 MiB). A larger request gets 413 `body-too-large` and claims nothing.
        #[must_use]
        pub fn with_max_request_body(bytes: usize) => config().max_request_body = bytes;
    }

    /// Sets the request headers whose values enter the fingerprint (default
    /// `content-type`). Names are lower-cased. A retry that changes one of them is a
    /// mismatch.
    #[must_use]
    pub fn with_fingerprint_headers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, names: I) -> Self {
        self.config().fingerprint_headers = names.into_iter().map(|s| s.into().to_ascii_lowercase()).collect();
        self
    }

    /// Sets the most header fields (`fields`, default 32) and the most bytes of names plus
    /// values (`bytes`, default 16 KiB = 16 384 bytes) of the request's
    /// [fingerprint headers](Self::with_fingerprint_headers), all values of every
    /// configured name counted. A request over either gets 431 `headers-too-large`
    /// (RFC 6585 §5) and claims nothing: a client cannot make the layer hash an unbounded
    /// header set. The HTTP server's own header limits apply before this layer.
    #[must_use]
    pub fn with_max_fingerprint_headers(mut self, fields: usize, bytes: usize) -> Self {
        let config = self.config();
        config.max_fingerprint_fields = fields;
        config.max_fingerprint_header_bytes = bytes;
        self
    }

    idem_core::setters! {
        /// Sets how the body enters the fingerprint (default [`FingerprintMode::Raw`], the raw
        /// bytes; `FingerprintMode::CanonicalJson`, feature `canonical-json`, is opt-in because
        /// it can merge requests an API treats as different).
        #[must_use]
        pub fn with_fingerprint_mode(mode: FingerprintMode) => config().fingerprint_mode = mode;

        /// Sets the status of the answer to a fingerprint mismatch (default
        /// [`MismatchStatus::Conflict`], 409).
        #[must_use]
        pub fn with_mismatch_status(status: MismatchStatus) => config().mismatch_status = status;

        /// Sets what happens when the store cannot be reached (default
        /// [`StoreFailureMode::FailClosed`]: 503, the handler does not run).
        #[must_use]
        pub fn with_store_failure_mode(mode: StoreFailureMode) => config().store_failure_mode = mode;

        /// Sets where a claimed request's handler runs (default [`HandlerExecution::Detached`]:
        /// a client disconnect does not cancel it half-way).
        #[must_use]
        pub fn with_handler_execution(execution: HandlerExecution) => config().handler_execution = execution;

        /// Sets how often the lease of a running handler is renewed (default
        /// [`LeaseRenewal::Fraction`]`(3)`, every lease TTL / 3). [`LeaseRenewal::Off`] renews
        /// nothing and costs nothing per request. Renewal times itself with tokio's timer: the
        /// runtime must have time enabled (`#[tokio::main]` and `Builder::enable_all` do);
        /// outside a tokio runtime nothing is renewed.
        #[must_use]
        pub fn with_lease_renewal(renewal: LeaseRenewal) => config().lease_renewal = renewal;

        /// Sets the largest `Retry-After` of an in-flight 409 (default 2 s). The answer is the
        /// remaining lease clamped to [1 s, `cap`], in whole seconds (`cap` is rounded down, at
        /// least 1 s): a short poll interval. A long cap makes clients sleep through the moment
        /// the response is stored; under renewal the lease end says nothing about when that is.
        #[must_use]
        pub fn with_in_flight_retry_after(cap: Duration) => config().in_flight_retry_after = cap;

        /// Lets a duplicate of an in-flight request wait up to `limit` for the first attempt's
        /// outcome (default `None`: it gets 409 `in-flight` at once). While it waits, the layer
        /// reads the record again after short pauses (20 ms, doubling, at most 500 ms), holding
        /// no store connection, lock or claim in between; it answers as soon as the record
        /// completed (the replay), failed or lost its lease (the duplicate reclaims it and runs
        /// the handler, as any retry would), and with the usual 409 when `limit` has passed.
        /// A store with wake-ups ([`idem_core::Store::settlements`]: memory, redb, SQLite,
        /// Redis, PostgreSQL with `LISTEN` on) ends a pause when the record completes or
        /// fails, so the read comes at once (`docs/contract.md#waking-a-waiting-duplicate`).
        /// The wait holds the client's connection and one task for up to `limit`; keep it to
        /// seconds. Needs tokio's timer, like renewal.
        #[must_use]
        pub fn with_in_flight_wait(limit: Option<Duration>) => config().in_flight_wait = limit;

        /// Sets how long the layer waits, after a storable response's head, for its body to
        /// end before it streams the response instead (default 500 ms; `None`: no deadline,
        /// only the size and the content type decide). A streamed response completes the
        /// record as not retained before its first byte is sent: a retry gets the
        /// `response-not-retained` problem, never a second run. Needs tokio's timer.
        #[must_use]
        pub fn with_buffer_deadline(deadline: Option<Duration>) => config().streaming.buffer_for = deadline;
    }

    /// Sets the response media types streamed at once, without buffering any of the body
    /// (default `text/event-stream`). Names compare case-insensitively, parameters
    /// (`; charset=...`) ignored.
    #[must_use]
    pub fn with_streaming_content_types<I: IntoIterator<Item = S>, S: Into<String>>(mut self, types: I) -> Self {
        self.config().streaming.content_types = types.into_iter().map(|s| s.into().to_ascii_lowercase()).collect();
        self
    }

    idem_core::setters! {
        /// Sets the retry hint headers of the layer's own answers (default `x-should-retry`
        /// on, `Stripe-Should-Retry` off; see [`RetryHints`]).
        #[must_use]
        pub fn with_retry_hints(hints: RetryHints) => config().retry_hints = hints;

        /// Sets the deadline of each store call and whether a `complete`/`fail` that misses it
        /// or fails transiently is sent again (default: 2 s per call, completions retried with
        /// backoff for up to one lease TTL). A claim that misses its deadline is answered 503
        /// (or runs unprotected under [`StoreFailureMode::FailOpen`]); see
        /// [`crate::deadline`] for what an abandoned call may leave behind.
        #[must_use]
        pub fn with_store_deadlines(deadlines: StoreDeadlines) => config().store_deadlines = deadlines;

        /// Seals every stored response (XChaCha20-Poly1305; the record id and fencing token
        /// are the associated data): a reader of the store sees no status, header or body, and
        /// a response that was altered, moved to another record, sealed by a key no longer
        /// configured, or stored plain while [`Sealing::accept_unsealed`] is off, is answered
        /// 503 with `x-should-retry: false`, never by running the handler again. See
        /// `docs/contract.md#sealed-responses`.
        ///
        /// A handler that completes its record itself ([`crate::ResponseCaching::CompletedByHandler`])
        /// must store [`crate::IdempotencyContext::stored_form`] of its response, not the plain
        /// response.
        ///
        /// [`Sealing::accept_unsealed`]: idem_core::seal::Sealing::accept_unsealed
        #[cfg(feature = "seal")]
        #[must_use]
        pub fn with_sealing(sealing: idem_core::seal::Sealing) => config().sealing = Some(sealing);
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let pipeline = self.prepared.get_or_init(|| Arc::new(Pipeline::prepare(&self.config)));
        Idempotency::new(inner, Arc::clone(pipeline))
    }
}

#[cfg(test)]
mod tests {
    use idem_core::MemoryStore;

    use super::*;

    fn layer() -> IdempotencyLayer {
        IdempotencyLayer::new(Arc::new(MemoryStore::new()))
    }

    /// `with_policy` replaced the HTTP settings too, or left earlier record rules behind.
    #[test]
    fn with_policy_replaces_the_record_rules_only() {
        let mut short = Policy::default();
        short.retention = Duration::from_secs(7);
        let l = layer()
            .with_policy(short)
            .with_max_key_len(8)
            .with_mismatch_status(MismatchStatus::BadRequest)
            .with_fingerprint_headers(["Content-Type", "X-Tenant"])
            .with_policy(Policy::default());
        assert_eq!(l.config.policy.retention, Policy::default().retention);
        assert_eq!(l.config.max_key_len, 8);
        assert_eq!(l.config.mismatch_status, MismatchStatus::BadRequest);
        assert_eq!(l.config.fingerprint_headers, ["content-type", "x-tenant"]);
    }

    /// The store wrappers were composed again on every `layer` call (axum calls it once per
    /// route), or a setter after a `layer` call left the old composition in place.
    #[test]
    fn the_pipeline_is_prepared_once_per_layer() {
        let l = layer();
        let copy = l.clone();
        let (a, b) = (l.layer(()), copy.layer(()));
        assert!(Arc::ptr_eq(a.pipeline(), b.pipeline()), "clones share one preparation");
        assert!(Arc::ptr_eq(a.pipeline(), l.layer(()).pipeline()));
        let changed = l.with_max_key_len(8);
        assert!(!Arc::ptr_eq(a.pipeline(), changed.layer(()).pipeline()), "a setter prepares anew");
    }
}
