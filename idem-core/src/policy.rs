//! The record rules: how long a record lives and what it stores.
//!
//! A [`Policy`] answers the questions every front end asks of the record it writes,
//! whatever protocol it speaks: how long the record is retained, how long a claim's lease
//! lasts, which responses are stored for replay, and which parts of a response the stored
//! record keeps (headers, body size, compression). How requests are read (key length,
//! body limit, fingerprinted headers) and answered (mismatch status, store outages) is the
//! front end's business: `idem-http` sets those on its `IdempotencyLayer`.

use std::time::Duration;

/// The record rules: retention, lease, cacheable statuses, and what a stored response
/// keeps. `Policy::default()` gives 24 h retention, a 5 min lease, 2xx, 303 and most 4xx
/// stored, bodies up to 1 MiB kept, LZ4 over 4 KiB, `set-cookie` and `date` dropped.
///
/// Plain fields: no rule constrains another (a retention below the lease is raised by
/// [`Policy::effective_retention`], header names compare case-insensitively), so a
/// policy is changed by assigning to it:
///
/// ```
/// use std::time::Duration;
/// use idem_core::Policy;
///
/// let mut policy = Policy::default();
/// policy.retention = Duration::from_secs(7 * 86_400);
/// policy.header_deny_list.push("X-Request-Id".into());
/// assert!(!policy.stores_header("x-request-id") && !policy.stores_header("set-cookie"));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Policy {
    /// How long a record lives after its claim (default 24 h, matching Stripe; provisioning
    /// APIs often want 7 d). Always at least `lease_ttl`, so a live claim is never swept.
    pub retention: Duration,
    /// How long an in-flight claim is honoured without a renewal (default 5 min): a holder
    /// that dies blocks its key for at most this long. How to pick it, with and without
    /// lease renewal: `docs/contract.md#lease-ttl`.
    pub lease_ttl: Duration,
    /// 4xx statuses that are not stored because the server made no decision the client
    /// should see again (default 401, 403, 408, 409, 423, 425, 429). Entries outside
    /// 400..=499 change nothing: 2xx and 303 are always stored, 1xx and the other 3xx
    /// never (see [`Policy::is_cacheable`]).
    pub uncacheable_4xx: Vec<u16>,
    /// 5xx statuses stored like a 2xx, replayed to every retry until retention ends
    /// (default none: a 5xx marks the record failed and the retry runs again). Stripe's
    /// first API did this for a 500: only for handlers whose 5xx always means "settled,
    /// and retrying changes nothing" (`docs/contract.md#cacheable-statuses`).
    pub cacheable_5xx: Vec<u16>,
    /// Largest response body stored for replay, bytes (default 1 MiB). Larger responses
    /// still complete the record; the replay reports the body was not retained.
    pub max_stored_body: usize,
    /// Bodies longer than this many bytes are stored LZ4-compressed (default 4 KiB).
    pub compress_over: usize,
    /// Response headers never stored, besides hop-by-hop ones, those a response's
    /// `Connection` field names, and CORS and rate-limit fields (default `set-cookie`,
    /// `date`; per-exchange ids such as `x-request-id` belong here too). Names compare
    /// case-insensitively. Push to it
    /// rather than replace it: a list without `set-cookie` replays one client's session
    /// cookie to whoever retries with the key.
    pub header_deny_list: Vec<String>,
    /// When set, only these response headers are stored (default `None`: every header the
    /// rules above let through). The rules above still apply to the names it lists.
    pub header_allow_list: Option<Vec<String>>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(24 * 60 * 60),
            lease_ttl: Duration::from_secs(5 * 60),
            uncacheable_4xx: vec![401, 403, 408, 409, 423, 425, 429],
            max_stored_body: 1 << 20,
            compress_over: 4 << 10,
            header_deny_list: vec!["set-cookie".into(), "date".into()],
            cacheable_5xx: Vec::new(),
            header_allow_list: None,
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

/// Prefixes of fields that answer one exchange, not the operation, never stored: CORS
/// fields (`access-control-*`) follow the request's `Origin`, and rate-limit fields
/// (`RateLimit`, `RateLimit-Policy`, `X-RateLimit-*`) the caller's quota at that moment.
/// Set by a layer inside this one and replayed, they would answer another origin, or show
/// a stale quota, to the next caller.
const PER_EXCHANGE_PREFIXES: &[&str] = &["access-control-", "ratelimit", "x-ratelimit-"];

impl Policy {
    /// The retention actually applied: never shorter than the lease.
    #[must_use]
    pub fn effective_retention(&self) -> Duration {
        self.retention.max(self.lease_ttl)
    }

    /// Whether a response with `status` is stored and replayed: 2xx, 303, and 4xx outside
    /// `uncacheable_4xx` (the server made a durable change, or decided that none will
    /// ever happen), and a 5xx in `cacheable_5xx`. Never 1xx or any other 3xx.
    ///
    /// The 3xx rule (RFC 9110 §15.4): 303 See Other is how a server answers a POST whose
    /// work is done and whose result lives elsewhere (post/redirect/get), so it is stored
    /// like a 201. The others say the request was not processed here: 301, 302, 307 and
    /// 308 send the client to another URI (where the retry belongs), 300 asks it to
    /// choose, 304 answers a conditional GET, 305 and 306 are obsolete. A retry of those
    /// runs the handler again, which is what the redirected client expects.
    #[must_use]
    pub fn is_cacheable(&self, status: u16) -> bool {
        match status {
            200..=299 | 303 => true,
            400..=499 => !self.uncacheable_4xx.contains(&status),
            500..=599 => self.cacheable_5xx.contains(&status),
            _ => false,
        }
    }

    /// Whether a response header `name` is stored. Names compare case-insensitively
    /// (RFC 9110 §5.1), so a deny-list entry `X-Request-Id` also denies `x-request-id`.
    #[must_use]
    pub fn stores_header(&self, name: &str) -> bool {
        let per_exchange =
            |p: &&str| name.as_bytes().get(..p.len()).is_some_and(|h| h.eq_ignore_ascii_case(p.as_bytes()));
        !HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
            && !PER_EXCHANGE_PREFIXES.iter().any(per_exchange)
            && !self.header_deny_list.iter().any(|d| d.eq_ignore_ascii_case(name))
            && self.header_allow_list.as_ref().is_none_or(|a| a.iter().any(|n| n.eq_ignore_ascii_case(name)))
    }
}
