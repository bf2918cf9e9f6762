//! Retrying one logical operation under one idempotency key.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use rand::Rng;
use tokio::time::Instant;

/// The header the key travels in (draft-ietf-httpapi-idempotency-key-header §2).
pub(crate) const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The header a server sets on a replayed response.
pub(crate) const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The key of one logical operation. Create it once, before the first attempt, and pass
/// the same value to every retry; never derive it from the attempt, the time or a
/// per-attempt id (`docs/failures.md#client-makes-a-new-key-per-attempt`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OperationKey(String);

impl OperationKey {
    /// A fresh random key: a version-4 UUID (36 visible ASCII bytes).
    #[must_use]
    pub fn generate() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    /// A key the caller already has (from a journal, a job id). It must be visible ASCII,
    /// 1..=255 bytes, or the server answers 400.
    #[must_use]
    pub fn from_string(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    /// The key.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// When and how long to retry: `RetryPolicy::default().with_*(..)`.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    budget: Duration,
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    attempt_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            budget: Duration::from_secs(60),
            max_attempts: 20,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(5),
            attempt_timeout: Duration::from_secs(10),
        }
    }
}

impl RetryPolicy {
    /// Total time allowed for all attempts and waits (default 60 s; `Duration::MAX` for
    /// none). No new attempt starts once a wait would cross it, except that an in-flight
    /// 409's `Retry-After` reaching past it is cut so the last poll lands at its end.
    #[must_use]
    pub fn with_budget(mut self, d: Duration) -> Self {
        self.budget = d;
        self
    }

    /// Upper bound on attempts that did not find the operation in flight, the first
    /// included (default 20, at least 1): transport errors, timeouts, 5xx, 408, 425, 429.
    /// In-flight 409s are polls, bounded by the budget alone.
    #[must_use]
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// The first backoff (default 50 ms), doubling per retry, and the largest (default 5 s,
    /// at least `initial`). A server's `Retry-After` may ask for longer; it is honoured as
    /// long as the budget allows.
    #[must_use]
    pub fn with_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }

    /// Timeout of one attempt (default 10 s); a timeout is retried under the same key.
    #[must_use]
    pub fn with_attempt_timeout(mut self, d: Duration) -> Self {
        self.attempt_timeout = d;
        self
    }

    /// Backoff before retry number `retry` (1-based): full jitter over
    /// `min(max_backoff, initial * 2^(retry-1))`.
    fn backoff(&self, retry: u32) -> Duration {
        let exp = self.initial_backoff.saturating_mul(1u32 << retry.saturating_sub(1).min(20));
        let cap = exp.min(self.max_backoff);
        let ms = u64::try_from(cap.as_millis()).unwrap_or(u64::MAX);
        Duration::from_millis(rand::rng().random_range(0..=ms))
    }
}

/// What happened across the attempts of one operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttemptStats {
    /// Requests sent.
    pub attempts: u32,
    /// In-flight `409` answers (another attempt held the key); they do not count against
    /// [`RetryPolicy::with_max_attempts`].
    pub busy: u32,
    /// Connection errors and timeouts.
    pub transport_errors: u32,
    /// 5xx answers.
    pub server_errors: u32,
}

/// The final answer of an operation.
#[derive(Clone, Debug)]
pub struct Reply {
    /// Final status (2xx, or a 4xx the client does not retry).
    pub status: StatusCode,
    /// Final headers.
    pub headers: HeaderMap,
    /// Final body.
    pub body: Bytes,
    /// Whether the server replayed a stored response (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// Attempt counts.
    pub stats: AttemptStats,
}

/// Why an operation ended without a usable reply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The budget or the attempt cap ran out while the answer was still retryable. The
    /// operation may or may not have happened: retry later with the SAME key.
    #[error("gave up after {} attempts; the last failure was: {last}", stats.attempts)]
    GaveUp {
        /// Attempt counts.
        stats: AttemptStats,
        /// The last retryable failure, as text for humans.
        last: String,
        /// The last transport error, when the last failure was one.
        #[source]
        source: Option<reqwest::Error>,
    },
    /// The server said the key was already used for a different request (fingerprint
    /// mismatch). Retrying cannot help; the body is the server's problem document.
    #[error("idempotency key reused with a different request (status {status})")]
    Mismatch {
        /// 409, 422 or 400 as the server is configured.
        status: StatusCode,
        /// The problem body.
        body: Bytes,
    },
    /// The request could not be built (bad URL, bad header value).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
}

/// A reqwest client that sends every request of an operation under its key.
#[derive(Clone, Debug)]
pub struct IdempotentClient {
    http: reqwest::Client,
    policy: RetryPolicy,
}

