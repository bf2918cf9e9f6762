//! idem's client behaviour as a [`reqwest_middleware`] middleware (feature `middleware`),
//! for teams whose stack already is `reqwest-middleware` + `reqwest-retry` + a tracing
//! middleware. Built for reqwest 0.12: `reqwest-middleware` 0.4 and `reqwest-retry` 0.7
//! (`tests/middleware.rs` builds this stack against a real server).
//!
//! ```no_run
//! # async fn demo() -> reqwest_middleware::Result<()> {
//! use std::time::Duration;
//! use idem_client::middleware::{IdempotencyMiddleware, retry_transient};
//! use reqwest_retry::policies::ExponentialBackoff;
//!
//! let backoff = ExponentialBackoff::builder()
//!     .retry_bounds(Duration::from_millis(100), Duration::from_secs(5))
//!     .build_with_total_retry_duration(Duration::from_secs(60));
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     // Outermost: backoff, jitter and the time budget (reqwest-retry's, not ours) ...
//!     .with(retry_transient(backoff))
//!     // ... beneath it: the key, kept across its retries, and the Retry-After wait.
//!     .with(IdempotencyMiddleware::default())
//!     .build();
//! // One `send` is one logical operation: one key for every retry beneath it.
//! let reply = client.post("http://127.0.0.1:8080/v1/workers").body("{}").send().await?;
//! # let _ = reply; Ok(()) }
//! ```
//!
//! # Who does what
//! - **reqwest-retry** ([`reqwest_retry::RetryTransientMiddleware`] with a
//!   [`retry_policies`](reqwest_retry::policies) policy): the retry loop, exponential
//!   backoff, jitter, the attempt limit and the total time budget. Not reimplemented here.
//! - **Ours**, [`IdempotencyMiddleware`]: stamps an `Idempotency-Key` on every non-safe
//!   request (RFC 9110 §9.2.1: not on GET, HEAD, OPTIONS, TRACE) that has none, once per
//!   logical operation, kept across every retry beneath it (the key lives in the request's
//!   [`http::Extensions`], which `reqwest-retry` passes to each attempt); waits out a
//!   server's `Retry-After` (seconds, RFC 9110 §10.2.3; at most
//!   [`IdempotencyMiddleware::with_max_wait`]) before a retryable answer goes back up to
//!   the retry loop, whose own backoff then comes on top.
//! - **Ours**, [`IdempotencyRetryStrategy`]: which answers are worth retrying for an idem
//!   server (the client's rules, `docs/contract.md#the-client`, read from status and
//!   headers alone). `reqwest-retry`'s default strategy would stop at the in-flight 409,
//!   the very answer a retry is for.
//!
//! Put [`IdempotencyMiddleware`] *beneath* the retry middleware (added after it): above it,
//! the key still holds across retries (it is in the request before the retry middleware
//! clones it), but `Retry-After` is not waited for between attempts.
//!
//! To reuse a key across process restarts (a [`crate::KeyJournal`]), put the
//! [`OperationKey`] into the request's extensions
//! (`reqwest_middleware::RequestBuilder::with_extension`) or set the header yourself; the
//! middleware then uses it instead of generating one.
//!
//! What the middleware does not do, unlike [`crate::IdempotentClient`]: read the response
//! body (a mismatch is recognised by status and headers alone), or keep polling an
//! in-flight operation beyond the retry policy's attempt count.

use std::time::Duration;

use http::{Extensions, HeaderValue, Method, StatusCode};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use reqwest_retry::{RetryPolicy, RetryTransientMiddleware, Retryable, RetryableStrategy};

use crate::retry::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, OperationKey, retry_after};

/// The default longest `Retry-After` the middleware waits out, per answer.
const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(60);

/// Stamps one `Idempotency-Key` per logical operation and waits out `Retry-After`
/// ([module docs](self)); `IdempotencyMiddleware::default()` caps each wait at 60 s.
#[derive(Clone, Debug)]
pub struct IdempotencyMiddleware {
    max_wait: Duration,
}

