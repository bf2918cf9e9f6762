//! The request fingerprint: what makes a retry "the same request".
//!
//! BLAKE3 (`derive_key` context [`FINGERPRINT_CONTEXT`]) over the length-prefixed method,
//! path, query, each configured header (name lower-cased, in the configured order, every
//! value of a repeated header in arrival order) and the raw body bytes.
//!
//! Raw mode is the default: two bodies that differ in any byte are different requests,
//! even if they parse to the same JSON (handed case C13). Canonical JSON (RFC 8785) is a
//! separate opt-in mode, because canonicalising can merge requests an API treats as
//! different (`{"labels":{}}` versus no `labels`).

use std::fmt;

use serde::{Deserialize, Serialize};

/// BLAKE3 `derive_key` context for fingerprints.
pub const FINGERPRINT_CONTEXT: &str = "idem 2026-11-30 request fingerprint v1";

/// How the body enters the fingerprint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintMode {
    /// The raw body bytes (default).
    #[default]
    Raw,
}

/// 32-byte request fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &crate::scope::to_hex(&self.0)[..16])
    }
}

/// The parts of a request that the fingerprint covers.
#[derive(Clone, Copy, Debug)]
pub struct RequestParts<'a> {
    /// HTTP method, e.g. `POST`.
    pub method: &'a str,
    /// Path without the query, e.g. `/v1/workers`.
    pub path: &'a str,
    /// The query string without `?`, if any.
    pub query: Option<&'a str>,
    /// `(lower-case name, value)` for each configured header present, in configured order.
    pub headers: &'a [(&'a str, &'a [u8])],
    /// The body bytes.
    pub body: &'a [u8],
}

impl Fingerprint {
    /// Fingerprints `parts` in raw mode.
    #[must_use]
    pub fn of(parts: &RequestParts<'_>) -> Self {
        let mut h = blake3::Hasher::new_derive_key(FINGERPRINT_CONTEXT);
        let mut field = |tag: u8, bytes: &[u8]| {
            h.update(&[tag]);
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(b'M', parts.method.as_bytes());
        field(b'P', parts.path.as_bytes());
        // An absent query and an empty one (`/x?`) are different requests on the wire.
        match parts.query {
            Some(q) => field(b'Q', q.as_bytes()),
            None => field(b'q', b""),
        }
        for (name, value) in parts.headers {
            field(b'H', name.as_bytes());
            field(b'V', value);
        }
        field(b'B', parts.body);
        Self(*h.finalize().as_bytes())
    }

    /// Fingerprint of an arbitrary byte string, for non-HTTP callers (a job id, a CLI
    /// invocation) that define "the same request" themselves.
    #[must_use]
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self::of(&RequestParts { method: "", path: "", query: None, headers: &[], body: bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(body: &[u8]) -> Fingerprint {
        Fingerprint::of(&RequestParts {
            method: "POST",
            path: "/v1/workers",
            query: None,
            headers: &[("content-type", b"application/json")],
            body,
        })
    }

    #[test]
    fn raw_mode_distinguishes_reordered_json() {
        assert_eq!(fp(br#"{"a":1,"b":2}"#), fp(br#"{"a":1,"b":2}"#));
        assert_ne!(fp(br#"{"a":1,"b":2}"#), fp(br#"{"b":2, "a":1}"#));
        assert_ne!(fp(b""), fp(b"{}"));
        assert_ne!(fp(b"{}"), fp(b"null"));
    }

    #[test]
    fn method_path_query_and_headers_count() {
        let base = RequestParts { method: "POST", path: "/a", query: None, headers: &[], body: b"x" };
        let f = Fingerprint::of(&base);
        assert_ne!(f, Fingerprint::of(&RequestParts { method: "PUT", ..base }));
        assert_ne!(f, Fingerprint::of(&RequestParts { path: "/b", ..base }));
        assert_ne!(f, Fingerprint::of(&RequestParts { query: Some(""), ..base }));
        assert_ne!(f, Fingerprint::of(&RequestParts { headers: &[("content-type", b"text/plain")], ..base }));
        // Moving bytes between fields changes the hash.
        assert_ne!(
            Fingerprint::of(&RequestParts { path: "/ab", body: b"", ..base }),
            Fingerprint::of(&RequestParts { path: "/a", body: b"b", ..base })
        );
    }
}
