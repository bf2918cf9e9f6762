//! Operator settings with DESIGN.md's defaults.

use std::time::Duration;

use crate::key::DEFAULT_MAX_KEY_LEN;

/// What the HTTP layer (or any caller) does when the store cannot be reached.
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

/// Status used for a fingerprint mismatch (same key, different request).
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
    #[must_use]
    pub fn code(self) -> u16 {
        match self {
            MismatchStatus::Conflict => 409,
            MismatchStatus::UnprocessableContent => 422,
            MismatchStatus::BadRequest => 400,
        }
    }
}

/// Retention, lease and caching rules. `Policy::default()` is DESIGN.md's table.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Policy {
    /// How long a record lives after its claim (default 24 h, matching Stripe; provisioning
    /// APIs often want 7 d). Always at least `lease_ttl`, so a live claim is never swept.
    pub retention: Duration,
    /// How long an in-flight claim is honoured (default 5 min). A handler killed mid-flight
    /// blocks retries for at most this long; a handler slower than this may run twice, so
    /// keep it above the endpoint's worst-case latency.
    pub lease_ttl: Duration,
    /// Longest accepted key, bytes (default 255).
    pub max_key_len: usize,
    /// Largest request body the layer buffers to fingerprint, bytes (default 1 MiB);
    /// larger requests get 413 and no claim.
    pub max_request_body: usize,
    /// Largest response body stored for replay, bytes (default 1 MiB). Larger responses
    /// still complete the record; the replay reports the body was not retained.
    pub max_stored_body: usize,
    /// Bodies longer than this many bytes are stored LZ4-compressed (default 4 KiB).
    pub compress_over: usize,
    /// Request headers (lower-case) that enter the fingerprint (default `content-type`).
    pub fingerprint_headers: Vec<String>,
    /// How the body enters the fingerprint (default raw bytes; RFC 8785 canonical JSON is
    /// opt-in because it can merge requests an API treats as different).
    pub fingerprint_mode: crate::fingerprint::FingerprintMode,
    /// Response headers (lower-case) never stored, besides hop-by-hop ones (default
    /// `set-cookie`, `date`).
    pub header_deny_list: Vec<String>,
    /// 4xx statuses that are not stored because the server made no decision the client
    /// should see again (default 401, 403, 408, 409, 423, 425, 429).
    pub uncacheable_4xx: Vec<u16>,
    /// Status for a fingerprint mismatch (default 409).
    pub mismatch_status: MismatchStatus,
    /// Behaviour when the store fails (default fail closed).
    pub on_store_failure: StoreFailureMode,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(24 * 60 * 60),
            lease_ttl: Duration::from_secs(5 * 60),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            max_request_body: 1 << 20,
            max_stored_body: 1 << 20,
            compress_over: 4 << 10,
            fingerprint_headers: vec!["content-type".into()],
            fingerprint_mode: crate::fingerprint::FingerprintMode::Raw,
            header_deny_list: vec!["set-cookie".into(), "date".into()],
            uncacheable_4xx: vec![401, 403, 408, 409, 423, 425, 429],
            mismatch_status: MismatchStatus::Conflict,
            on_store_failure: StoreFailureMode::FailClosed,
        }
    }
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and framing headers that describe one exchange,
/// never stored.
pub const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authenticate",
    "proxy-authorization",
    "content-length",
];

impl Policy {
    /// Sets the retention window.
    #[must_use]
    pub fn with_retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// Sets the lease TTL.
    #[must_use]
    pub fn with_lease_ttl(mut self, d: Duration) -> Self {
        self.lease_ttl = d;
        self
    }

    /// Sets the mismatch status.
    #[must_use]
    pub fn with_mismatch_status(mut self, s: MismatchStatus) -> Self {
        self.mismatch_status = s;
        self
    }

    /// Sets the store failure mode.
    #[must_use]
    pub fn with_store_failure_mode(mut self, m: StoreFailureMode) -> Self {
        self.on_store_failure = m;
        self
    }

    /// Sets the largest stored body, bytes.
    #[must_use]
    pub fn with_max_stored_body(mut self, bytes: usize) -> Self {
        self.max_stored_body = bytes;
        self
    }

    /// Sets the largest buffered request body, bytes.
    #[must_use]
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// Sets the fingerprinted request headers (names are lower-cased).
    #[must_use]
    pub fn with_fingerprint_headers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, names: I) -> Self {
        self.fingerprint_headers = names.into_iter().map(|s| s.into().to_ascii_lowercase()).collect();
        self
    }

    /// Sets the fingerprint mode.
    #[must_use]
    pub fn with_fingerprint_mode(mut self, mode: crate::fingerprint::FingerprintMode) -> Self {
        self.fingerprint_mode = mode;
        self
    }

    /// The retention actually applied: never shorter than the lease.
    #[must_use]
    pub fn effective_retention(&self) -> Duration {
        self.retention.max(self.lease_ttl)
    }

    /// Whether a response with `status` is stored and replayed (DESIGN.md "What is
    /// stored"): 2xx, and 4xx outside `uncacheable_4xx`. Never 1xx, 3xx or 5xx.
    #[must_use]
    pub fn is_cacheable(&self, status: u16) -> bool {
        match status {
            200..=299 => true,
            400..=499 => !self.uncacheable_4xx.contains(&status),
            _ => false,
        }
    }

    /// Whether a response header `name` is stored. Names compare case-insensitively
    /// (RFC 9110 §5.1), so a deny-list entry `X-Request-Id` also denies `x-request-id`.
    #[must_use]
    pub fn stores_header(&self, name: &str) -> bool {
        !HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
            && !self.header_deny_list.iter().any(|d| d.eq_ignore_ascii_case(name))
    }

    /// Sets the response headers never stored besides hop-by-hop ones (default
    /// `set-cookie`, `date`; per-exchange ids such as `x-request-id` belong here too).
    #[must_use]
    pub fn with_header_deny_list<I: IntoIterator<Item = S>, S: Into<String>>(mut self, names: I) -> Self {
        self.header_deny_list = names.into_iter().map(|s| s.into().to_ascii_lowercase()).collect();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cacheable_statuses_follow_the_design() {
        let p = Policy::default();
        for s in [200, 201, 202, 204, 400, 404, 410, 422] {
            assert!(p.is_cacheable(s), "{s}");
        }
        for s in [100, 301, 303, 401, 403, 408, 409, 423, 425, 429, 500, 502, 503, 504] {
            assert!(!p.is_cacheable(s), "{s}");
        }
    }

    #[test]
    fn retention_never_shorter_than_lease() {
        let p = Policy::default().with_retention(Duration::from_secs(1)).with_lease_ttl(Duration::from_secs(10));
        assert_eq!(p.effective_retention(), Duration::from_secs(10));
    }

    #[test]
    fn denied_and_hop_by_hop_headers_are_not_stored() {
        let p = Policy::default();
        assert!(!p.stores_header("set-cookie"));
        assert!(!p.stores_header("date"));
        assert!(!p.stores_header("transfer-encoding"));
        assert!(p.stores_header("location"));
        assert!(p.stores_header("etag"));
        // A deny-list entry in another case still denies (a case-sensitive compare denied
        // nothing).
        let mut q = Policy::default();
        q.header_deny_list.push("X-Request-Id".into());
        assert!(!q.stores_header("x-request-id"));
        assert!(!q.stores_header("Set-Cookie"));
        assert!(!Policy::default().with_header_deny_list(["X-Trace"]).stores_header("x-trace"));
    }
}
