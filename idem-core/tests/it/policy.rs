//! The storage policy: cacheable statuses, retention against the lease, stored headers.

use std::time::Duration;

use idem_core::Policy;

/// The default rule of `docs/contract.md#cacheable-statuses`: 2xx and lasting 4xx are
/// stored; transient refusals, 1xx, 3xx and 5xx are not.
#[test]
fn only_2xx_and_lasting_4xx_are_cacheable_by_default() {
    let p = Policy::default();
    for s in [200, 201, 202, 204, 303, 400, 404, 410, 422] {
        assert!(p.is_cacheable(s), "{s}");
    }
    for s in [100, 300, 301, 302, 304, 307, 308, 401, 403, 408, 409, 423, 425, 429, 500, 502, 503, 504] {
        assert!(!p.is_cacheable(s), "{s}");
    }
}

/// A status taken out of the uncacheable list was still refused (or a 5xx let in).
#[test]
fn uncacheable_statuses_are_configurable_within_4xx() {
    let mut p = Policy::default();
    p.uncacheable_4xx = vec![404];
    assert!(!p.is_cacheable(404));
    assert!(p.is_cacheable(409));
    assert!(p.is_cacheable(429));
    p.uncacheable_4xx.clear();
    assert!(p.is_cacheable(401));
    assert!(!p.is_cacheable(500), "a 5xx is stored only when listed in cacheable_5xx");
}

#[test]
fn retention_never_shorter_than_lease() {
    let mut p = Policy::default();
    (p.retention, p.lease_ttl) = (Duration::from_secs(1), Duration::from_secs(10));
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
    for per_exchange in [
        "Access-Control-Allow-Origin",
        "access-control-expose-headers",
        "RateLimit",
        "ratelimit-policy",
        "X-RateLimit-Remaining",
    ] {
        assert!(!p.stores_header(per_exchange), "{per_exchange}");
    }
    assert!(p.stores_header("access") && p.stores_header("rate"));
    // A deny-list entry in another case still denies (a case-sensitive compare denied
    // nothing).
    let mut q = Policy::default();
    q.header_deny_list.push("X-Request-Id".into());
    assert!(!q.stores_header("x-request-id"));
    assert!(!q.stores_header("Set-Cookie"));
    assert!(!q.stores_header("set-cookie"), "pushing keeps the defaults");
}
