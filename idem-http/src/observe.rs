//! What the layer tells an operator: the `idempotency` span of each keyed request, and,
//! with the `metrics` feature, its counters through the `metrics` facade (the store call
//! metrics are the store's own wrapper, `store/timed.rs`).
//! Field and metric names are a stable interface, listed in `docs/observability.md`.
//!
//! Cost: the span's fields start empty and are recorded as plain `&str` and `u64` values,
//! never formatted here (the short record id is a `Display` value a subscriber formats
//! only if it writes it). With no subscriber interested in the span, it is disabled and
//! no field is even gathered for it; with the `metrics` feature off, the metric calls
//! compile to nothing.

use std::fmt;

use idem_core::{Endpoint, FencingToken, RecordId};
use tracing::Span;
use tracing::field::Empty;

named_enum! {
    /// What the layer decided for one request: the `decision` field and the
    /// `idem_decisions_total{decision}` label.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[non_exhaustive]
    pub enum DecisionKind {
        /// No live record: this request claimed it and runs the handler.
        Claimed => "claimed",
        /// An expired lease or a failed record: this request won the compare-and-set.
        Reclaimed => "reclaimed",
        /// A completed record with the same fingerprint: its response was replayed.
        Replayed => "replayed",
        /// Another attempt holds a fresh lease: 409 `in-flight`.
        InFlight => "in_flight",
        /// Same key, different request: 409 (or the configured status) `mismatch`.
        Mismatch => "mismatch",
        /// The record kept changing under this request: 409 `busy`.
        Busy => "busy",
        /// The store failed and the layer fails closed: 503.
        StoreUnavailable => "store_unavailable",
        /// The store failed and the layer fails open: the handler ran unprotected.
        FailOpen => "fail_open",
        /// The stored record does not decode or cannot be replayed: 503, never retried.
        Unreadable => "unreadable",
        /// No key on an endpoint where it is optional, or no principal under
        /// `MissingPrincipal::SkipIdempotency`: the handler ran without idempotency.
        Skipped => "skipped",
        /// The request was answered before any claim: missing or invalid key, missing
        /// principal, body too large or unreadable.
        Rejected => "rejected",
    }
}

named_enum! {
    /// How a claimed attempt ended: the `outcome` field and the
    /// `idem_outcomes_total{outcome}` label.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[non_exhaustive]
    pub enum Outcome {
        /// The record completed with the response (or the handler completed it itself).
        Completed => "completed",
        /// The record completed, but its body was not kept (over `max_stored_body`, streamed).
        NotRetained => "not_retained",
        /// The record was marked failed: 5xx, uncacheable status, handler error or panic,
        /// a response body that failed.
        Failed => "failed",
        /// Another attempt took the record over: this attempt's writes were refused.
        LeaseLost => "lease_lost",
        /// The completion could not be written (store unavailable after retries): the record
        /// stays in flight until its lease ends.
        NotStored => "not_stored",
    }
}

/// The first 8 bytes of a record id in hex: enough to find the record in logs and with
/// the CLI, short enough for a log line. Formatted only by a subscriber that writes it.
pub(crate) struct ShortId(pub(crate) RecordId);

impl fmt::Display for ShortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0.as_bytes()[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The `idempotency` span of one request: `endpoint` set, every other field declared
/// and empty.
pub(crate) fn request_span(endpoint: &Endpoint) -> Span {
    tracing::info_span!(
        "idempotency",
        endpoint = endpoint.as_str(),
        record = Empty,
        token = Empty,
        decision = Empty,
        outcome = Empty,
        renewals = Empty,
    )
}

/// One step of one keyed request, as [`crate::IdempotencyLayer::with_events`] hands it
/// to the application: the same facts as the span's `decision` and `outcome` fields.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Event<'a> {
    /// What happened.
    pub step: Step,
    /// The endpoint, as in the span's `endpoint` field (method and route template).
    pub endpoint: &'a str,
    /// The record; `None` for a request answered before its record was known.
    pub record: Option<RecordId>,
}

/// What an [`Event`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// What the layer decided for the request: a claim, a replay, 409 in flight, a
    /// mismatch, a refusal before any claim.
    Decided(DecisionKind),
    /// How a claimed attempt ended: completed, not retained, failed, lease lost, not stored.
    Ended(Outcome),
}