impl Default for IdempotencyMiddleware {
    fn default() -> Self {
        Self { max_wait: DEFAULT_MAX_WAIT }
    }
}

impl IdempotencyMiddleware {
    /// Caps each `Retry-After` wait (default 60 s). Zero turns the wait off (only the
    /// retry policy's backoff remains).
    #[must_use]
    pub fn with_max_wait(mut self, max: Duration) -> Self {
        self.max_wait = max;
        self
    }

    /// The `Retry-After` to wait before `response` goes back to a retry loop: only for an
    /// answer [`IdempotencyRetryStrategy`] retries.
    fn wait_before_retry(&self, response: &Response) -> Option<Duration> {
        if classify(response) != Some(Retryable::Transient) {
            return None;
        }
        retry_after(response.headers()).map(|d| d.min(self.max_wait)).filter(|d| !d.is_zero())
    }
}

/// Safe methods (RFC 9110 §9.2.1) need no key: repeating them changes nothing.
fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE)
}

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        if !is_safe(req.method()) && !req.headers().contains_key(IDEMPOTENCY_KEY) {
            // The extensions outlive the attempts: the first attempt stores the key there,
            // every retry finds it.
            let key = match extensions.get::<OperationKey>() {
                Some(key) => key.clone(),
                None => {
                    let key = OperationKey::generate();
                    extensions.insert(key.clone());
                    key
                }
            };
            let value = HeaderValue::from_str(key.as_str()).map_err(|e| {
                reqwest_middleware::Error::middleware(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("the operation key is not a valid header value: {e}"),
                ))
            })?;
            req.headers_mut().insert(IDEMPOTENCY_KEY, value);
        }
        let response = next.run(req, extensions).await?;
        if let Some(wait) = self.wait_before_retry(&response) {
            tracing::debug!(
                status = response.status().as_u16(),
                wait_ms = wait.as_millis() as u64,
                "waiting out Retry-After"
            );
            tokio::time::sleep(wait).await;
        }
        Ok(response)
    }
}

/// Which answers of an idem server a retry can change: connection errors, timeouts, 5xx,
/// 408, 425, 429 and an in-flight 409 (it carries `Retry-After`); never a fingerprint
/// mismatch (409 without `Retry-After`, 422, 400), never any other 4xx, and never an answer
/// carrying `x-should-retry: false`, which an idem server sends when no retry can change
/// the outcome. Use it with
/// [`reqwest_retry::RetryTransientMiddleware::new_with_policy_and_strategy`], or through
/// [`retry_transient`].
#[derive(Clone, Copy, Debug, Default)]
pub struct IdempotencyRetryStrategy;

impl RetryableStrategy for IdempotencyRetryStrategy {
    fn handle(&self, res: &Result<Response, reqwest_middleware::Error>) -> Option<Retryable> {
        match res {
            Ok(response) => classify(response),
            // Timeouts and connection errors are transient; a failing middleware is not.
            Err(e) => reqwest_retry::default_on_request_failure(e),
        }
    }
}

fn classify(response: &Response) -> Option<Retryable> {
    let headers = response.headers();
    let status = response.status();
    if status.is_success() || headers.contains_key(IDEMPOTENT_REPLAYED) {
        return None;
    }
    if headers.get("x-should-retry").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"false")) {
        return Some(Retryable::Fatal);
    }
    let in_flight = status == StatusCode::CONFLICT && retry_after(headers).is_some();
    if status.is_server_error() || matches!(status.as_u16(), 408 | 425 | 429) || in_flight {
        Some(Retryable::Transient)
    } else {
        Some(Retryable::Fatal)
    }
}

/// `reqwest-retry`'s retry middleware with `policy` (backoff, jitter, budget) and
/// [`IdempotencyRetryStrategy`].
pub fn retry_transient<P: RetryPolicy + Send + Sync + 'static>(
    policy: P,
) -> RetryTransientMiddleware<P, IdempotencyRetryStrategy> {
    RetryTransientMiddleware::new_with_policy_and_strategy(policy, IdempotencyRetryStrategy)
}
