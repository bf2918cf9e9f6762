//! Retry hints for SDK retry loops, and the last touch on the layer's own answers.
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

use http::{HeaderMap, HeaderName, HeaderValue, Response};

use crate::body::ResponseBody;
use crate::problem::{Problem, ProblemKind};

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
    fn set(self, headers: &mut HeaderMap, retry: bool) {
        let value = HeaderValue::from_static(if retry { "true" } else { "false" });
        if self.x_should_retry && !headers.contains_key(X_SHOULD_RETRY) {
            headers.insert(X_SHOULD_RETRY, value.clone());
        }
        if self.stripe_should_retry && !headers.contains_key(STRIPE_SHOULD_RETRY) {
            headers.insert(STRIPE_SHOULD_RETRY, value);
        }
    }
}

/// Whether a client should retry the answer of `kind` with the same key.
fn should_retry(kind: ProblemKind) -> bool {
    matches!(
        kind,
        ProblemKind::InFlight | ProblemKind::Busy | ProblemKind::StoreUnavailable | ProblemKind::ResponseBodyFailed
    )
}

/// Marks an answer that retrying cannot change (set before [`dress`], which keeps it).
pub(crate) fn never_retry(headers: &mut HeaderMap, hints: &RetryHints) {
    hints.set(headers, false);
}

/// The retry hints on the layer's own answers, and for a gRPC request (feature `grpc`)
/// the answer as a gRPC status. Responses without a [`Problem`] extension (the handler's, and replays of
/// them) pass unchanged.
pub(crate) fn dress<B>(
    mut res: Response<ResponseBody<B>>,
    hints: &RetryHints,
    grpc: bool,
) -> Response<ResponseBody<B>> {
    let Some(problem) = res.extensions_mut().remove::<Problem>() else { return res };
    #[cfg(feature = "grpc")]
    if grpc {
        res = crate::grpc::problem_to_status(res, &problem);
    }
    #[cfg(not(feature = "grpc"))]
    let _ = grpc;
    hints.set(res.headers_mut(), should_retry(problem.kind()));
    res
}