/// The application's event callback (`IdempotencyLayer::with_events`).
pub(crate) type EventFn = dyn Fn(&Event<'_>) + Send + Sync;

/// One request's observer: its span, and the endpoint label of its counters.
#[derive(Debug, Clone)]
pub(crate) struct Observer {
    pub(crate) span: Span,
    /// The application's callback and this request's endpoint and record, when it set one.
    events: Option<Box<Subscribed>>,
    /// The `endpoint` label, made once per request (a reference count per metric call
    /// after that); `None` until the endpoint is known.
    #[cfg(feature = "metrics")]
    endpoint: Option<metrics::SharedString>,
}

/// What an event names besides its step.
#[derive(Clone)]
struct Subscribed {
    callback: std::sync::Arc<EventFn>,
    endpoint: Endpoint,
    record: Option<RecordId>,
}

impl fmt::Debug for Subscribed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Subscribed")
    }
}

impl Observer {
    pub(crate) fn new(span: Span, events: Option<&std::sync::Arc<EventFn>>, endpoint: &Endpoint) -> Self {
        let events = events.map(|callback| {
            Box::new(Subscribed { callback: callback.clone(), endpoint: endpoint.clone(), record: None })
        });
        Self {
            span,
            events,
            #[cfg(feature = "metrics")]
            endpoint: None,
        }
    }

    /// Labels this request's counters with `endpoint` (already on the span, from its
    /// creation).
    #[cfg_attr(not(feature = "metrics"), allow(clippy::unused_self, reason = "labels only with metrics"))]
    pub(crate) fn endpoint(&mut self, endpoint: &Endpoint) {
        #[cfg(feature = "metrics")]
        {
            self.endpoint = Some(metrics::SharedString::from(std::sync::Arc::<str>::from(endpoint.as_str())));
        }
        #[cfg(not(feature = "metrics"))]
        let _ = endpoint;
    }

    pub(crate) fn record(&mut self, id: RecordId) {
        if let Some(events) = &mut self.events {
            events.record = Some(id);
        }
        if !self.span.is_disabled() {
            self.span.record("record", tracing::field::display(ShortId(id)));
        }
    }

    /// A decision that claimed the record (`claimed`, `reclaimed`) and its token: one
    /// dispatch for both fields.
    pub(crate) fn claimed(&self, decision: DecisionKind, token: FencingToken) {
        if !self.span.is_disabled() {
            tracing::record_all!(self.span, decision = decision.as_str(), token = token.0);
        }
        self.count(decision);
    }

    pub(crate) fn decision(&self, decision: DecisionKind) {
        if !self.span.is_disabled() {
            self.span.record("decision", decision.as_str());
        }
        self.count(decision);
    }

    /// `decision` in the metrics and to the application's callback: `metrics::counter!`
    /// looks the handle up in the recorder installed now, so there is nothing to keep in
    /// step with it.
    fn count(&self, decision: DecisionKind) {
        if let Some(Subscribed { callback, endpoint, record }) = self.events.as_deref() {
            callback(&Event { step: Step::Decided(decision), endpoint: endpoint.as_str(), record: *record });
        }
        #[cfg(feature = "metrics")]
        if let Some(endpoint) = &self.endpoint {
            metrics::counter!("idem_decisions_total", "decision" => decision.as_str(), "endpoint" => endpoint.clone())
                .increment(1);
            if decision == DecisionKind::FailOpen {
                metrics::counter!("idem_fail_open_total", "endpoint" => endpoint.clone()).increment(1);
            }
        }
    }

    pub(crate) fn outcome(&self, outcome: Outcome, renewals: u64) {
        if let Some(Subscribed { callback, endpoint, record }) = self.events.as_deref() {
            callback(&Event { step: Step::Ended(outcome), endpoint: endpoint.as_str(), record: *record });
        }
        // One dispatch for both fields.
        if !self.span.is_disabled() {
            tracing::record_all!(self.span, outcome = outcome.as_str(), renewals = renewals);
        }
        #[cfg(feature = "metrics")]
        if let Some(endpoint) = &self.endpoint {
            metrics::counter!("idem_outcomes_total", "outcome" => outcome.as_str(), "endpoint" => endpoint.clone())
                .increment(1);
            if renewals > 0 {
                metrics::counter!("idem_lease_renewals_total", "endpoint" => endpoint.clone()).increment(renewals);
            }
            let flagged = match outcome {
                Outcome::LeaseLost => Some("idem_lease_lost_total"),
                Outcome::NotRetained => Some("idem_bodies_not_retained_total"),
                _ => None,
            };
            if let Some(name) = flagged {
                metrics::counter!(name, "endpoint" => endpoint.clone()).increment(1);
            }
        }
    }
}