impl IdempotentClient {
    /// Wraps `http` with `policy`.
    #[must_use]
    pub fn new(http: reqwest::Client, policy: RetryPolicy) -> Self {
        Self { http, policy }
    }

    /// Starts a request of `method` to `url` under `key`.
    #[must_use]
    pub fn request(&self, method: Method, url: impl Into<String>, key: &OperationKey) -> RequestBuilder<'_> {
        RequestBuilder {
            client: self,
            method,
            url: url.into(),
            key: key.clone(),
            headers: Vec::new(),
            body: Bytes::new(),
            error: None,
        }
    }
}

/// One operation being assembled; [`RequestBuilder::send`] runs the retry loop.
#[derive(Debug)]
pub struct RequestBuilder<'c> {
    client: &'c IdempotentClient,
    method: Method,
    url: String,
    key: OperationKey,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
    error: Option<String>,
}

impl RequestBuilder<'_> {
    /// Adds a header sent on every attempt.
    #[must_use]
    pub fn header(mut self, name: &str, value: &str) -> Self {
        match (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            (Ok(n), Ok(v)) => self.headers.push((n, v)),
            _ => self.error = Some(format!("bad header {name}")),
        }
        self
    }

    /// A JSON body (bytes sent as they are on every attempt, so the fingerprint matches).
    #[must_use]
    pub fn json_body(self, body: impl Into<Bytes>) -> Self {
        let mut s = self.header("content-type", "application/json");
        s.body = body.into();
        s
    }

    /// Runs the attempts.
    ///
    /// # Errors
    /// [`ClientError::Mismatch`] on a fingerprint mismatch, [`ClientError::GaveUp`] when
    /// the budget or attempt cap ran out, [`ClientError::InvalidRequest`] for a request
    /// that cannot be built. Any other 4xx is a [`Reply`], not an error.
    pub async fn send(self) -> Result<Reply, ClientError> {
        if let Some(e) = self.error {
            return Err(ClientError::InvalidRequest(e));
        }
        let policy = &self.client.policy;
        // A budget of `Duration::MAX` ("no budget") must not overflow the clock.
        let deadline = Instant::now().checked_add(policy.budget).unwrap_or_else(far_future);
        let mut stats = AttemptStats::default();
        let mut last: (String, Option<reqwest::Error>);
        loop {
            stats.attempts += 1;
            let mut req = self
                .client
                .http
                .request(self.method.clone(), &self.url)
                .timeout(policy.attempt_timeout)
                .header(IDEMPOTENCY_KEY, self.key.as_str())
                .body(self.body.clone());
            for (n, v) in &self.headers {
                req = req.header(n, v);
            }
            let mut server_wait = None;
            let mut in_flight = false;
            match req.send().await {
                Err(e) if e.is_builder() => return Err(ClientError::InvalidRequest(e.to_string())),
                Err(e) => {
                    stats.transport_errors += 1;
                    last = (format!("transport error: {e}"), Some(e));
                }
                Ok(resp) => {
                    let status = resp.status();
                    let headers = resp.headers().clone();
                    let body = match resp.bytes().await {
                        Ok(b) => b,
                        Err(e) => {
                            // The answer was lost on the way: same as a dropped response.
                            stats.transport_errors += 1;
                            last = (format!("response body lost: {e}"), Some(e));
                            if !wait_or_stop(policy, &stats, deadline, None, false).await {
                                return Err(gave_up(stats, last));
                            }
                            continue;
                        }
                    };
                    let retry_after = retry_after(&headers);
                    if status.is_success() || (status.is_client_error() && !is_retryable_4xx(status, retry_after)) {
                        if is_mismatch(status, &headers, retry_after, &body) {
                            return Err(ClientError::Mismatch { status, body });
                        }
                        let replayed =
                            headers.get(IDEMPOTENT_REPLAYED).and_then(|v| v.to_str().ok()).is_some_and(|v| v == "true");
                        return Ok(Reply { status, headers, body, replayed, stats });
                    }
                    if status == StatusCode::CONFLICT {
                        stats.busy += 1;
                        in_flight = true;
                    } else if status.is_server_error() {
                        stats.server_errors += 1;
                    }
                    server_wait = retry_after;
                    last = (format!("status {status}"), None);
                    if headers.get("x-should-retry").and_then(|v| v.to_str().ok()).is_some_and(|v| v == "false") {
                        // The server says no retry can change this answer (an idem server
                        // sends it on a record that does not decode): stop now rather
                        // than spend the budget on it.
                        last.0.push_str(" (x-should-retry: false)");
                        return Err(gave_up(stats, last));
                    }
                }
            }
            if !wait_or_stop(policy, &stats, deadline, server_wait, in_flight).await {
                return Err(gave_up(stats, last));
            }
        }
    }
}

