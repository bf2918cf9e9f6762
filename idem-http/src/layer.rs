//! [`IdempotencyLayer`]: every setting of the layer, and the tower [`Layer`] that wraps a
//! service in [`Idempotency`].

use std::sync::Arc;
use std::time::Duration;

use idem_core::{FingerprintMode, Policy, Store};
use tower::Layer;

use crate::config::{
    Config, HandlerExecution, KeyRequirement, LeaseRenewal, MismatchStatus, MissingPrincipal, StoreFailureMode,
};
use crate::deadline::StoreDeadlines;
use crate::hints::RetryHints;
use crate::principal::PrincipalResolver;
use crate::service::Idempotency;

/// Tower layer that makes the wrapped service idempotent per `Idempotency-Key`.
///
/// Every setting is a `with_*` method here. The record rules (retention, lease, cacheable
/// statuses, what a stored response keeps) are an [`idem_core::Policy`], set one by one
/// with the methods under "Record rules" or at once with [`IdempotencyLayer::with_policy`];
/// the rest (under "Requests and answers") decide how requests are read and answered.
///
/// | setting | default |
/// |---|---|
/// | [`with_retention`](Self::with_retention) | 24 h |
/// | [`with_lease_ttl`](Self::with_lease_ttl) | 5 min |
/// | [`with_uncacheable_4xx`](Self::with_uncacheable_4xx) | 401, 403, 408, 409, 423, 425, 429 |
/// | [`with_max_stored_body`](Self::with_max_stored_body) | 1 MiB (1 048 576 bytes) |
/// | [`with_compress_over`](Self::with_compress_over) | 4 KiB (4 096 bytes) |
/// | [`with_header_deny_list`](Self::with_header_deny_list) (adds) / [`with_header_deny_list_replaced`](Self::with_header_deny_list_replaced) | `set-cookie`, `date` |
/// | [`with_key_requirement`](Self::with_key_requirement) | [`KeyRequirement::Required`] |
/// | [`with_max_key_len`](Self::with_max_key_len) | 255 bytes |
/// | [`with_principal_resolver`](Self::with_principal_resolver) | [`crate::BearerToken`] |
/// | [`with_missing_principal`](Self::with_missing_principal) | [`MissingPrincipal::Reject`] |
/// | [`with_max_request_body`](Self::with_max_request_body) | 1 MiB (1 048 576 bytes) |
/// | [`with_fingerprint_headers`](Self::with_fingerprint_headers) | `content-type` |
/// | [`with_max_fingerprint_headers`](Self::with_max_fingerprint_headers) | 32 fields, 16 KiB (16 384 bytes) |
/// | [`with_fingerprint_mode`](Self::with_fingerprint_mode) | [`FingerprintMode::Raw`] |
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
///
/// Cloning is cheap (one `Arc`).
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idem_core::MemoryStore;
/// use idem_http::{IdempotencyLayer, KeyRequirement, MismatchStatus};
///
/// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()))
///     .with_retention(Duration::from_secs(7 * 86_400))
///     .with_key_requirement(KeyRequirement::Optional)
///     .with_mismatch_status(MismatchStatus::UnprocessableContent);
/// assert_eq!(layer.policy().retention, Duration::from_secs(7 * 86_400));
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults above.
    #[must_use]
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self { config: Arc::new(Config::new(store)) }
    }

    /// The settings, to change one of them. Copies them first if a service made from this
    /// layer still shares them (services keep what they were made with).
    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// Changes the record rules with one of [`Policy`]'s own setters, so each rule is
    /// written (and normalised, e.g. lower-cased header names) in one place.
    fn map_policy(mut self, change: impl FnOnce(Policy) -> Policy) -> Self {
        let config = self.config();
        config.policy = change(std::mem::take(&mut config.policy));
        self
    }

    // Record rules, delegated to the policy.

    /// Replaces every record rule at once (retention, lease TTL, uncacheable statuses,
    /// stored body limit, compression threshold, header deny list), including those set
    /// by the methods below before this call.
    #[must_use]
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.config().policy = policy;
        self
    }

    /// Sets how long a record lives after its claim (default 24 h). Never shorter than the
    /// lease TTL in effect: a live claim is never swept. See [`Policy::retention`].
    #[must_use]
    pub fn with_retention(self, retention: Duration) -> Self {
        self.map_policy(|p| p.with_retention(retention))
    }

    /// Sets how long an in-flight claim is honoured without a renewal (default 5 min): a
    /// handler killed mid-flight blocks retries for at most this long. While the handler
    /// runs, the layer renews the lease ([`IdempotencyLayer::with_lease_renewal`]), so the
    /// lease does not have to cover the slowest handler: seconds are enough (see the crate
    /// docs, "Picking the lease"). With renewal off, a handler slower than this may run
    /// twice. See [`Policy::lease_ttl`].
    #[must_use]
    pub fn with_lease_ttl(self, lease_ttl: Duration) -> Self {
        self.map_policy(|p| p.with_lease_ttl(lease_ttl))
    }

    /// Sets the 4xx statuses that are not stored, so a retry runs the handler again
    /// (default 401, 403, 408, 409, 423, 425, 429). 2xx are always stored; 1xx, 3xx and
    /// 5xx never. See [`Policy::is_cacheable`].
    #[must_use]
    pub fn with_uncacheable_4xx<I: IntoIterator<Item = u16>>(self, statuses: I) -> Self {
        self.map_policy(|p| p.with_uncacheable_4xx(statuses))
    }

    /// Sets the largest response body stored for replay, bytes (default 1 MiB). A larger
    /// response still completes the record; its replay answers a `response-not-retained`
    /// problem with the original status.
    #[must_use]
    pub fn with_max_stored_body(self, bytes: usize) -> Self {
        self.map_policy(|p| p.with_max_stored_body(bytes))
    }

    /// Sets the body length, bytes, over which a stored body is LZ4-compressed (default
    /// 4 KiB).
    #[must_use]
    pub fn with_compress_over(self, bytes: usize) -> Self {
        self.map_policy(|p| p.with_compress_over(bytes))
    }

    /// Adds response headers never to store, on top of the defaults (`set-cookie`,
    /// `date`; per-exchange ids such as `x-request-id` belong here too). Names compare
    /// case-insensitively. Hop-by-hop headers and those named by a response's `Connection`
    /// field are never stored either. See [`Policy::with_header_deny_list`].
    #[must_use]
    pub fn with_header_deny_list<I: IntoIterator<Item = S>, S: Into<String>>(self, names: I) -> Self {
        self.map_policy(|p| p.with_header_deny_list(names))
    }

    /// Replaces the whole deny list, defaults included (so `Set-Cookie` is stored unless
    /// listed). See [`Policy::with_header_deny_list_replaced`].
    #[must_use]
    pub fn with_header_deny_list_replaced<I: IntoIterator<Item = S>, S: Into<String>>(self, names: I) -> Self {
        self.map_policy(|p| p.with_header_deny_list_replaced(names))
    }

    // Requests and answers.

    /// Sets what happens to non-safe requests without a key (default
    /// [`KeyRequirement::Required`]).
    #[must_use]
    pub fn with_key_requirement(mut self, requirement: KeyRequirement) -> Self {
        self.config().key_requirement = requirement;
        self
    }

    /// Sets the longest accepted idempotency key, bytes after unquoting (default 255).
    /// A longer key is a 400 `invalid-idempotency-key`.
    #[must_use]
    pub fn with_max_key_len(mut self, bytes: usize) -> Self {
        self.config().max_key_len = bytes;
        self
    }

    /// Replaces the principal resolver (default [`crate::BearerToken`]).
    #[must_use]
    pub fn with_principal_resolver(mut self, resolver: impl PrincipalResolver) -> Self {
        self.config().resolver = Arc::new(resolver);
        self
    }

    /// Sets what happens to keyed requests without a principal (default
    /// [`MissingPrincipal::Reject`]).
    #[must_use]
    pub fn with_missing_principal(mut self, rule: MissingPrincipal) -> Self {
        self.config().missing_principal = rule;
        self
    }

    /// Sets the largest request body the layer buffers to fingerprint, bytes (default
    /// 1 MiB). A larger request gets 413 `body-too-large` and claims nothing.
    #[must_use]
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.config().max_request_body = bytes;
        self
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

    /// Sets how the body enters the fingerprint (default [`FingerprintMode::Raw`], the raw
    /// bytes; [`FingerprintMode::CanonicalJson`] is opt-in because it can merge requests
    /// an API treats as different).
    #[must_use]
    pub fn with_fingerprint_mode(mut self, mode: FingerprintMode) -> Self {
        self.config().fingerprint_mode = mode;
        self
    }

    /// Sets the status of the answer to a fingerprint mismatch (default
    /// [`MismatchStatus::Conflict`], 409).
    #[must_use]
    pub fn with_mismatch_status(mut self, status: MismatchStatus) -> Self {
        self.config().mismatch_status = status;
        self
    }

    /// Sets what happens when the store cannot be reached (default
    /// [`StoreFailureMode::FailClosed`]: 503, the handler does not run).
    #[must_use]
    pub fn with_store_failure_mode(mut self, mode: StoreFailureMode) -> Self {
        self.config().store_failure_mode = mode;
        self
    }

    /// Sets where a claimed request's handler runs (default [`HandlerExecution::Detached`]:
    /// a client disconnect does not cancel it half-way).
    #[must_use]
    pub fn with_handler_execution(mut self, execution: HandlerExecution) -> Self {
        self.config().handler_execution = execution;
        self
    }

    /// Sets how often the lease of a running handler is renewed (default
    /// [`LeaseRenewal::Fraction`]`(3)`, every lease TTL / 3). [`LeaseRenewal::Off`] renews
    /// nothing and costs nothing per request. Renewal times itself with tokio's timer: the
    /// runtime must have time enabled (`#[tokio::main]` and `Builder::enable_all` do);
    /// outside a tokio runtime nothing is renewed.
    #[must_use]
    pub fn with_lease_renewal(mut self, renewal: LeaseRenewal) -> Self {
        self.config().lease_renewal = renewal;
        self
    }

    /// Sets the largest `Retry-After` of an in-flight 409 (default 2 s). The answer is the
    /// remaining lease clamped to [1 s, `cap`], in whole seconds (`cap` is rounded down, at
    /// least 1 s): a short poll interval. A long cap makes clients sleep through the moment
    /// the response is stored; under renewal the lease end says nothing about when that is.
    #[must_use]
    pub fn with_in_flight_retry_after(mut self, cap: Duration) -> Self {
        self.config().in_flight_retry_after = cap;
        self
    }

    /// Lets a duplicate of an in-flight request wait up to `limit` for the first attempt's
    /// outcome (default `None`: it gets 409 `in-flight` at once). While it waits, the layer
    /// reads the record again after short pauses (20 ms, doubling, at most 500 ms), holding
    /// no store connection, lock or claim in between; it answers as soon as the record
    /// completed (the replay), failed or lost its lease (the duplicate reclaims it and runs
    /// the handler, as any retry would), and with the usual 409 when `limit` has passed.
    /// The wait holds the client's connection and one task for up to `limit`; keep it to
    /// seconds. Needs tokio's timer, like renewal.
    #[must_use]
    pub fn with_in_flight_wait(mut self, limit: Option<Duration>) -> Self {
        self.config().in_flight_wait = limit;
        self
    }

    /// Sets how long the layer waits, after a storable response's head, for its body to
    /// end before it streams the response instead (default 500 ms; `None`: no deadline,
    /// only the size and the content type decide). A streamed response completes the
    /// record as not retained before its first byte is sent: a retry gets the
    /// `response-not-retained` problem, never a second run. Needs tokio's timer.
    #[must_use]
    pub fn with_buffer_deadline(mut self, deadline: Option<Duration>) -> Self {
        self.config().streaming.buffer_for = deadline;
        self
    }

    /// Sets the response media types streamed at once, without buffering any of the body
    /// (default `text/event-stream`). Names compare case-insensitively, parameters
    /// (`; charset=...`) ignored.
    #[must_use]
    pub fn with_streaming_content_types<I: IntoIterator<Item = S>, S: Into<String>>(mut self, types: I) -> Self {
        self.config().streaming.content_types = types.into_iter().map(|s| s.into().to_ascii_lowercase()).collect();
        self
    }

    /// Sets the retry hint headers of the layer's own answers (default `x-should-retry`
    /// on, `Stripe-Should-Retry` off; see [`RetryHints`]).
    #[must_use]
    pub fn with_retry_hints(mut self, hints: RetryHints) -> Self {
        self.config().retry_hints = hints;
        self
    }

    /// Sets the deadline of each store call and whether a `complete`/`fail` that misses it
    /// or fails transiently is sent again (default: 2 s per call, completions retried with
    /// backoff for up to one lease TTL). A claim that misses its deadline is answered 503
    /// (or runs unprotected under [`StoreFailureMode::FailOpen`]); see
    /// [`crate::deadline`] for what an abandoned call may leave behind.
    #[must_use]
    pub fn with_store_deadlines(mut self, deadlines: StoreDeadlines) -> Self {
        self.config().store_deadlines = deadlines;
        self
    }

    /// Seals every stored response with `keys` (XChaCha20-Poly1305; the record id and
    /// fencing token are the associated data): a reader of the store sees no status,
    /// header or body, and a response that was altered, moved to another record, or
    /// sealed by a key no longer in `keys` is answered 503 with `x-should-retry: false`,
    /// never by running the handler again. Responses stored unsealed are refused the same
    /// way unless [`Self::with_unsealed_accepted`] is on. See [`idem_core::seal`] and
    /// `docs/contract.md#sealed-responses`.
    ///
    /// A handler that completes its record itself ([`crate::ResponseCaching::CompletedByHandler`])
    /// must store [`crate::IdempotencyContext::stored_form`] of its response (the same as
    /// `keys.seal(id, token, &response)`), not the plain response.
    #[cfg(feature = "seal")]
    #[must_use]
    pub fn with_sealing(mut self, keys: idem_core::seal::SealingKeys) -> Self {
        let accept = self.config.sealing.as_ref().is_some_and(|(_, a)| *a);
        self.config().sealing = Some((keys, accept));
        self
    }

    /// With sealing on, whether responses stored before it was turned on (unsealed) are
    /// still replayed (default `false`: refused as corrupt, so a writer to the store
    /// cannot swap a sealed response for a plain one). Turn on for one retention window
    /// while migrating. No effect without [`Self::with_sealing`].
    #[cfg(feature = "seal")]
    #[must_use]
    pub fn with_unsealed_accepted(mut self, accept: bool) -> Self {
        if let Some((_, a)) = &mut self.config().sealing {
            *a = accept;
        }
        self
    }

    /// The record rules in force.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }

    /// The store records go to.
    #[must_use]
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.config.store
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, Arc::new(self.config.for_service()))
    }
}

