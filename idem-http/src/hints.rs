//! Retry hints for SDK retry loops, on the layer's own answers.
//!
//! Generated API SDKs retry every 409 (and 408, 429, 5xx) unless the server says
//! otherwise, so a mismatch (409 by default) would be retried until the SDK's budget runs
//! out instead of surfacing at once. The layer therefore marks each answer it makes
//! itself:
//!
//! | answer | `x-should-retry` |
//! |---|---|
//! | mismatch, missing/invalid/duplicate key, missing principal, unreadable or too large request body, `response-not-retained` replay, a record that does not decode | `false` |
//! | in flight, busy, store unavailable, response body failed | `true` |
//!
//! `x-should-retry` is read by the Stainless-generated SDKs (OpenAI's and Anthropic's
//! Python and TypeScript SDKs among them): `true` retries, `false` stops, before any status
//! rule. Stripe's SDKs read `Stripe-Should-Retry` the same way; it is off by default,
//! because the name belongs to Stripe's API and only a Stripe-compatible API should send
//! it ([`RetryHints::stripe_should_retry`]). Responses of the handler and replays of
//! them are never marked: the handler owns those.

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::problem::ProblemKind;

/// `x-should-retry` (Stainless-generated SDKs).
pub const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
/// `Stripe-Should-Retry` (Stripe's SDKs).
pub const STRIPE_SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");

/// Which retry hint headers the layer's own answers carry (see the module docs).
/// Default: `x-should-retry` on, `Stripe-Should-Retry` off.
///
/// ```
/// use idem_http::RetryHints;
/// let mut hints = RetryHints::default();
/// hints.stripe_should_retry = true;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryHints {
    /// Send `x-should-retry: true|false`.
    pub x_should_retry: bool,
    /// Send `Stripe-Should-Retry: true|false`.
    pub stripe_should_retry: bool,
}

impl Default for RetryHints {
    fn default() -> Self {
        Self { x_should_retry: true, stripe_should_retry: false }
    }
}

impl RetryHints {
    /// Adds the enabled hints, saying `retry`, to an answer's headers.
    pub(crate) fn add(self, headers: &mut HeaderMap, retry: bool) {
        let value = HeaderValue::from_static(if retry { "true" } else { "false" });
        if self.x_should_retry {
            headers.insert(X_SHOULD_RETRY, value.clone());
        }
        if self.stripe_should_retry {
            headers.insert(STRIPE_SHOULD_RETRY, value);
        }
    }
}

/// Whether a client should retry the answer of `kind` with the same key (module docs).
pub(crate) fn should_retry(kind: ProblemKind) -> bool {
    matches!(
        kind,
        ProblemKind::InFlight
            | ProblemKind::Busy
            | ProblemKind::StoreUnavailable
            | ProblemKind::DeadlinePassed
            | ProblemKind::ResponseBodyFailed
    )
}