fn gave_up(stats: AttemptStats, last: (String, Option<reqwest::Error>)) -> ClientError {
    ClientError::GaveUp { stats, last: last.0, source: last.1 }
}

/// Sleeps before the next attempt; false when the budget or attempt cap says stop.
async fn wait_or_stop(
    policy: &RetryPolicy,
    stats: &AttemptStats,
    deadline: Instant,
    server: Option<Duration>,
    in_flight: bool,
) -> bool {
    let backoff = policy.backoff(stats.attempts);
    let left = deadline.saturating_duration_since(Instant::now());
    match next_wait(policy, stats, left, backoff, server, in_flight) {
        Some(wait) => {
            tokio::time::sleep(wait).await;
            true
        }
        None => false,
    }
}

/// The pause before the next attempt, or `None` to stop: `left` is what remains of the
/// budget, `backoff` this retry's jittered backoff, `server` the answer's `Retry-After`,
/// `in_flight` whether the answer was an in-flight 409.
fn next_wait(
    policy: &RetryPolicy,
    stats: &AttemptStats,
    left: Duration,
    backoff: Duration,
    server: Option<Duration>,
    in_flight: bool,
) -> Option<Duration> {
    // In-flight polls are not failures; only the other attempts use up the cap.
    let failed = stats.attempts.saturating_sub(stats.busy);
    if !in_flight && failed >= policy.max_attempts {
        return None;
    }
    // Retry-After is a lower bound from the server; jittered backoff spreads the herd.
    let wait = server.map_or(backoff, |s| s.max(backoff));
    if wait < left {
        return Some(wait);
    }
    // An operation still running may finish before the budget does: poll once more at
    // the budget's end rather than give up on an answer that only says "not yet".
    (in_flight && !left.is_zero()).then(|| left.saturating_sub(BUDGET_END_MARGIN))
}

/// How long before the budget's end a last in-flight poll is sent, so that it starts
/// inside the budget.
const BUDGET_END_MARGIN: Duration = Duration::from_millis(10);

/// `Retry-After` as delay-seconds (RFC 9110 §10.2.3); HTTP-date forms are not used by
/// idem servers and count as absent.
///
/// Clamped to [`MAX_RETRY_AFTER`]: a broken or hostile server's `Retry-After` near
/// `u64::MAX` would otherwise overflow the clock when the client adds it to `now`. A value
/// that is not a number (or past `u64::MAX`) counts as absent.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let secs = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim().parse::<u64>().ok()?;
    Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER))
}

/// The longest `Retry-After` the client takes from a server: one day. Longer than any
/// budget worth setting, short enough that `now + wait` never overflows.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(86_400);

/// An instant a century away: the deadline of an unbounded budget.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 86_400)
}

/// 408, 425 and 429 are retried, and a 409 that carries `Retry-After` (request in flight).
fn is_retryable_4xx(status: StatusCode, retry_after: Option<Duration>) -> bool {
    matches!(status.as_u16(), 408 | 425 | 429) || (status == StatusCode::CONFLICT && retry_after.is_some())
}

/// The problem `type` of a fingerprint mismatch under idem-http's default base.
pub const MISMATCH_PROBLEM_TYPE: &str =
    "https://docs.rs/idem-http/latest/idem_http/problem/enum.ProblemKind.html#mismatch";