#[cfg(test)]
mod tests {
    use idem_core::MemoryStore;

    use super::*;

    fn layer() -> IdempotencyLayer {
        IdempotencyLayer::new(Arc::new(MemoryStore::new()))
    }

    /// A record-rule setter on the layer did not reach the policy the service reads.
    #[test]
    fn record_rule_setters_write_the_policy() {
        let l = layer()
            .with_retention(Duration::from_secs(7))
            .with_lease_ttl(Duration::from_secs(3))
            .with_uncacheable_4xx([404])
            .with_max_stored_body(10)
            .with_compress_over(5)
            .with_header_deny_list(["X-Request-Id"]);
        let p = l.policy();
        assert_eq!((p.retention, p.lease_ttl), (Duration::from_secs(7), Duration::from_secs(3)));
        assert!(!p.is_cacheable(404) && p.is_cacheable(409));
        assert_eq!((p.max_stored_body, p.compress_over), (10, 5));
        assert!(!p.stores_header("x-request-id") && !p.stores_header("set-cookie"), "adds to the defaults");
        assert!(layer().with_header_deny_list_replaced(["x-request-id"]).policy().stores_header("set-cookie"));
    }

    /// `with_policy` replaced the HTTP settings too, or left earlier record rules behind.
    #[test]
    fn with_policy_replaces_the_record_rules_only() {
        let l = layer()
            .with_retention(Duration::from_secs(7))
            .with_max_key_len(8)
            .with_mismatch_status(MismatchStatus::BadRequest)
            .with_fingerprint_headers(["Content-Type", "X-Tenant"])
            .with_policy(Policy::default());
        assert_eq!(l.policy().retention, Policy::default().retention);
        assert_eq!(l.config.max_key_len, 8);
        assert_eq!(l.config.mismatch_status, MismatchStatus::BadRequest);
        assert_eq!(l.config.fingerprint_headers, ["content-type", "x-tenant"]);
    }
}
