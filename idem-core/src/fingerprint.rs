//! The request fingerprint: what makes a retry "the same request".
//!
//! BLAKE3 (`derive_key` context [`FINGERPRINT_CONTEXT`]) over the length-prefixed method,
//! path, query, each configured header (name lower-cased, in the configured order, every
//! value of a repeated header in arrival order) and the raw body bytes.
//!
//! Raw mode is the default: two bodies that differ in any byte are different requests,
//! even if they parse to the same JSON (`docs/failures.md#json-formatting-changes-the-fingerprint`). Canonical JSON (RFC 8785) is a
//! separate opt-in mode (feature `canonical-json`), because canonicalising can merge requests an API treats as
//! different (`{"labels":{}}` versus no `labels`).

use std::fmt;

use serde::{Deserialize, Serialize};

/// BLAKE3 `derive_key` context for fingerprints.
pub const FINGERPRINT_CONTEXT: &str = "idem 2026-11-30 request fingerprint v1";

/// How the body enters the fingerprint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintMode {
    /// The raw body bytes (default): any byte of difference is another request.
    #[default]
    Raw,
    /// A body that parses as JSON enters as its RFC 8785 (JCS) canonical form, so an
    /// honest retry whose serialiser reorders object members or changes whitespace is
    /// still the same request. Array order, `null` versus an absent member, and `{}`
    /// versus an empty body still differ (`docs/contract.md#fingerprint`).
    ///
    /// Falls back to the raw bytes, so distinct bodies are never merged by accident, when
    /// the body is empty, is not valid JSON, or holds a number of magnitude 2^53 or more,
    /// however written (JCS numbers are IEEE doubles, which would merge `9007199254740993`
    /// with `9007199254740992`, or `18446744073709551616` with `18446744073709552000`).
    /// Numbers that are doubles already compare as doubles: `1.0` and `1` are one request
    /// in this mode. Duplicate member names keep the last value, as serde_json parses
    /// them. Feature `canonical-json`.
    #[cfg(feature = "canonical-json")]
    CanonicalJson,
}

/// 2^53: from here on a double may stand for more than one integer.
#[cfg(feature = "canonical-json")]
const MAX_EXACT_INTEGER: f64 = 9_007_199_254_740_992.0;

#[cfg(feature = "canonical-json")]
fn exact_in_double(v: &serde_json::Value) -> bool {
    match v {
        // As a double, 2^53 + 1 reads 2^53, and an integer past 64 bits is parsed as one.
        serde_json::Value::Number(n) => n.as_f64().is_some_and(|f| f.abs() < MAX_EXACT_INTEGER),
        serde_json::Value::Array(a) => a.iter().all(exact_in_double),
        serde_json::Value::Object(o) => o.values().all(exact_in_double),
        _ => true,
    }
}

/// The RFC 8785 canonical form of `body`, or `None` when the body falls back to raw
/// bytes (see [`FingerprintMode::CanonicalJson`]).
#[cfg(feature = "canonical-json")]
#[must_use]
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    if body.is_empty() {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    if !exact_in_double(&value) {
        return None;
    }
    serde_json_canonicalizer::to_vec(&value).ok()
}

/// 32-byte request fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Fingerprint(pub(crate) [u8; 32]);

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
    /// A fingerprint from its 32 bytes, e.g. read back from a store.
    #[must_use]
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes.
    #[must_use]
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Fingerprints `parts` in raw mode.
    #[must_use]
    pub fn of(parts: &RequestParts<'_>) -> Self {
        Self::of_mode(parts, FingerprintMode::Raw)
    }

    /// Fingerprints `parts` with the body taken as `mode` says. A canonicalised body is
    /// hashed under another tag than raw bytes, so the two modes never collide.
    #[must_use]
    pub fn of_mode(parts: &RequestParts<'_>, mode: FingerprintMode) -> Self {
        let mut h = crate::hash::Fields::new(&crate::hash::FINGERPRINT_HASHER, FINGERPRINT_CONTEXT);
        let mut field = |tag: u8, bytes: &[u8]| {
            h.write(&[tag]);
            h.prefixed(bytes);
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
        match mode {
            #[cfg(feature = "canonical-json")]
            FingerprintMode::CanonicalJson => match canonical_json(parts.body) {
                Some(canonical) => field(b'J', &canonical),
                None => field(b'B', parts.body),
            },
            FingerprintMode::Raw => field(b'B', parts.body),
        }
        Self(h.finalize())
    }

    /// Fingerprint of an arbitrary byte string, for non-HTTP callers (a job id, a CLI
    /// invocation) that define "the same request" themselves.
    #[must_use]
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self::of(&RequestParts { method: "", path: "", query: None, headers: &[], body: bytes })
    }
}