/// A mismatch is a fresh (not replayed) 400/409/422 answer whose RFC 9457 problem body
/// has a `type` ending in `#mismatch`, `/mismatch` or `:mismatch` (any server's base). Any
/// other 4xx problem, such as a handler's own 422 for an invalid body, is an ordinary reply.
fn is_mismatch(status: StatusCode, headers: &HeaderMap, retry_after: Option<Duration>, body: &[u8]) -> bool {
    let problem = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/problem+json"));
    let replayed = headers.contains_key(IDEMPOTENT_REPLAYED);
    if !problem || replayed || retry_after.is_some() || !matches!(status.as_u16(), 400 | 409 | 422) {
        return false;
    }
    #[derive(serde::Deserialize)]
    struct ProblemType {
        #[serde(rename = "type")]
        kind: Option<String>,
    }
    let slug = |t: String| t.rsplit(['#', '/', ':']).next() == Some("mismatch");
    serde_json::from_slice::<ProblemType>(body).ok().and_then(|p| p.kind).is_some_and(slug)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_jittered() {
        let p = RetryPolicy::default().with_backoff(Duration::from_millis(10), Duration::from_millis(100));
        for retry in 1..30 {
            assert!(p.backoff(retry) <= Duration::from_millis(100));
        }
    }

    /// The client gave up on the first in-flight 409 whose Retry-After (the whole remaining
    /// lease, on older servers) reached past the budget, or in-flight polls used up the cap.
    #[test]
    fn in_flight_polls_last_as_long_as_the_budget() {
        let p = RetryPolicy::default().with_max_attempts(2);
        let secs = Duration::from_secs;
        let polled = |attempts, busy| AttemptStats { attempts, busy, ..AttemptStats::default() };
        // Retry-After within the budget is honoured over a shorter backoff.
        assert_eq!(next_wait(&p, &polled(1, 1), secs(60), secs(0), Some(secs(2)), true), Some(secs(2)));
        // A Retry-After of 300 s against 60 s left: one last poll just before the end.
        assert_eq!(
            next_wait(&p, &polled(1, 1), secs(60), secs(0), Some(secs(300)), true),
            Some(secs(60) - BUDGET_END_MARGIN)
        );
        // Fifty polls in, with a cap of two attempts: still polling.
        assert_eq!(next_wait(&p, &polled(51, 50), secs(5), secs(0), Some(secs(1)), true), Some(secs(1)));
        // The budget is spent: stop.
        assert_eq!(next_wait(&p, &polled(51, 50), Duration::ZERO, secs(0), Some(secs(1)), true), None);
        // Failures still count: two 503s reach the cap of two.
        assert_eq!(next_wait(&p, &polled(2, 0), secs(60), secs(0), Some(secs(1)), false), None);
        assert_eq!(next_wait(&p, &polled(1, 0), secs(60), secs(0), Some(secs(1)), false), Some(secs(1)));
        // A 503's Retry-After past the budget is not cut: the client stops.
        assert_eq!(next_wait(&p, &polled(1, 0), secs(60), secs(0), Some(secs(300)), false), None);
    }

    /// A `Retry-After` of `u64::MAX` seconds was taken as is; `now + wait` (a sleep's
    /// deadline) then overflowed and panicked.
    #[test]
    fn retry_after_is_clamped_so_now_plus_it_cannot_overflow() {
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, u64::MAX.to_string().parse().unwrap());
        let wait = retry_after(&h).unwrap();
        assert_eq!(wait, MAX_RETRY_AFTER);
        assert!(std::time::Instant::now().checked_add(wait).is_some());
        let _ = Instant::now() + wait;
        h.insert(http::header::RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert(http::header::RETRY_AFTER, "99999999999999999999999".parse().unwrap());
        assert_eq!(retry_after(&h), None, "past u64::MAX: not a number the client can use");
    }

    #[test]
    fn busy_409_is_retried_mismatch_is_not() {
        assert!(is_retryable_4xx(StatusCode::CONFLICT, Some(Duration::from_secs(1))));
        assert!(!is_retryable_4xx(StatusCode::CONFLICT, None));
        assert!(!is_retryable_4xx(StatusCode::NOT_FOUND, None));
        assert!(is_retryable_4xx(StatusCode::TOO_MANY_REQUESTS, None));
    }

    #[test]
    fn only_the_mismatch_problem_type_is_a_mismatch() {
        // A handler's own 422 problem was reported as "key reused with a different request".
        let mut h = HeaderMap::new();
        h.insert(http::header::CONTENT_TYPE, "application/problem+json".parse().unwrap());
        let mismatch = br#"{"type":"https://docs.rs/idem-http/latest/idem_http/problem/enum.ProblemKind.html#mismatch","status":409}"#;
        let invalid = br#"{"type":"about:blank","status":422,"detail":"invalid worker spec"}"#;
        assert!(is_mismatch(StatusCode::CONFLICT, &h, None, mismatch));
        assert!(is_mismatch(StatusCode::UNPROCESSABLE_ENTITY, &h, None, mismatch));
        assert!(is_mismatch(StatusCode::BAD_REQUEST, &h, None, mismatch));
        assert!(!is_mismatch(StatusCode::UNPROCESSABLE_ENTITY, &h, None, invalid));
        assert!(!is_mismatch(StatusCode::CONFLICT, &h, Some(Duration::from_secs(1)), mismatch));
        h.insert(IDEMPOTENT_REPLAYED, "true".parse().unwrap());
        assert!(!is_mismatch(StatusCode::CONFLICT, &h, None, mismatch));
    }
}
